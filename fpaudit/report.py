"""The report: a directory of Parquet tables plus ``meta.json``. Nothing else writes files.

Schema version 1 (documented in the README, "Report format"):

``records.parquet``
    One row per (step, kind, module, node, op, output, dtype): the statistics
    of every tensor recorded under that key in that step.
``bins.parquet``
    The nonzero finite histogram bins of each record: ``binade`` is
    ``floor(log2|x|)``, ``cls`` the mantissa class (see ``histogram``),
    ``lower``/``upper`` the smallest and largest magnitude the bin can hold
    (both inclusive), ``count`` the number of values.
``steps.parquet``
    One row per step: loss, loss scale in force, wall time.
``meta.json``
    Versions, device, command, config, module order, and per file its row
    count and SHA-256, checked on every read.

A report is written to a temporary directory beside the target, fsynced and
renamed into place, so a crash never leaves a half-written report. Reading
never unpickles or executes anything: JSON and Parquet only.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import platform
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from fpaudit import histogram
from fpaudit.errors import ReportError

SCHEMA_VERSION = 1
META_FILE = "meta.json"

KIND_BACKWARD = "backward"  # an output of an op that ran in backward
KIND_GRAD = "grad"  # a parameter's final .grad, as a GradScaler sees it
LOSS_MODULE = "<loss>"
"""Pseudo-module for backward ops of nodes created outside every module of the model."""

RECORDS_SCHEMA = pa.schema(
    [
        ("record_id", pa.int32()),
        ("step", pa.int32()),
        ("kind", pa.string()),
        ("module", pa.string()),
        ("node", pa.string()),
        ("op", pa.string()),
        ("output", pa.int16()),
        ("dtype", pa.string()),
        ("scales_with_loss", pa.bool_()),
        ("calls", pa.int64()),
        ("elements", pa.int64()),
        ("zeros", pa.int64()),
        ("infs", pa.int64()),
        ("nans", pa.int64()),
        ("amax", pa.float64()),
        ("loss_scale", pa.float64()),
    ]
)
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
STEPS_SCHEMA = pa.schema(
    [
        ("step", pa.int32()),
        ("loss", pa.float64()),
        ("loss_finite", pa.bool_()),
        ("loss_scale", pa.float64()),
        ("records", pa.int32()),
        ("nonfinite_grads", pa.int64()),
        ("optimizer_step", pa.bool_()),
        ("seconds", pa.float64()),
    ]
)
TABLES = {"records": RECORDS_SCHEMA, "bins": BINS_SCHEMA, "steps": STEPS_SCHEMA}


class RecordKey(NamedTuple):
    kind: str
    module: str
    node: str
    op: str
    output: int
    dtype: str
    scales_with_loss: bool


def _bin_edges() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """binade, class, lower, upper of every finite bin, in bin order."""
    bins = np.arange(histogram.FIRST_FINITE_BIN, histogram.INF_BIN)
    binade, cls = histogram.bin_binade_and_class(bins)
    bounds = [histogram.bin_value_bounds(int(b), int(c)) for b, c in zip(binade, cls, strict=True)]
    lower = np.array([lo for lo, _ in bounds])
    upper = np.array([hi for _, hi in bounds])
    return binade.astype(np.int16), cls.astype(np.int8), lower, upper


_EDGES: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None


def bin_edges() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    global _EDGES
    if _EDGES is None:
        _EDGES = _bin_edges()
    return _EDGES


def histogram_layout() -> dict[str, Any]:
    """The histogram layout, stored in metadata so a report describes itself."""
    return {
        "binade_min": histogram.BINADE_MIN,
        "binade_max": histogram.BINADE_MAX,
        "fraction_bits": histogram.FRACTION_BITS,
        "class_lower_bounds": list(histogram.CLASS_LOWER_BOUNDS),
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

    # -- writing ---------------------------------------------------------
    def write(self, path: str | os.PathLike[str], *, force: bool = False) -> Path:
        """Write the report directory atomically; refuse to replace one unless ``force``."""
        target = Path(path)
        if target.exists() or target.is_symlink():
            if not force:
                raise ReportError(f"{target} already exists; pass --force to overwrite it")
            if not target.is_dir() or not (target / META_FILE).is_file():
                raise ReportError(
                    f"{target} exists and is not an fpaudit report; refusing to replace it"
                )
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(
            tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        )
        try:
            meta = dict(self.meta)
            meta["schema_version"] = SCHEMA_VERSION
            meta["histogram"] = histogram_layout()
            meta["files"] = {}
            for name, schema in TABLES.items():
                frame: pd.DataFrame = getattr(self, name)
                table = pa.Table.from_pandas(frame, schema=schema, preserve_index=False)
                table = table.replace_schema_metadata(
                    {"fpaudit.schema_version": str(SCHEMA_VERSION)}
                )
                file = staging / f"{name}.parquet"
                pq.write_table(table, file, compression="zstd")
                meta["files"][file.name] = {"rows": table.num_rows, "sha256": _sha256(file)}
                _fsync(file)
            meta_file = staging / META_FILE
            meta_file.write_text(json.dumps(meta, indent=2, sort_keys=True, allow_nan=False) + "\n")
            _fsync(meta_file)
            _fsync(staging)
            _replace_dir(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self.path = target
        return target

    # -- reading ---------------------------------------------------------
    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Report:
        """Read and verify a report directory; any problem is a one-line ``ReportError``."""
        root = Path(path)
        if not root.exists():
            raise ReportError(f"report {root} does not exist")
        if not root.is_dir():
            raise ReportError(f"report {root} is not a directory")
        meta = _read_meta(root)
        tables: dict[str, pd.DataFrame] = {}
        for name, schema in TABLES.items():
            tables[name] = _read_table(root, name, schema, meta)
        report = cls(meta, tables["records"], tables["bins"], tables["steps"], path=root)
        _check_consistency(report, root)
        return report


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
    """Move ``staging`` to ``target``; an old report stays intact until the new one is in place."""
    if not target.exists():
        os.rename(staging, target)
    else:
        retired = Path(
            tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent)
        )
        os.rename(target, retired / target.name)
        os.rename(staging, target)
        shutil.rmtree(retired, ignore_errors=True)
    _fsync(target.parent)


def _read_meta(root: Path) -> dict[str, Any]:
    meta_file = root / META_FILE
    if not meta_file.is_file():
        raise ReportError(f"{root} is not an fpaudit report (no {META_FILE})")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ReportError(f"{meta_file}: corrupt metadata ({error})") from None
    if not isinstance(meta, dict):
        raise ReportError(f"{meta_file}: corrupt metadata (not a JSON object)")
    version = meta.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ReportError(f"{meta_file}: no valid schema_version")
    if version > SCHEMA_VERSION:
        raise ReportError(
            f"{root}: report schema version {version} is newer than this fpaudit reads "
            f"({SCHEMA_VERSION}); upgrade fpaudit"
        )
    if version != SCHEMA_VERSION:
        raise ReportError(f"{root}: unknown report schema version {version}")
    if meta.get("histogram") != histogram_layout():
        raise ReportError(f"{meta_file}: histogram layout differs from this fpaudit's")
    files = meta.get("files")
    if not isinstance(files, dict):
        raise ReportError(f"{meta_file}: corrupt metadata (no file list)")
    return meta


def _read_table(root: Path, name: str, schema: pa.Schema, meta: dict[str, Any]) -> pd.DataFrame:
    file = root / f"{name}.parquet"
    entry = meta["files"].get(file.name)
    if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
        raise ReportError(f"{root / META_FILE}: no checksum for {file.name}")
    if not file.is_file():
        raise ReportError(f"{file} is missing")
    if _sha256(file) != entry["sha256"]:
        raise ReportError(f"{file} is corrupt (checksum mismatch)")
    try:
        table = pq.read_table(file)
    except Exception as error:  # pyarrow raises many types on damaged files
        raise ReportError(f"{file} is corrupt ({type(error).__name__}: {error})") from None
    if table.num_rows != entry.get("rows"):
        raise ReportError(f"{file} has {table.num_rows} rows, metadata says {entry.get('rows')}")
    for column in schema:
        if column.name not in table.column_names:
            raise ReportError(f"{file} lacks column {column.name!r}")
        actual = table.schema.field(column.name).type
        if actual != column.type:
            raise ReportError(f"{file}: column {column.name!r} is {actual}, expected {column.type}")
    return table.select(schema.names).to_pandas()


def _check_consistency(report: Report, root: Path) -> None:
    bins, records = report.bins, report.records
    if not records["record_id"].is_unique:
        raise ReportError(f"{root}/records.parquet: duplicate record_id")
    known = bins["record_id"].isin(records["record_id"])
    if not bool(known.all()):
        raise ReportError(f"{root}/bins.parquet: bins refer to unknown records")
    if len(bins):
        in_range = bins["binade"].between(histogram.BINADE_MIN, histogram.BINADE_MAX) & bins[
            "cls"
        ].between(0, histogram.N_CLASSES - 1)
        if not bool(in_range.all()) or bool((bins["count"] < 0).any()):
            raise ReportError(f"{root}/bins.parquet: bins out of range")
    counts = records[["elements", "zeros", "infs", "nans"]]
    if bool((counts < 0).to_numpy().any()):
        raise ReportError(f"{root}/records.parquet: negative counts")
    scales = records["loss_scale"].to_numpy()
    if len(scales) and not bool(np.all((scales > 0) & np.isfinite(scales))):
        raise ReportError(f"{root}/records.parquet: loss_scale must be positive and finite")


class ReportBuilder:
    """Collects closed steps and turns them into a :class:`Report`."""

    def __init__(self, modules: list[str]) -> None:
        self.modules = modules
        self._records: dict[str, list[Any]] = {name: [] for name in RECORDS_SCHEMA.names}
        self._bins: list[tuple[np.ndarray, np.ndarray]] = []  # (record_id repeated, bin index)
        self._bin_counts: list[np.ndarray] = []
        self._steps: dict[str, list[Any]] = {name: [] for name in STEPS_SCHEMA.names}
        self.steps = 0

    def add_step(
        self,
        records: dict[RecordKey, histogram.HostHistogram],
        *,
        loss: float | None,
        loss_scale: float,
        seconds: float,
    ) -> None:
        """Add one closed step. A non-finite loss drops its records (a forward problem)."""
        step = self.steps
        self.steps += 1
        loss_finite = loss is None or math.isfinite(loss)
        kept = records if loss_finite else {}
        for key, host in kept.items():
            record_id = len(self._records["record_id"])
            counts = host.counts
            row = {
                "record_id": record_id,
                "step": step,
                "calls": host.calls,
                "elements": int(counts.sum()),
                "zeros": int(counts[histogram.ZERO_BIN]),
                "infs": int(counts[histogram.INF_BIN]),
                "nans": int(counts[histogram.NAN_BIN]),
                "amax": host.amax,
                "loss_scale": loss_scale,
                **key._asdict(),
            }
            for name, value in row.items():
                self._records[name].append(value)
            finite = counts[histogram.FIRST_FINITE_BIN : histogram.INF_BIN]
            nonzero = np.flatnonzero(finite)
            self._bins.append((np.full(len(nonzero), record_id, dtype=np.int32), nonzero))
            self._bin_counts.append(finite[nonzero])
        step_row = {
            "step": step,
            "loss": math.nan if loss is None else loss,
            "loss_finite": loss_finite,
            "loss_scale": loss_scale,
            "records": len(kept),
            "nonfinite_grads": sum(
                h.infs + h.nans for k, h in records.items() if k.kind == KIND_GRAD
            ),
            "optimizer_step": False,
            "seconds": seconds,
        }
        for name, value in step_row.items():
            self._steps[name].append(value)

    def mark_optimizer_step(self, stepped: bool) -> None:
        if self._steps["optimizer_step"]:
            self._steps["optimizer_step"][-1] = stepped

    def build(self, meta: dict[str, Any]) -> Report:
        binade, cls, lower, upper = bin_edges()
        if self._bins:
            record_ids = np.concatenate([r for r, _ in self._bins])
            offsets = np.concatenate([b for _, b in self._bins])
            counts = np.concatenate(self._bin_counts)
        else:
            record_ids = np.zeros(0, np.int32)
            offsets = np.zeros(0, np.int64)
            counts = np.zeros(0, np.int64)
        bins = {
            "record_id": record_ids,
            "binade": binade[offsets],
            "cls": cls[offsets],
            "lower": lower[offsets],
            "upper": upper[offsets],
            "count": counts.astype(np.int64),
        }
        # Through Arrow, so in-memory frames have exactly the dtypes a read gives.
        meta = {**meta, "steps": self.steps, "modules": list(self.modules)}
        return Report(
            meta,
            _frame(self._records, RECORDS_SCHEMA),
            _frame(bins, BINS_SCHEMA),
            _frame(self._steps, STEPS_SCHEMA),
        )


def _frame(columns: dict[str, Any], schema: pa.Schema) -> pd.DataFrame:
    return pa.Table.from_pydict(columns, schema=schema).to_pandas()
