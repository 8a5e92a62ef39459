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
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from fpaudit import layout
from fpaudit.errors import ReportError

if TYPE_CHECKING:
    from fpaudit.histogram import HostHistogram

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
# In memory, bins keep what analysis needs; lower and upper are derived from
# (binade, cls) when a report is written, for users of the plain Parquet files.
BIN_COLUMNS = ("record_id", "binade", "cls", "count")
DERIVED_BIN_COLUMNS = ("lower", "upper")


class RecordKey(NamedTuple):
    kind: str
    module: str
    node: str
    op: str
    output: int
    dtype: str
    scales_with_loss: bool


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
    # Condensed histograms computed by fpaudit.analysis; valid while the tables are unchanged.
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

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
                if name == "bins":
                    lower, upper = layout.value_bounds(frame["binade"], frame["cls"])
                    frame = frame.assign(lower=lower, upper=upper)
                table = pa.Table.from_pandas(
                    frame[schema.names], schema=schema, preserve_index=False
                )
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
    """Read one table, checked against its checksum and schema (bins without derived columns)."""
    file = root / f"{name}.parquet"
    entry = meta["files"].get(file.name)
    if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
        raise ReportError(f"{root / META_FILE}: no checksum for {file.name}")
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
    counts = records[["elements", "zeros", "infs", "nans"]]
    if bool((counts < 0).to_numpy().any()):
        raise ReportError(f"{root}/records.parquet: negative counts")
    scales = records["loss_scale"].to_numpy()
    mantissa, exponent = np.frexp(scales)
    valid = (scales > 0) & (mantissa == 0.5) & (exponent - 1 >= -149) & (exponent - 1 <= 127)
    if len(scales) and not bool(np.all(valid)):
        raise ReportError(
            f"{root}/records.parquet: loss_scale must be a power of two in fp32 range"
        )


@dataclass
class StepRecords:
    """The records of one closed step: keys and, row for row, their histograms."""

    keys: list[RecordKey]
    counts: np.ndarray  # int64 [records, layout.N_BINS]
    amax: np.ndarray  # float64 [records], finite amax as recorded
    calls: np.ndarray  # int64 [records], tensors added

    @classmethod
    def from_histograms(cls, records: dict[RecordKey, HostHistogram]) -> StepRecords:
        hosts = list(records.values())
        return cls(
            keys=list(records),
            counts=np.array([h.counts for h in hosts], dtype=np.int64).reshape(-1, layout.N_BINS),
            amax=np.array([h.amax for h in hosts], dtype=np.float64),
            calls=np.array([h.calls for h in hosts], dtype=np.int64),
        )

    def nonfinite(self, kind: str) -> int:
        """inf and NaN elements in the records of ``kind``."""
        mask = np.array([key.kind == kind for key in self.keys], dtype=bool)
        special = self.counts[:, layout.INF_BIN] + self.counts[:, layout.NAN_BIN]
        return int(special[mask].sum()) if len(mask) else 0


class ReportBuilder:
    """Collects closed steps and turns them into a :class:`Report`."""

    def __init__(self, modules: list[str]) -> None:
        self.modules = modules
        self._records: dict[str, list[np.ndarray]] = {name: [] for name in RECORDS_SCHEMA.names}
        self._bins: dict[str, list[np.ndarray]] = {"record_id": [], "offset": [], "count": []}
        self._steps: dict[str, list[Any]] = {name: [] for name in STEPS_SCHEMA.names}
        self._next_record = 0
        self.steps = 0  # steps closed
        self.last_index = -1  # training-step number of the last closed step

    def add_step(
        self,
        records: StepRecords,
        *,
        loss: float | None,
        loss_scale: float,
        seconds: float,
        index: int | None = None,
    ) -> None:
        """Add one closed step (vectorised over its records). A non-finite loss drops
        the step's records: it is a forward problem, never backward overflow.
        ``index`` numbers the step (default: one after the last); it must increase."""
        step = self.last_index + 1 if index is None else index
        if step <= self.last_index:
            raise ValueError(f"step index {step} does not follow {self.last_index}")
        self.last_index = step
        self.steps += 1
        loss_finite = loss is None or math.isfinite(loss)
        kept = len(records.keys) if loss_finite else 0
        if kept:
            counts = records.counts
            ids = np.arange(self._next_record, self._next_record + kept, dtype=np.int32)
            self._next_record += kept
            columns: dict[str, Any] = {
                "record_id": ids,
                "step": np.full(kept, step, dtype=np.int32),
                "calls": records.calls,
                "elements": counts.sum(axis=1),
                "zeros": counts[:, layout.ZERO_BIN],
                "infs": counts[:, layout.INF_BIN],
                "nans": counts[:, layout.NAN_BIN],
                "amax": records.amax,
                "loss_scale": np.full(kept, loss_scale, dtype=np.float64),
            }
            for field_name in RecordKey._fields:
                columns[field_name] = np.array([getattr(k, field_name) for k in records.keys])
            for name in RECORDS_SCHEMA.names:
                self._records[name].append(np.asarray(columns[name]))
            finite = counts[:, layout.FIRST_FINITE_BIN : layout.INF_BIN]
            rows, offsets = np.nonzero(finite)
            self._bins["record_id"].append(ids[rows])
            self._bins["offset"].append(offsets)
            self._bins["count"].append(finite[rows, offsets])
        step_row = {
            "step": step,
            "loss": math.nan if loss is None else loss,
            "loss_finite": loss_finite,
            "loss_scale": loss_scale,
            "records": kept,
            "nonfinite_grads": records.nonfinite(KIND_GRAD),
            "optimizer_step": False,
            "seconds": seconds,
        }
        for name, value in step_row.items():
            self._steps[name].append(value)

    def mark_optimizer_step(self, stepped: bool) -> None:
        if self._steps["optimizer_step"]:
            self._steps["optimizer_step"][-1] = stepped

    def build(self, meta: dict[str, Any]) -> Report:
        offsets_to_bins = np.arange(layout.FIRST_FINITE_BIN, layout.INF_BIN)
        binade, cls = layout.bin_binade_and_class(offsets_to_bins)

        def joined(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
            return np.concatenate(parts) if parts else np.zeros(0, dtype)

        offsets = joined(self._bins["offset"], np.int64)
        bins = {
            "record_id": joined(self._bins["record_id"], np.int32),
            "binade": binade[offsets].astype(np.int16),
            "cls": cls[offsets].astype(np.int8),
            "count": joined(self._bins["count"], np.int64),
        }
        records = {
            field.name: joined(self._records[field.name], field.type.to_pandas_dtype())
            for field in RECORDS_SCHEMA
        }
        # Through Arrow, so in-memory frames have exactly the dtypes a read gives.
        meta = {**meta, "steps": self.steps, "modules": list(self.modules)}
        return Report(
            meta,
            _frame(records, RECORDS_SCHEMA),
            _frame(bins, pa.schema([BINS_SCHEMA.field(n) for n in BIN_COLUMNS])),
            _frame(self._steps, STEPS_SCHEMA),
        )


def _frame(columns: dict[str, Any], schema: pa.Schema) -> pd.DataFrame:
    arrays = [pa.array(columns[field.name], type=field.type) for field in schema]
    return pa.Table.from_arrays(arrays, schema=schema).to_pandas()
