"""The report: a directory of Parquet tables plus ``meta.json``, written only here
(other outputs, JUnit files and images, go through ``fpaudit.report.outputs.write_atomically``).

Schema version 4 (documented in the README, "Report format"; version 1 reports,
whose steps table lacks the training-loop columns, version 2 reports, which
have no block statistics, and version 3 reports, whose block counts are int64,
are read too):

``records.parquet``
    One row per (step, kind, module, node, op, output, dtype): the statistics
    of every tensor recorded under that key in that step.
``bins.parquet``
    The nonzero finite histogram bins of each record: ``binade`` is
    ``floor(log2|x|)``, ``cls`` the mantissa class (see ``histogram``),
    ``lower``/``upper`` the smallest and largest magnitude the bin can hold
    (both inclusive), ``count`` the number of values.
``steps.parquet``
    One row per step: loss, loss scale in force and after the update, skipped,
    clipping, backward calls, whether it was captured, wall time.
``blocks.parquet`` (only with ``--recipe``; version 3)
    One row per (step, record key, recipe): block-scaled statistics of the
    record's tensors (see ``fpaudit.kernels.blockstats``): class and block counts, and
    the scale-code and dynamic-range histograms as lists. From version 4 the
    counts are float64: whole numbers, except a stochastic-rounding recipe's
    expected counts (``nvfp4-sr``); version 3 wrote int64, read as float64.
``meta.json``
    Versions, device, command, config, module order, and per file its row
    count and SHA-256, checked on every read.

A report is written to a temporary directory beside the target, fsynced and
renamed into place, so a crash never leaves a half-written report. Reading
never unpickles or executes anything: JSON and Parquet only.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime as _dt
import errno
import fcntl
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from fpaudit import _signals
from fpaudit.errors import Named, ReportError, ReportExists
from fpaudit.numerics import layout, limits
from fpaudit.report.outputs import (
    STAGING_SUFFIX,
    current_umask,
    hidden_sibling,
    make_parent,
    staging_prefix,
)
from fpaudit.report.records import (
    BIN_COLUMNS,
    BLOCK_COUNT_COLUMNS,
    BLOCK_HISTOGRAM_COLUMNS,
    BLOCK_HISTOGRAM_WIDTHS,
    BLOCK_KEY_COLUMNS,
    ORIGIN_COLUMNS,
    ORIGINS_TABLE,
    RECORD_COLUMNS,
    STEP_COLUMNS,
    STEP_DEFAULTS,
    ReportBuilder,
)
from fpaudit.report.runinfo import RunInfo

__all__ = [
    "BINS_SCHEMA",
    "RECORDS_SCHEMA",
    "SCHEMA_VERSION",
    "STEPS_SCHEMA",
    "Report",
    "run_metadata",
]

SCHEMA_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
META_FILE = "meta.json"
# A reader trusts nothing it has not checked: meta.json is read only up to this size
# (a model of 100,000 modules needs a few MB) and this nesting depth (fpaudit writes 3).
MAX_META_BYTES = 64 << 20
MAX_META_DEPTH = 32
_INT32_MAX = 2**31 - 1  # steps are int32 in the tables
_MAX_RANKS = 2**15  # ranks are int16 in the tables
_FP32_MAX = float(np.finfo(np.float32).max)

_ARROW_TYPES = {
    "int8": pa.int8(),
    "int16": pa.int16(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float64": pa.float64(),
    "bool": pa.bool_(),
    "string": pa.string(),
}
RECORDS_SCHEMA = pa.schema([(name, _ARROW_TYPES[t]) for name, t in RECORD_COLUMNS.items()])
BINS_SCHEMA = pa.schema(
    [
        ("record_id", pa.int32()),
        ("binade", pa.int16()),
        ("cls", pa.int8()),
        ("lower", pa.float64()),
        ("upper", pa.float64()),
        ("count", pa.int64()),
    ]
)
STEPS_SCHEMA = pa.schema([(name, _ARROW_TYPES[t]) for name, t in STEP_COLUMNS.items()])
TABLES = {"records": RECORDS_SCHEMA, "bins": BINS_SCHEMA, "steps": STEPS_SCHEMA}
ORIGINS_SCHEMA = pa.schema([(name, _ARROW_TYPES[t]) for name, t in ORIGIN_COLUMNS.items()])


def _blocks_schema(counts: pa.DataType) -> pa.Schema:
    return pa.schema(
        [(name, _ARROW_TYPES[t]) for name, t in BLOCK_KEY_COLUMNS.items()]
        + [(name, counts) for name in BLOCK_COUNT_COLUMNS]
        + [(name, pa.list_(pa.int64())) for name in BLOCK_HISTOGRAM_COLUMNS]
    )


# float64 counts from version 4: a stochastic-rounding recipe's are expected values
BLOCKS_SCHEMA = _blocks_schema(pa.float64())
_V3_BLOCKS_SCHEMA = _blocks_schema(pa.int64())
# Optional tables, written only when present and read only when listed in meta.json's
# files (older reports have none): scan --origins's op calls (fpaudit.rules.origins) and,
# from version 3, block-scaled statistics when recipes were audited (fpaudit.kernels.blockstats).
OPTIONAL_TABLES = {ORIGINS_TABLE: ORIGINS_SCHEMA, "blocks": BLOCKS_SCHEMA}
DERIVED_BIN_COLUMNS = ("lower", "upper")
T = TypeVar("T")


def histogram_layout() -> dict[str, Any]:
    """The histogram layout, stored in metadata so a report describes itself."""
    return {
        "binade_min": layout.BINADE_MIN,
        "binade_max": layout.BINADE_MAX,
        "fraction_bits": layout.FRACTION_BITS,
        "class_lower_bounds": list(layout.CLASS_LOWER_BOUNDS),
    }


def run_metadata(model: Any = None) -> dict[str, Any]:
    """Versions, time and device of this run (no file paths, no user data)."""
    import torch

    from fpaudit import __version__

    device = "cpu"
    if model is not None:
        first = next(iter(model.parameters()), None)
        if first is not None:
            device = str(first.device)
    device_name = platform.processor() or platform.machine()
    if device.startswith("cuda") and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name(torch.device(device))
    return {
        "fpaudit_version": __version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "device": device,
        "device_name": device_name,
    }


@dataclass
class Report:
    """An in-memory report: metadata and three tables (pandas DataFrames)."""

    meta: dict[str, Any]
    records: pd.DataFrame
    bins: pd.DataFrame
    steps: pd.DataFrame
    path: Path | None = field(default=None, compare=False)
    origins: pd.DataFrame | None = field(default=None, compare=False)  # scan --origins

    @property
    def info(self) -> RunInfo:
        """The run this report describes, typed (read from ``meta`` each time, so an
        update of ``meta`` shows at once)."""
        return RunInfo.from_meta(self.meta)

    def record_run(
        self, run: RunInfo, settings: Mapping[str, Any], meta: Mapping[str, Any] | None = None
    ) -> None:
        """How every writer ends a run: stamp ``run`` on the metadata, then the command's
        own ``settings`` (its options as it ran), then the caller's ``meta``, which wins."""
        self.meta.update({**run.to_meta(), **settings, **(meta or {})})

    def update_info(self, **fields: Any) -> None:
        """Set the :class:`RunInfo` ``fields`` named (``report.update_info(formats=("fp16",))``)
        in the metadata, leaving the others as they are; an unknown name is a TypeError."""
        info = dataclasses.replace(self.info, **fields)
        self.meta.update(info.entries(*fields))

    @property
    def complete(self) -> bool:
        """False when the run was interrupted (the report then holds the completed steps)."""
        return self.info.complete

    def inexact_scales(self) -> list[float]:
        """The loss scales of captured values that are not powers of two (a training
        script's own choice, seen by ``fpaudit run``). Counts at another scale shift such
        values by whole binades as if the scale were 2**floor(log2 S), so they may be off
        by one binade; amax, and so the recommendation, divide by S exactly."""
        scales = np.unique(self.records["loss_scale"].to_numpy(dtype=np.float64))
        return [float(s) for s in scales if math.frexp(float(s))[0] != 0.5]

    def incompleteness(self) -> str | None:
        """Why the report is incomplete, in words, or None."""
        info = self.info
        if info.complete:
            return None
        by = info.stopped_by or "an interruption"
        done, asked = info.steps_run, info.steps_requested
        steps = (
            f" after {done} of {asked} step(s)" if done is not None and asked is not None else ""
        )
        return f"the run was stopped by {by}{steps}"

    @property
    def ranks(self) -> list[int]:
        """The torch.distributed ranks that recorded this report ([0] for one process)."""
        return sorted({int(r) for r in self.steps["rank"]} | {int(r) for r in self.records["rank"]})

    def for_rank(self, rank: int) -> Report:
        """What one rank recorded, as a report of its own (record ids renumbered; the
        optional tables keep that rank's rows)."""
        keep = (self.records["rank"] == rank).to_numpy()
        new_id = np.full(len(keep), -1, dtype=np.int64)
        new_id[keep] = np.arange(int(keep.sum()))
        bins = self.bins[keep[self.bins["record_id"].to_numpy()]]
        bins = bins.assign(record_id=new_id[bins["record_id"].to_numpy()].astype(np.int32))
        records = self.records[keep]
        records = records.assign(record_id=np.arange(len(records), dtype=np.int32))
        steps = self.steps[self.steps["rank"] == rank]
        meta = {**self.meta, "ranks": 1, "rank": rank}
        part = Report(
            meta,
            records.reset_index(drop=True),
            bins.reset_index(drop=True),
            steps.reset_index(drop=True),
        )
        for name in OPTIONAL_TABLES:
            table: pd.DataFrame | None = getattr(self, name)
            if table is not None:
                mine = self._rank_of_rows(name, table) == rank
                setattr(part, name, table[mine].reset_index(drop=True))
        return part

    def _rank_of_rows(self, name: str, table: pd.DataFrame) -> np.ndarray:
        """The rank that recorded each row of optional table ``name``: its ``rank`` column
        where it has one, else what the merge of ranks noted, else this report's one rank
        (-1 where a report of several ranks does not know)."""
        if "rank" in table.columns:
            column: np.ndarray = table["rank"].to_numpy(dtype=np.int64)
            return column
        noted = self._table_ranks.get(name)
        if noted is not None:
            return noted
        ranks = self.ranks
        return np.full(len(table), ranks[0] if len(ranks) == 1 else -1, dtype=np.int64)

    # Values derived from the tables (fpaudit.rules.analysis's condensed histograms), by key;
    # valid while the tables are unchanged. Filled only through ``cached``.
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    blocks: pd.DataFrame | None = field(default=None, compare=False)
    """Block-scaled statistics (``--recipe``), or None when no recipe was audited."""
    # Per optional table without a rank column (origins), the rank of each row, noted
    # when the ranks' parts of a report are merged (``for_rank`` splits them again).
    _table_ranks: dict[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    def cached(self, key: Hashable, compute: Callable[[], T]) -> T:
        """``compute()``, computed once per ``key`` for this report (a derived value
        such as a condensed histogram: several scales and formats cost one pass)."""
        if key not in self._cache:
            self._cache[key] = compute()
        result: T = self._cache[key]
        return result

    @classmethod
    def from_builder(
        cls, builder: ReportBuilder, meta: dict[str, Any], steps: dict[str, Any] | None = None
    ) -> Report:
        """The report ``builder`` has collected so far (see ``ReportBuilder.columns``);
        ``steps`` replaces its steps table (``fpaudit run`` knows more steps than it
        captured)."""
        records, bins, own_steps = builder.columns()
        offsets_to_bins = np.arange(layout.FIRST_FINITE_BIN, layout.INF_BIN)
        binade, cls_of = layout.bin_binade_and_class(offsets_to_bins)
        offsets = bins.pop("offset")
        bins["binade"] = binade[offsets].astype(np.int16)
        bins["cls"] = cls_of[offsets].astype(np.int8)
        # Through Arrow, so in-memory frames have exactly the dtypes a read gives.
        meta = {
            **meta,
            "steps": builder.steps,
            "window": builder.window,
            "modules": list(builder.modules),
        }
        return cls(
            meta,
            frame(records, RECORDS_SCHEMA),
            frame(bins, BINS_SCHEMA, BIN_COLUMNS),
            frame(own_steps if steps is None else steps, STEPS_SCHEMA),
        )

    @property
    def recipes(self) -> list[str]:
        """The recipes whose block statistics this report holds (meta ``recipes``)."""
        return list(self.info.recipes)

    # -- writing ---------------------------------------------------------
    def write(self, path: str | os.PathLike[str], *, force: bool = False) -> Path:
        """Write the report directory atomically; refuse to replace one unless ``force``.

        SIGINT and SIGTERM wait until the write is over (see ``_signals.deferred``): a
        report is never lost to a Ctrl-C, even a second one. A disk error (full,
        read-only, file too large, a name too long) is one ``ReportError``; an old
        report stays intact. Under ``torch.distributed`` with several ranks, every rank
        calls :func:`fpaudit.run.distributed.write_report` instead: each writes its part.
        """
        with _signals.deferred():
            target = Path(path)
            with output_errors(target):
                check_target(target, force)
                staging = new_staging(target)
                try:
                    files = self.write_tables(staging)
                    self.write_meta(staging, files)
                    finish(staging, target)
                except BaseException:
                    shutil.rmtree(staging, ignore_errors=True)
                    raise
            self.path = target
        return target

    def write_tables(self, directory: Path, prefix: str = "") -> dict[str, dict[str, Any]]:
        """Write the three tables, and the optional ones present, under ``directory /
        prefix``; their checksummed entries."""
        (directory / prefix).mkdir(parents=True, exist_ok=True)
        files: dict[str, dict[str, Any]] = {}
        for name, schema in {**TABLES, **OPTIONAL_TABLES}.items():
            frame: pd.DataFrame | None = getattr(self, name)
            if frame is None:
                continue  # an optional table this run did not make
            if name == "bins":
                lower, upper = layout.value_bounds(frame["binade"], frame["cls"])
                frame = frame.assign(lower=lower, upper=upper)
            table = pa.Table.from_pandas(frame[schema.names], schema=schema, preserve_index=False)
            table = table.replace_schema_metadata({"fpaudit.schema_version": str(SCHEMA_VERSION)})
            relative = f"{prefix}{name}.parquet"
            file = directory / relative
            pq.write_table(table, file, compression="zstd")
            files[relative] = {"rows": table.num_rows, "sha256": _sha256(file)}
            _fsync(file)
        return files

    def write_meta(self, directory: Path, files: dict[str, dict[str, Any]], **extra: Any) -> None:
        meta = {**self.meta, **extra}
        meta["schema_version"] = SCHEMA_VERSION
        meta["histogram"] = histogram_layout()
        meta["files"] = files
        meta_file = directory / META_FILE
        meta_file.write_text(json.dumps(meta, indent=2, sort_keys=True, allow_nan=False) + "\n")
        _fsync(meta_file)

    # -- reading ---------------------------------------------------------
    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Report:
        """Read and verify a report directory; any problem is a one-line ``ReportError``.

        A reader that races a replacement (``scan --force`` swapping a new report in)
        may read the old metadata and a new table: the directory it started from is
        then no longer the one at ``path``, and it reads again. It sees the old report
        or the new one, never a false "corrupt".
        """
        root = Path(path)
        for attempt in range(_READ_ATTEMPTS):
            with _Pin(root) as pin:
                try:
                    report = cls._read_once(pin.base)
                except (ReportError, OSError) as error:
                    # a file gone while read (OSError) is a replacement deleting this one
                    if attempt + 1 == _READ_ATTEMPTS or pin.still_at(root):
                        raise pin.renamed(error) from None
                else:
                    report.path = root
                    return report
            # replaced while we read: wait a little longer each time, so that replacements
            # in quick succession still leave a quiet moment to read a whole report in
            time.sleep(min(0.002 * (attempt + 1), 0.05))
        raise AssertionError("unreachable")  # pragma: no cover

    @classmethod
    def _read_once(cls, root: Path) -> Report:
        if not root.exists():
            raise ReportError(f"report {root} does not exist")
        if not root.is_dir():
            raise ReportError(f"report {root} is not a directory")
        meta = _read_meta(root)
        ranks = meta.get("ranks", 1)
        prefixes = [""] if ranks == 1 else [rank_prefix(r) for r in range(ranks)]
        parts = []
        for prefix in prefixes:
            tables: dict[str, pd.DataFrame] = {}
            for name, schema in TABLES.items():
                if meta["schema_version"] == 1 and name in _V1_TABLES:
                    old = _read_table(root, name, _V1_TABLES[name], meta, prefix)
                    tables[name] = _upgrade_v1(name, old)
                else:
                    tables[name] = _read_table(root, name, schema, meta, prefix)
            part = cls(meta, tables["records"], tables["bins"], tables["steps"], path=root)
            for name, schema in OPTIONAL_TABLES.items():
                if f"{prefix}{name}.parquet" in meta["files"]:
                    if name == "blocks" and meta["schema_version"] == 3:
                        table = _read_table(root, name, _V3_BLOCKS_SCHEMA, meta, prefix)
                        counts = list(BLOCK_COUNT_COLUMNS)
                        table[counts] = table[counts].astype(np.float64)  # exact below 2**53
                    else:
                        table = _read_table(root, name, schema, meta, prefix)
                    if name == "blocks":
                        _check_blocks(table, root / f"{prefix}{name}.parquet")
                    setattr(part, name, table)
            _check_consistency(part, root / prefix if prefix else root)
            parts.append(part)
        return parts[0] if len(parts) == 1 else _merge_ranks(parts, meta, root)


_READ_ATTEMPTS = 100  # reads while the directory keeps being replaced (at most ~4 s of waits)


class _Pin:
    """One report directory held open while it is read.

    Every file is opened through the held directory (``/proc/self/fd/N/...``), so a
    read cannot mix the metadata of one report with a table of the report that
    replaced it. Whether a failed read met a replacement is asked of the held
    directory itself: is it still the one at the path, and still linked? Comparing
    inode numbers taken before and after is not enough, because a replacement that
    deletes the old directory frees its inode for the next one.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fd: int | None = None
        self.base = root
        try:
            self.fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            self.start = _identity(root)  # missing or not a directory: said by _read_once
            return
        held = Path(f"/proc/self/fd/{self.fd}")
        if held.is_dir():  # Linux; elsewhere paths go through the name as before
            self.base = held
        self.start = _identity(root)

    def still_at(self, root: Path) -> bool:
        """True when the directory read is still the report at ``root`` (the error is real)."""
        if self.fd is None:
            return _identity(root) == self.start
        held = os.fstat(self.fd)
        return held.st_nlink > 0 and _identity(root) == (held.st_dev, held.st_ino)

    def renamed(self, error: ReportError | OSError) -> ReportError:
        """``error`` as a ``ReportError`` naming the report's path, not the held directory's."""
        if isinstance(error, OSError):
            where = error.filename or self.base
            error = ReportError(f"{where}: cannot read ({error.strerror or error})")
        if self.base == self.root:
            return error
        return ReportError(str(error).replace(str(self.base), str(self.root)))

    def __enter__(self) -> _Pin:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _identity(root: Path) -> tuple[int, int] | None:
    """Which directory ``root`` names now (a replacement swaps in another)."""
    try:
        found = os.stat(root)
    except OSError:
        return None
    return (found.st_dev, found.st_ino)


def check_target(path: str | os.PathLike[str], force: bool) -> Path:
    """``path`` as a report target: new, or an fpaudit report that ``force`` may replace.

    A replacement that a crash cut short between its two renames (only where
    ``renameat2`` is unavailable) left the old report as ``.<name>.old``: it is put
    back first, so the target is never lost.
    """
    target = Path(path)
    if not target.name or target.name in (".", ".."):
        raise ReportError(f"{target} is not a name for a report directory")
    recover(target)
    if target.exists() or target.is_symlink():
        if not force:
            raise ReportExists(target)
        if not target.is_dir() or not (target / META_FILE).is_file():
            raise ReportError(
                f"{target} exists and is not an fpaudit report; refusing to replace it"
            )
    return target


def recover(target: Path) -> bool:
    """Put back a report that an interrupted replacement left at ``.<name>.old``."""
    retired = hidden_sibling(target, ".old")
    if target.exists() or target.is_symlink() or not (retired / META_FILE).is_file():
        return False
    with contextlib.suppress(OSError):
        os.rename(retired, target)
        return True
    return False


def steps_in(target: Path) -> int | None:
    """The completed steps of the report at ``target`` (from its metadata), or None."""
    try:
        meta = json.loads((target / META_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    done = meta.get("steps_run") if isinstance(meta, dict) else None
    return done if isinstance(done, int) and not isinstance(done, bool) else None


def new_staging(target: Path) -> Path:
    """A fresh hidden directory beside ``target`` to write into."""
    make_parent(target, "out")
    staging = Path(
        tempfile.mkdtemp(prefix=staging_prefix(target), suffix=STAGING_SUFFIX, dir=target.parent)
    )
    staging.chmod(0o777 & ~current_umask())  # mkdtemp makes it 0700: mkdir's mode instead
    return staging


def finish(staging: Path, target: Path) -> None:
    """Sync ``staging`` and move it into place (an old report stays until then)."""
    owner = _OWNERS.get(_key(target))
    if owner is not None and owner != os.getpid():
        raise ReportError(
            f"{target}: this process (pid {os.getpid()}) is a fork of the audit's process "
            f"(pid {owner}); only that process writes the report"
        )
    for directory in [staging, *(p for p in staging.iterdir() if p.is_dir())]:
        _fsync(directory)
    _replace_dir(staging, target)


@contextlib.contextmanager
def output_errors(target: Path) -> Iterator[None]:
    """Turn an operating-system error while writing ``target`` into one ``ReportError``."""
    try:
        yield
    except ReportError:
        raise
    except (OSError, pa.ArrowException) as error:
        raise ReportError(f"cannot write {target}: {_reason(error)}") from error


def _reason(error: BaseException) -> str:
    """What went wrong, in the operating system's words (pyarrow wraps them in its own)."""
    if isinstance(error, OSError) and error.strerror:
        name = error.filename if isinstance(error.filename, str) else None
        where = f" ({Path(name).name})" if name else ""
        code = error.errno
        text = os.strerror(code) if code is not None and code in errno.errorcode else None
        return f"{text or error.strerror}{where}"
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else type(error).__name__
    for code in (errno.ENOSPC, errno.EFBIG, errno.EROFS, errno.EDQUOT, errno.EIO):
        if os.strerror(code).lower() in text.lower():
            return os.strerror(code)
    return text


# Which process started the audit of each locked target: a forked child neither
# writes the report nor releases the lock.
_OWNERS: dict[str, int] = {}


def _key(target: Path) -> str:
    return os.path.abspath(target)


class OutputLock:
    """``<target>.lock``, held with ``fcntl.flock`` on an open descriptor for the run.

    The kernel releases a flock when its process dies, however it dies, so a lock
    file left by a killed run never blocks (no pid liveness test: pids are reused,
    in containers above all). The file holds the owner's pid and host, for the
    message a second run prints. Only the process that took the lock releases it:
    a forked child (``os.fork``, a DataLoader worker) shares the descriptor but
    never unlocks.
    """

    def __init__(self, target: str | os.PathLike[str]) -> None:
        self.target = Path(target)
        self.path = _lock_path(self.target)
        self.owner = os.getpid()
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        with output_errors(self.target):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            for _ in range(10):
                fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = _read_text(self.path).split()
                    os.close(fd)
                    pid = (
                        f"pid {holder[0]}" if holder and holder[0].isdigit() else "another process"
                    )
                    raise ReportError(
                        f"another fpaudit run ({pid}) is writing {self.target}; wait for it to "
                        "finish or stop it, or choose another ",
                        Named("out"),
                        f" (lock: {self.path}; it is released when that process exits)",
                    ) from None
                except BaseException:
                    os.close(fd)
                    raise
                # The file may have been unlinked by its last owner between our open and
                # flock: then the lock we hold is on a file nobody else sees. Retry.
                try:
                    same = os.path.samestat(os.fstat(fd), os.stat(self.path))
                except FileNotFoundError:
                    same = False
                if same:
                    break
                os.close(fd)
            else:  # pragma: no cover - lost the race ten times
                raise ReportError(f"could not lock {self.path}")
            os.ftruncate(fd, 0)
            os.write(fd, f"{self.owner} {platform.node()}\n".encode())
        self._fd = fd
        self.owner = os.getpid()
        _OWNERS[_key(self.target)] = self.owner
        return self

    def owned(self) -> bool:
        """True in the process that took the lock (False in a forked child)."""
        return os.getpid() == self.owner

    def __exit__(self, *exc: object) -> None:
        if self._fd is None or not self.owned():
            return  # a forked child: the lock is its parent's
        _OWNERS.pop(_key(self.target), None)
        with contextlib.suppress(OSError):
            self.path.unlink()  # before unlocking: a waiter then finds a fresh file
        os.close(self._fd)  # releases the flock
        self._fd = None


def output_lock(target: str | os.PathLike[str]) -> OutputLock:
    """Hold ``<target>.lock`` while a run writes ``target``: a second run refuses."""
    return OutputLock(target)


def _lock_path(target: Path) -> Path:
    name = f"{target.name}.lock"
    if len(os.fsencode(name)) <= 255:
        return target.with_name(name)
    return hidden_sibling(target, ".lock")


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(staging: Path, target: Path) -> None:
    """Move ``staging`` to ``target``; an old report stays intact until the new one is in place.

    On Linux the two directories are swapped in one ``renameat2(RENAME_EXCHANGE)``:
    ``target`` always names a whole report, the old one or the new. Elsewhere (or on
    a filesystem without it) the old report is renamed to ``.<name>.old`` first;
    should the process die between the two renames, the next write to ``target``
    (``check_target``) puts it back.
    """
    if not target.exists():
        os.rename(staging, target)
    elif _exchange(staging, target):
        shutil.rmtree(staging, ignore_errors=True)  # now the old report
    else:
        retired = hidden_sibling(target, ".old")
        shutil.rmtree(retired, ignore_errors=True)
        os.rename(target, retired)
        os.rename(staging, target)
        shutil.rmtree(retired, ignore_errors=True)
    _fsync(target.parent)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths atomically with Linux's renameat2; False where that is unsupported."""
    if os.environ.get("FPAUDIT_NO_RENAME_EXCHANGE") == "1":  # tests take the other path
        return False
    function = _renameat2()
    if function is None:
        return False
    result = function(
        _AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE
    )
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(second))


def _renameat2() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):  # glibc before 2.28, musl
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                         ctypes.c_uint]  # fmt: skip
    function.restype = ctypes.c_int
    return function


def _read_meta(root: Path) -> dict[str, Any]:
    meta_file = root / META_FILE
    if meta_file.is_symlink():
        raise ReportError(f"{meta_file} is a symbolic link; a report's files must be its own")
    if not meta_file.is_file():
        raise ReportError(f"{root} is not an fpaudit report (no {META_FILE})")
    try:
        with meta_file.open("rb") as handle:
            data = handle.read(MAX_META_BYTES + 1)
    except OSError as error:
        raise ReportError(f"{meta_file}: cannot read ({error.strerror or error})") from None
    if len(data) > MAX_META_BYTES:
        raise ReportError(
            f"{meta_file}: larger than {MAX_META_BYTES >> 20} MiB, more than any report's "
            "metadata; refusing to read it"
        )
    try:
        meta = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ReportError(f"{meta_file}: corrupt metadata (nested too deeply)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ReportError(f"{meta_file}: corrupt metadata ({error})") from None
    if not isinstance(meta, dict):
        raise ReportError(f"{meta_file}: corrupt metadata (not a JSON object)")
    if _depth(meta) > MAX_META_DEPTH:
        raise ReportError(
            f"{meta_file}: corrupt metadata (nested deeper than {MAX_META_DEPTH} levels)"
        )
    version = meta.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ReportError(f"{meta_file}: no valid schema_version")
    if version > SCHEMA_VERSION:
        raise ReportError(
            f"{root}: report schema version {version} is newer than this fpaudit reads "
            f"({SCHEMA_VERSION}); upgrade fpaudit"
        )
    if version not in READABLE_VERSIONS:
        raise ReportError(f"{root}: unknown report schema version {version}")
    if meta.get("histogram") != histogram_layout():
        raise ReportError(f"{meta_file}: histogram layout differs from this fpaudit's")
    files = meta.get("files")
    if not isinstance(files, dict):
        raise ReportError(f"{meta_file}: corrupt metadata (no file list)")
    _check_meta_types(meta, meta_file)
    _check_meta_values(meta, meta_file)
    return meta


def _depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects (iteratively: no recursion to exhaust)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            if level > MAX_META_DEPTH:
                break
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, level + 1) for child in children)
    return deepest


def rank_prefix(rank: int) -> str:
    """Where a rank's tables live in a report of several ranks."""
    return f"rank-{rank:05d}/"


def _merge_ranks(parts: list[Report], meta: dict[str, Any], root: Path) -> Report:
    """One report from the ranks' parts: record ids renumbered, so that every analysis
    merges ranks exactly (counts add, amax is the max over ranks)."""
    offsets = np.cumsum([0] + [len(p.records) for p in parts[:-1]])
    records, bins = [], []
    for part, offset in zip(parts, offsets, strict=True):
        records.append(part.records.assign(record_id=part.records["record_id"] + offset))
        bins.append(part.bins.assign(record_id=part.bins["record_id"] + offset))
    merged = {
        "records": pd.concat(records, ignore_index=True),
        "bins": pd.concat(bins, ignore_index=True),
        "steps": pd.concat([p.steps for p in parts], ignore_index=True),
    }
    for name in ("records", "bins"):
        merged[name]["record_id"] = merged[name]["record_id"].astype(np.int32)
    report = Report(meta, merged["records"], merged["bins"], merged["steps"], path=root)
    for name in OPTIONAL_TABLES:  # part i holds rank i's tables (rank_prefix(i))
        present = [(rank, t) for rank, p in enumerate(parts) if (t := getattr(p, name)) is not None]
        if not present:
            continue
        setattr(report, name, pd.concat([t for _, t in present], ignore_index=True))
        if "rank" not in present[0][1].columns:
            ranks = [np.full(len(t), rank, dtype=np.int64) for rank, t in present]
            report._table_ranks[name] = np.concatenate(ranks)
    return report


def _check_blocks(blocks: pd.DataFrame, file: Path) -> None:
    """The block statistics table as read: counts not negative, histograms full width."""
    counts = blocks[list(BLOCK_COUNT_COLUMNS)].to_numpy()
    if len(counts) and not (np.isfinite(counts).all() and counts.min() >= 0):
        raise ReportError(f"{file}: counts must be finite and not negative")
    for column, width in BLOCK_HISTOGRAM_WIDTHS.items():
        if not all(len(v) == width for v in blocks[column]):
            raise ReportError(f"{file}: {column} must hold {width} counts per row")


def _read_table(
    root: Path, name: str, schema: pa.Schema, meta: dict[str, Any], prefix: str = ""
) -> pd.DataFrame:
    """Read one table, checked against its checksum and schema (bins without derived columns)."""
    file = root / f"{prefix}{name}.parquet"
    entry = meta["files"].get(f"{prefix}{name}.parquet")
    if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
        raise ReportError(f"{root / META_FILE}: no checksum for {file.name}")
    for part in (file.parent, file) if prefix else (file,):
        if part.is_symlink():
            raise ReportError(f"{part} is a symbolic link; a report's files must be its own")
    if not file.is_file():
        raise ReportError(f"{file} is missing")
    if _sha256(file) != entry["sha256"]:
        raise ReportError(f"{file} is corrupt (checksum mismatch)")
    try:
        found = pq.read_schema(file)
        for column in schema:
            if column.name not in found.names:
                raise ReportError(f"{file} lacks column {column.name!r}")
            actual = found.field(column.name).type
            if actual != column.type:
                raise ReportError(
                    f"{file}: column {column.name!r} is {actual}, expected {column.type}"
                )
        wanted = (
            [n for n in schema.names if n not in DERIVED_BIN_COLUMNS]
            if name == "bins"
            else schema.names
        )
        table = pq.read_table(file, columns=wanted)
    except ReportError:
        raise
    except Exception as error:  # pyarrow raises many types on damaged files
        raise ReportError(f"{file} is corrupt ({type(error).__name__}: {error})") from None
    if table.num_rows != entry.get("rows"):
        raise ReportError(f"{file} has {table.num_rows} rows, metadata says {entry.get('rows')}")
    # Schema metadata is the writer's word, not data: pandas would act on a "pandas" entry
    # (index columns, dtypes, extension types), so it is dropped before conversion.
    table = table.replace_schema_metadata(None)
    return table.to_pandas(split_blocks=True, self_destruct=True)  # no second copy


def _check_consistency(report: Report, root: Path) -> None:
    bins, records = report.bins, report.records
    ids = records["record_id"].to_numpy()
    if not np.array_equal(ids, np.arange(len(ids))):
        raise ReportError(f"{root}/records.parquet: record_id must number the rows 0, 1, 2, ...")
    refs = bins["record_id"].to_numpy()
    if len(refs) and (refs.min() < 0 or refs.max() >= len(ids)):
        raise ReportError(f"{root}/bins.parquet: bins refer to unknown records")
    if len(bins):  # min/max reductions: cheap on tens of millions of rows
        binade, cls, count = (bins[c].to_numpy() for c in ("binade", "cls", "count"))
        in_range = (
            binade.min() >= layout.BINADE_MIN
            and binade.max() <= layout.BINADE_MAX
            and cls.min() >= 0
            and cls.max() < layout.N_CLASSES
            and count.min() >= 0
        )
        if not in_range:
            raise ReportError(f"{root}/bins.parquet: bins out of range")
    counts = records[["elements", "zeros", "infs", "nans", "calls"]].to_numpy()
    if len(counts) and counts.min() < 0:
        raise ReportError(f"{root}/records.parquet: negative counts")
    if len(records) and records["steps"].min() < 1:
        raise ReportError(f"{root}/records.parquet: steps must be at least 1")
    amax = records["amax"].to_numpy()
    if len(amax) and not (np.isfinite(amax).all() and amax.min() >= 0):
        raise ReportError(f"{root}/records.parquet: amax must be finite and not negative")
    # Every element of a record is a zero, an inf, a NaN or in one of its bins (exact
    # in float64 below 2**53 elements).
    binned = _sum_by_record(refs, bins["count"].to_numpy(), len(ids))
    special = counts[:, 1] + counts[:, 2] + counts[:, 3]
    if len(ids) and not np.array_equal(binned + special, counts[:, 0]):
        raise ReportError(f"{root}: records and bins disagree on element counts")
    scales = records["loss_scale"].to_numpy()
    # fp32 numbers from 2**-149 up (a GradScaler's scale is an fp32 tensor); powers of two
    # unless a training script chose otherwise (see Report.inexact_scales).
    valid = (scales >= 2.0**-149) & (scales <= float(np.finfo(np.float32).max))
    if len(scales) and not bool(np.all(valid)):
        raise ReportError(
            f"{root}/records.parquet: loss_scale must be a positive number in fp32 range"
        )


def _sum_by_record(refs: np.ndarray, counts: np.ndarray, records: int) -> np.ndarray:
    """The sum of ``counts`` per record id (int64, exact), ``refs`` all in range.

    Written reports keep bins in record order: then one ``reduceat`` over the
    segments, with no array as long as the bins allocated (on tens of millions of
    rows, fresh memory is what costs). Otherwise a weighted ``bincount``.
    """
    sums = np.zeros(records, dtype=np.int64)
    if len(refs) == 0:
        return sums
    if not np.all(refs[1:] >= refs[:-1]):
        return np.bincount(refs, weights=counts, minlength=records).astype(np.int64)
    ids = np.arange(records, dtype=refs.dtype)  # another dtype would copy refs to match
    starts = np.searchsorted(refs, ids, side="left")
    present = starts < np.searchsorted(refs, ids, side="right")
    sums[present] = np.add.reduceat(counts, starts[present])
    return sums


_V1_RECORDS = pa.schema([f for f in RECORDS_SCHEMA if f.name != "rank"])
_V1_STEPS = pa.schema(
    [
        f
        for f in STEPS_SCHEMA
        if f.name not in STEP_DEFAULTS
        or f.name in ("records", "nonfinite_grads", "optimizer_step", "first_nonfinite")
    ]
)


def _upgrade_v1(name: str, table: pd.DataFrame) -> pd.DataFrame:
    """A version 1 table with the columns version 2 added, at their defaults."""
    if name == "records":
        return frame({**table, "rank": np.zeros(len(table), np.int16)}, RECORDS_SCHEMA)
    steps = table
    columns: dict[str, Any] = {name: steps[name] for name in _V1_STEPS.names}
    for name, default in STEP_DEFAULTS.items():
        if name not in columns:
            columns[name] = steps["loss_scale"] if default is None else [default] * len(steps)
    return frame(columns, STEPS_SCHEMA)


_V1_TABLES = {"records": _V1_RECORDS, "steps": _V1_STEPS}


def _check_meta_types(meta: dict[str, Any], meta_file: Path) -> None:
    """The metadata readers use must have the types they expect."""
    expected: dict[str, tuple[type, ...]] = {
        "modules": (list,),
        "formats": (list,),
        "complete": (bool,),
        "stopped_by": (str, type(None)),
        "steps": (int,),
        "steps_run": (int,),
        "steps_requested": (int, type(None)),
        "ranks": (int,),  # fpaudit run without --max-steps: None
        "findings": (list,),
        "training": (dict,),
        "scaler": (dict, type(None)),
        "headroom_bits": (int,),
        "include_loss": (bool,),
        "recipes": (list,),
    }
    for key, types in expected.items():
        if key in meta and not isinstance(meta[key], types):
            raise ReportError(f"{meta_file}: {key} has the wrong type")
        listed = key in ("modules", "formats", "recipes") and key in meta
        if listed and not all(isinstance(item, str) for item in meta[key]):
            raise ReportError(f"{meta_file}: {key} must be a list of strings")


def _check_meta_values(meta: dict[str, Any], meta_file: Path) -> None:
    """Every number a reader uses lies in its range, and the findings, training and
    scaler blocks have the shape their readers expect; each message names the field."""

    def fail(field: str, problem: str) -> ReportError:
        return ReportError(f"{meta_file}: {field} {problem}")

    def whole(field: str, value: Any, low: int, high: int, *, none: bool = False) -> None:
        if value is None and none:
            return
        if not isinstance(value, int) or isinstance(value, bool):
            raise fail(field, f"must be a whole number, got {_shown(value)}")
        if not low <= value <= high:
            raise fail(field, f"{_shown(value)} out of range {low}..{high}")

    def number(field: str, value: Any, low: float, high: float) -> None:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise fail(field, f"must be a number, got {_shown(value)}")
        # an int compares with the float bounds exactly; math.isfinite(10**400) overflows
        finite = not isinstance(value, float) or math.isfinite(value)
        if not (finite and low <= value <= high):
            raise fail(field, f"{_shown(value)} out of range {low:g}..{high:g}")

    def text(field: str, value: Any) -> None:
        if not isinstance(value, str):
            raise fail(field, f"must be a string, got {_shown(value)}")

    bounds = {
        "headroom_bits": (0, limits.MAX_HEADROOM_BITS),
        "steps": (0, _INT32_MAX),
        "steps_run": (0, _INT32_MAX),
        "every": (1, _INT32_MAX),
        "ranks": (1, _MAX_RANKS),
        "world_size": (1, _MAX_RANKS),
        "out_of_range": (0, 2**62),
    }
    for key, (low, high) in bounds.items():
        if key in meta:
            whole(key, meta[key], low, high)
    if "steps_requested" in meta:
        whole("steps_requested", meta["steps_requested"], 0, _INT32_MAX, none=True)
    if meta.get("loss_scale") is not None:
        number("loss_scale", meta["loss_scale"], 2.0**-149, _FP32_MAX)
    for key in ("amp", "amp_dtype", "command"):
        if meta.get(key) is not None:
            text(key, meta[key])
    selection = meta.get("selection")
    globs = selection.values() if isinstance(selection, dict) else [None]
    if selection is not None and not all(
        isinstance(v, list) and all(isinstance(p, str) for p in v) for v in globs
    ):
        raise fail("selection", "must map option names to lists of glob strings")
    for index, item in enumerate(meta.get("findings") or []):
        where = f"findings[{index}]"
        if not isinstance(item, dict):
            raise fail(where, f"must be an object, got {_shown(item)}")
        for key in ("code", "file", "message", "severity"):
            text(f"{where}.{key}", item.get(key))
        whole(f"{where}.line", item.get("line"), 0, _INT32_MAX)
        whole(f"{where}.count", item.get("count"), 0, _INT32_MAX)
        steps = item.get("steps")
        if not isinstance(steps, list):
            raise fail(f"{where}.steps", f"must be a list of steps, got {_shown(steps)}")
        for step in steps:
            whole(f"{where}.steps", step, 0, _INT32_MAX)
    training = meta.get("training")
    if training is not None:
        for key in (
            "steps",
            "skipped",
            "calibration_steps",
            "steps_after_calibration",
            "skipped_after_calibration",
        ):
            whole(f"training.{key}", training.get(key), 0, _INT32_MAX)
        number(
            "training.skip_rate_after_calibration",
            training.get("skip_rate_after_calibration"),
            0.0,
            1.0,
        )
    scaler = meta.get("scaler")
    if scaler is not None:
        text("scaler.class", scaler.get("class"))
        number("scaler.init_scale", scaler.get("init_scale"), 2.0**-149, _FP32_MAX)
        number("scaler.growth_factor", scaler.get("growth_factor"), 0.0, _FP32_MAX)
        number("scaler.backoff_factor", scaler.get("backoff_factor"), 0.0, _FP32_MAX)
        whole("scaler.growth_interval", scaler.get("growth_interval"), 0, _INT32_MAX)


def _shown(value: Any) -> str:
    """A value for an error message: short, whatever it is."""
    text = json.dumps(value) if not isinstance(value, float) else f"{value:g}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**6:
        # past float's range (10**400) float() overflows; Decimal keeps every int
        text = f"{float(value):g}" if abs(value) < 2**1023 else f"{Decimal(value).normalize():.6g}"
    return text if len(text) <= 40 else text[:37] + "..."


def frame(columns: dict[str, Any], schema: pa.Schema, names: Sequence[str] = ()) -> pd.DataFrame:
    """A DataFrame of ``columns`` through Arrow, so its dtypes are exactly what a read gives."""
    fields = [schema.field(n) for n in names] if names else list(schema)
    arrays = [pa.array(columns[f.name], type=f.type) for f in fields]
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields)).to_pandas()
