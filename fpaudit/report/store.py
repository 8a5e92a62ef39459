"""The report: a directory of Parquet tables plus ``meta.json``, written only here
(other outputs, JUnit files and images, go through ``fpaudit.report.outputs.write_atomically``).

Schema version 6 (documented in docs/report-format.md; version 1 reports,
whose steps table lacks the training-loop columns, versions 2 to 4, whose steps
table lacks clipping by value, version 2 reports, which
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
``skips.parquet`` (only ``fpaudit run`` with a loss scaler; version 6)
    One row per skipped step: the parameters whose gradients held inf/NaN, whether
    the loss was finite, and the op that first made inf/NaN where a capture saw it.
``meta.json``
    Versions, device, command, config, module order, and per file its row
    count and SHA-256, checked on every read.

A report is written to a temporary directory beside the target, fsynced and
renamed into place, so a crash never leaves a half-written report. Reading
never unpickles or executes anything: JSON and Parquet only. The schema lives in
``schema.py``, the directory mechanics (staging, the swap, pins, locks) in ``files.py``,
the checks of what is read in ``checks.py``; ``Report`` here ties them together.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import shutil
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from fpaudit import _signals
from fpaudit.errors import ReportError
from fpaudit.numerics import layout
from fpaudit.report.checks import (
    check_blocks,
    check_consistency,
    read_meta,
    read_table,
    upgrade_steps,
    upgrade_v1,
)
from fpaudit.report.files import (
    Pin,
    check_target,
    finish,
    fsync,
    new_staging,
    output_errors,
    sha256,
)
from fpaudit.report.outputs import loop_words, symlink_loop
from fpaudit.report.records import (
    BIN_COLUMNS,
    BLOCK_COUNT_COLUMNS,
    ReportBuilder,
)
from fpaudit.report.runinfo import RunInfo
from fpaudit.report.schema import (
    BINS_SCHEMA,
    META_FILE,
    OPTIONAL_TABLES,
    RECORDS_SCHEMA,
    SCHEMA_VERSION,
    STEPS_SCHEMA,
    TABLES,
    V1_TABLES,
    V4_STEPS,
    blocks_schema,
    frame,
    histogram_layout,
)

__all__ = [
    "BINS_SCHEMA",
    "RECORDS_SCHEMA",
    "SCHEMA_VERSION",
    "STEPS_SCHEMA",
    "Report",
    "run_metadata",
]


_V3_BLOCKS_SCHEMA = blocks_schema(pa.int64())
T = TypeVar("T")


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
    """An in-memory report: metadata, the three tables every report has (``records``,
    ``bins``, ``steps``) and the optional ones (``origins``, ``blocks``): pandas
    DataFrames."""

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
    skips: pd.DataFrame | None = field(default=None, compare=False)
    """``fpaudit run``'s skipped steps and their origins (version 6), or None."""
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
        """Write the three tables every report has, and the optional ones present,
        under ``directory / prefix``; their checksummed entries."""
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
            files[relative] = {"rows": table.num_rows, "sha256": sha256(file)}
            fsync(file)
        return files

    def write_meta(self, directory: Path, files: dict[str, dict[str, Any]], **extra: Any) -> None:
        meta = {**self.meta, **extra}
        meta["schema_version"] = SCHEMA_VERSION
        meta["histogram"] = histogram_layout()
        meta["files"] = files
        meta_file = directory / META_FILE
        meta_file.write_text(json.dumps(meta, indent=2, sort_keys=True, allow_nan=False) + "\n")
        fsync(meta_file)

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
            with Pin(root) as pin:
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
            loop = symlink_loop(Path(os.path.abspath(root)))
            if loop is not None:
                raise ReportError(f"report {root}: {loop_words(loop)}")
            raise ReportError(f"report {root} does not exist")
        if not root.is_dir():
            raise ReportError(f"report {root} is not a directory")
        meta = read_meta(root)
        ranks = meta.get("ranks", 1)
        prefixes = [""] if ranks == 1 else [rank_prefix(r) for r in range(ranks)]
        parts = []
        for prefix in prefixes:
            tables: dict[str, pd.DataFrame] = {}
            for name, schema in TABLES.items():
                if meta["schema_version"] == 1 and name in V1_TABLES:
                    old = read_table(root, name, V1_TABLES[name], meta, prefix)
                    tables[name] = upgrade_v1(name, old)
                elif meta["schema_version"] < 5 and name == "steps":
                    tables[name] = upgrade_steps(read_table(root, name, V4_STEPS, meta, prefix))
                else:
                    tables[name] = read_table(root, name, schema, meta, prefix)
            part = cls(meta, tables["records"], tables["bins"], tables["steps"], path=root)
            for name, schema in OPTIONAL_TABLES.items():
                if f"{prefix}{name}.parquet" in meta["files"]:
                    if name == "blocks" and meta["schema_version"] == 3:
                        table = read_table(root, name, _V3_BLOCKS_SCHEMA, meta, prefix)
                        counts = list(BLOCK_COUNT_COLUMNS)
                        table[counts] = table[counts].astype(np.float64)  # exact below 2**53
                    else:
                        table = read_table(root, name, schema, meta, prefix)
                    if name == "blocks":
                        check_blocks(table, root / f"{prefix}{name}.parquet")
                    setattr(part, name, table)
            check_consistency(part, root / prefix if prefix else root)
            parts.append(part)
        return parts[0] if len(parts) == 1 else _merge_ranks(parts, meta, root)


_READ_ATTEMPTS = 100  # reads while the directory keeps being replaced (at most ~4 s of waits)


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
