"""Runs on several processes (torch.distributed, torchrun): one report, one part per rank.

Each rank captures its own backward values (its own data shard, its own
activations) and writes its own tables into ``rank-NNNNN/`` of one report
directory; rank 0 writes ``meta.json`` with every part's checksum and moves
the directory into place, so the report appears whole or not at all. Reading
merges the parts exactly: records of all ranks are pooled, so counts add and
the amax (hence the recommendation) is the largest over all ranks; each
record keeps its ``rank``.

The ranks must share a filesystem for the report directory (one node, or a
shared mount across nodes).

With ``DistributedDataParallel`` the parameter gradients (``kind = grad``) are
the all-reduced ones, identical on every rank; the backward-op values differ
per rank, and DDP's copies of gradients into its buckets are recorded under
their parameters' modules (its all-reduce is not: see ``capture.oprules._NOT_VALUES``).
Under FSDP2 (``fully_shard``) backward values inside modules are attributed as
usual and each rank records its own shard of every parameter gradient (the
DTensor's local part); FSDP's all-gather copies and uninitialised buffers are
not values and are not recorded. FSDP1 (``FullyShardedDataParallel``): module
names are the model's own (the wrapper segments are dropped, see
``capture.clock.model_name``); each rank records its shard of the original parameters'
gradients (``use_orig_params=True``) or of each unit's flat parameter
(``_flat_param``, under the unit's module).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fpaudit._process import Owner
from fpaudit.errors import (
    FpauditError,
    ModelFileError,
    Named,
    ReportError,
    ReportExists,
    UsageError,
)

if TYPE_CHECKING:  # pandas and pyarrow: only once a report is written
    from fpaudit.report.store import Report


def active() -> bool:
    """True when a process group with more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def launched() -> bool:
    """True when this process was started by torchrun (or a launcher that sets the same)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def leads() -> bool:
    """True on the process that locks the report, shows progress and sums up: rank 0
    of a torchrun launch, or the one process of a plain run."""
    return int(os.environ.get("RANK", "0")) == 0 if launched() else True


def init_from_environment(device: torch.device) -> tuple[int, int]:
    """Join the process group torchrun set up (gloo on CPU, nccl on CUDA); (rank, world)."""
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        # Any other way out (an error, SIGTERM, sys.exit) leaves the group at exit, while
        # the interpreter is whole; without a barrier, as a failed rank may be alone.
        atexit.register(_leave_at_exit, Owner())
    return dist.get_rank(), dist.get_world_size()


def _leave_at_exit(owner: Owner) -> None:
    if owner.here():  # not in a forked child: the group is its parent's
        shutdown(wait=False)


def shutdown(*, wait: bool = True) -> None:
    """Leave the process group before the process exits, on every exit path.

    A process that exits with its gloo group still alive tears the group's worker
    threads down during interpreter finalisation, which now and then aborts it
    ("terminate called without an active exception"): destroy it while Python is
    whole. ``wait``: first meet every rank at a barrier, so that no rank destroys the
    group while a peer still reads the last collective's data; only where every rank
    is known to get here (a normal end), never on an error path, where a rank that
    failed alone would wait forever for the others.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if wait and dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


def local_device(spec: str) -> str:
    """Under torchrun, ``auto`` and ``cuda`` mean this rank's own GPU (LOCAL_RANK)."""
    if spec in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return spec


def write_report(report: Report, path: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Every rank calls this: each writes its part, rank 0 the metadata. One process: plain write.

    A problem on any rank (the target exists, a disk error) is raised on every rank, so
    no rank waits forever; nothing is left behind.
    """
    from fpaudit import _signals

    if not active():
        return report.write(path, force=force)
    with _signals.deferred():  # SIGINT/SIGTERM wait for the write, as in Report.write
        return _write_parts(report, Path(path), force)


def _write_parts(report: Report, target: Path, force: bool) -> Path:
    from fpaudit.report.files import check_target, finish, new_staging, output_errors
    from fpaudit.report.store import rank_prefix

    rank, world = dist.get_rank(), dist.get_world_size()
    plan: list[Any] = [None]
    if rank == 0:
        try:
            with output_errors(target):
                plan = [("ok", str(new_staging(check_target(target, force))))]
        except ReportExists:
            plan = [("exists", str(target))]
        except UsageError as error:  # a parent folder that cannot be created
            plan = [("usage", _parts(error))]  # its parts: the CLI words them as flags
        except ReportError as error:
            plan = [("error", _parts(error))]
    dist.broadcast_object_list(plan, src=0)
    status, value = plan[0]
    if status == "exists":
        raise ReportExists(value)
    if status == "usage":
        raise UsageError(*value)
    if status == "error":
        raise ReportError(*value)
    staging = Path(value)
    try:
        with output_errors(target):
            mine: tuple[str, Any] = ("ok", report.write_tables(staging, rank_prefix(rank)))
    except Exception as error:  # tell the others before raising
        mine = ("error", (f"rank {rank}: ", *_parts(error)))
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, (mine, report.complete))
    outcome: list[Any] = [("ok", "")]
    if rank == 0:
        errors = [entry[1] for entry, _ in parts if entry[0] == "error"]
        try:
            if errors:
                raise ReportError(f"writing {target} failed: ", *errors[0])
            files = {name: e for entry, _ in parts for name, e in entry[1].items()}
            complete = all(done for _, done in parts)
            with output_errors(target):
                info = dataclasses.replace(report.info, ranks=world, complete=complete)
                report.write_meta(staging, files, info)
                finish(staging, target)
        except Exception as error:
            shutil.rmtree(staging, ignore_errors=True)
            outcome = [("error", _parts(error))]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0][0] == "error":
        raise ReportError(*outcome[0][1])
    report.path = target
    return target


def _parts(error: BaseException) -> tuple[str | Named, ...]:
    """What an error says, as parts another rank can raise again (``Named`` parameters
    stay parameters, so the CLI still words them as flags)."""
    return error.wording.parts if isinstance(error, FpauditError) else (str(error),)


# -- the ranks agree on the end ---------------------------------------------------------
# What each rank says before each step (one all-reduce of one number per rank): it has a
# batch, its batches ended, or a signal arrived (SIGINT, SIGTERM) since the last step.
_GO, _ENDED, _SIGINT, _SIGTERM = 0, 1, 2, 3
_SIGNALS = {int(signal.SIGINT): ("SIGINT", _SIGINT), int(signal.SIGTERM): ("SIGTERM", _SIGTERM)}
# What a collective's failure says when a peer's process went away (gloo, NCCL)
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "gloo", "NCCL", "DistBackendError", "DistNetworkError")  # fmt: skip
# How long a rank whose collective failed waits for the failing rank's word in the store
# (that rank wrote it before leaving, which is what failed the collective)
PEER_WORD_WAIT_S = 2.0


class RankFailed(ModelFileError):
    """Another rank of the launch failed (its error, in its words) or its process ended
    without a word; this rank stopped too. Exit 2."""


@dataclass(frozen=True)
class Stop:
    """Why the ranks stopped together before a step: the ranks whose batches ended
    (``ended``), or the signal that arrived (``signal_name``, with its exit code)."""

    ended: tuple[int, ...] = ()
    signal_name: str | None = None
    exit_code: int = 0


class Peers:
    """What the ranks of one launch tell each other besides the model's collectives.

    Before each step every rank says, in one all-reduce of one number per rank, whether
    it has a batch and whether SIGINT or SIGTERM arrived (:meth:`agree`): a rank whose
    batches ended stops every rank there, and a signal stops every rank at the same step,
    so that the report is written by every rank (a rank that stopped alone would leave
    the others waiting in DDP's all-reduce until gloo's 30-minute timeout). A rank that
    fails in a step cannot meet the others there: it leaves its error in the launch's
    key-value store (torchrun's TCPStore; :meth:`fail`) and exits, which fails the
    collective its peers wait in; they then read its words (:meth:`failure`) and stop
    with them. Known limitation: NCCL does not fail a collective when a peer's process
    ends; there a rank that fails mid-step leaves its peers waiting until NCCL's timeout.
    """

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.store = _launch_store()
        self._signal: tuple[str, int] | None = None  # (name, word) of a signal held

    @contextmanager
    def signals_held(self) -> Iterator[None]:
        """SIGINT and SIGTERM only remembered inside the block, for :meth:`agree` to
        tell every rank (torchrun sends them to every rank, at different points of a
        step). Main thread only; elsewhere nothing changes."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def remember(signum: int, frame: object) -> None:
            if self._signal is None:
                self._signal = _SIGNALS[signum]

        previous = {number: signal.signal(number, remember) for number in _SIGNALS}
        try:
            yield
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

    def agree(self, have_batch: bool) -> Stop | None:
        """Every rank's word before a step; None when every rank goes on."""
        mine = _GO if have_batch else _ENDED
        if self._signal is not None:
            mine = self._signal[1]
        words = torch.zeros(self.world, dtype=torch.int64, device=self.device)
        words[self.rank] = mine
        dist.all_reduce(words)
        said = words.tolist()
        if not any(said):
            return None
        for code, name, exit_code in ((_SIGTERM, "SIGTERM", 143), (_SIGINT, "SIGINT", 130)):
            if code in said:
                return Stop(signal_name=name, exit_code=exit_code)
        return Stop(ended=tuple(r for r, word in enumerate(said) if word == _ENDED))

    def failure(self, error: BaseException) -> FpauditError:
        """What this rank says after ``error`` ended its steps: a peer's words when a peer
        failed first (the collective this rank waited in failed because it left), else
        this rank's own error, left in the store for the others."""
        said = self._peer_word(wait=0.0)
        if said is None and looks_like_peer_gone(error):
            said = self._peer_word(wait=PEER_WORD_WAIT_S)
            if said is None:
                return RankFailed(
                    "another rank's process ended without a word (killed, or it crashed); "
                    f"rank {self.rank} stopped: {first_line(_peer_gone(error) or error)}"
                )
        if said is not None:
            return RankFailed(said)
        own = error if isinstance(error, FpauditError) else None
        words = own.as_flag() if own is not None else f"{type(error).__name__}: {first_line(error)}"
        self._leave_word(f"rank {self.rank} failed: {words}")
        return own if own is not None else ModelFileError(f"rank {self.rank}: {words}")

    def _leave_word(self, words: str) -> None:
        if self.store is None:
            return
        # the first rank to fail is the one the others name; with the store gone too,
        # the others say "without a word"
        with contextlib.suppress(Exception):
            self.store.compare_set("failed", "", words)

    def _peer_word(self, *, wait: float) -> str | None:
        if self.store is None:
            return None
        deadline = time.monotonic() + wait
        while True:
            try:
                if self.store.check(["failed"]):
                    return bytes(self.store.get("failed")).decode()
            except Exception:
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


def _launch_store() -> Any:
    """A client of the launch's key-value store (torchrun's, or rank 0's where the
    process group was set up from MASTER_ADDR/MASTER_PORT), under keys of this
    launch and restart; None where there is none to reach."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        client = dist.TCPStore(  # type: ignore[attr-defined]  # public, re-exported from C
            host, int(port), is_master=False, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=10),
        )  # fmt: skip
    except Exception:
        return None
    launch = os.environ.get("TORCHELASTIC_RUN_ID", "")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"fpaudit/{launch}/{restart}/", client)  # type: ignore[attr-defined]


def looks_like_peer_gone(error: BaseException) -> bool:
    """True when ``error`` (or what it was raised from) is a collective that failed
    because a peer went away."""
    return _peer_gone(error) is not None


def _peer_gone(error: BaseException) -> BaseException | None:
    """The innermost error of ``error``'s chain that says a peer went away, or None."""
    found, seen = None, error
    for _ in range(16):  # (a chain is short; a cycle is not followed)
        if isinstance(seen, dist.DistError) or any(w in str(seen) for w in _PEER_GONE):
            found = seen
        following = seen.__cause__ or seen.__context__
        if following is None:
            break
        seen = following
    return found


def first_line(error: BaseException) -> str:
    """An error's first line, without the C++ source location gloo puts before it."""
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    text = _SOURCE_LOCATION.sub("", text)
    return text.split(". This is typically caused by", 1)[0]  # gloo's advice: torchrun's job


# "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] " before gloo's words
_SOURCE_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")
