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
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fpaudit._process import Owner
from fpaudit.errors import FpauditError, Named, ReportError, ReportExists, UsageError

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
                report.write_meta(staging, files, ranks=world, complete=complete)
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
