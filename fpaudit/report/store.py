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
the checks of what is read in ``checks.py``, the data itself (what the rules take) in
``data.py``'s ``ReportData`` and each table's columns in ``tables.py``; ``Report`` here
ties them together: a ``ReportData`` that reads and writes itself, with meta.json as the
JSON form of its ``RunInfo``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

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
from fpaudit.report.data import ReportData
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
    BLOCK_COUNT_COLUMNS,
)
from fpaudit.report.runinfo import Environment, RunInfo
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


def run_metadata(model: Any = None) -> Environment:
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
    return Environment(
        fpaudit_version=__version__,
        torch_version=torch.__version__,
        python_version=platform.python_version(),
        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        device=device,
        device_name=device_name,
    )


class FileEntry(TypedDict):
    """meta.json's entry of one table file: its row count and SHA-256, checked on read."""

    rows: int
    sha256: str


@dataclass
class Report(ReportData):
    """A report as read from and written to its directory (the I/O of :class:`ReportData`,
    which is what the rules take)."""

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

    def write_tables(self, directory: Path, prefix: str = "") -> dict[str, FileEntry]:
        """Write the three tables every report has, and the optional ones present,
        under ``directory / prefix``; their checksummed entries."""
        (directory / prefix).mkdir(parents=True, exist_ok=True)
        files: dict[str, FileEntry] = {}
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

    def write_meta(
        self, directory: Path, files: dict[str, FileEntry], info: RunInfo | None = None
    ) -> None:
        """meta.json: ``info`` (default: this report's) as JSON, and the file's entries."""
        meta = (info or self.info).to_meta()
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
        info = RunInfo.from_meta(meta)
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
            part = cls(info, tables["records"], tables["bins"], tables["steps"], path=root)
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
        return parts[0] if len(parts) == 1 else _merge_ranks(parts, info, root)


_READ_ATTEMPTS = 100  # reads while the directory keeps being replaced (at most ~4 s of waits)


def rank_prefix(rank: int) -> str:
    """Where a rank's tables live in a report of several ranks."""
    return f"rank-{rank:05d}/"


def _merge_ranks(parts: list[Report], info: RunInfo, root: Path) -> Report:
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
    report = Report(info, merged["records"], merged["bins"], merged["steps"], path=root)
    for name in OPTIONAL_TABLES:  # part i holds rank i's tables (rank_prefix(i))
        present = [(rank, t) for rank, p in enumerate(parts) if (t := getattr(p, name)) is not None]
        if not present:
            continue
        setattr(report, name, pd.concat([t for _, t in present], ignore_index=True))
        if "rank" not in present[0][1].columns:
            ranks = [np.full(len(t), rank, dtype=np.int64) for rank, t in present]
            report._table_ranks[name] = np.concatenate(ranks)
    return report
