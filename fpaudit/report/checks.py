"""Reading a report's files and checking them: meta.json's size, depth, types and ranges,
every table's schema, row count and SHA-256, the tables' consistency, and upgrades
of older schema versions. Reading never unpickles or executes anything.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from fpaudit.errors import ReportError
from fpaudit.numerics import layout, limits
from fpaudit.report.files import sha256
from fpaudit.report.records import (
    BLOCK_COUNT_COLUMNS,
    BLOCK_HISTOGRAM_WIDTHS,
    STEP_DEFAULTS,
)
from fpaudit.report.schema import (
    DERIVED_BIN_COLUMNS,
    MAX_META_BYTES,
    MAX_META_DEPTH,
    MAX_RANKS,
    META_FILE,
    READABLE_VERSIONS,
    RECORDS_SCHEMA,
    SCHEMA_VERSION,
    STEPS_SCHEMA,
    frame,
    histogram_layout,
)

if TYPE_CHECKING:
    from fpaudit.report.data import ReportData

_INT32_MAX = 2**31 - 1  # steps are int32 in the tables
_FP32_MAX = float(np.finfo(np.float32).max)


def read_meta(root: Path) -> dict[str, Any]:
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


def check_blocks(blocks: pd.DataFrame, file: Path) -> None:
    """The block statistics table as read: counts not negative, histograms full width."""
    counts = blocks[list(BLOCK_COUNT_COLUMNS)].to_numpy()
    if len(counts) and not (np.isfinite(counts).all() and counts.min() >= 0):
        raise ReportError(f"{file}: counts must be finite and not negative")
    for column, width in BLOCK_HISTOGRAM_WIDTHS.items():
        if not all(len(v) == width for v in blocks[column]):
            raise ReportError(f"{file}: {column} must hold {width} counts per row")


def read_table(
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
    if sha256(file) != entry["sha256"]:
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


def check_consistency(report: ReportData, root: Path) -> None:
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
    binned = sum_by_record(refs, bins["count"].to_numpy(), len(ids))
    special = counts[:, 1] + counts[:, 2] + counts[:, 3]
    if len(ids) and not np.array_equal(binned + special, counts[:, 0]):
        raise ReportError(f"{root}: records and bins disagree on element counts")
    scales = records["loss_scale"].to_numpy()
    # fp32 numbers from 2**-149 up (a GradScaler's scale is an fp32 tensor); powers of two
    # unless a training script chose otherwise (see ReportData.inexact_scales).
    valid = (scales >= 2.0**-149) & (scales <= float(np.finfo(np.float32).max))
    if len(scales) and not bool(np.all(valid)):
        raise ReportError(
            f"{root}/records.parquet: loss_scale must be a positive number in fp32 range"
        )


def sum_by_record(refs: np.ndarray, counts: np.ndarray, records: int) -> np.ndarray:
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


def upgrade_v1(name: str, table: pd.DataFrame) -> pd.DataFrame:
    """A version 1 table with the columns version 2 added, at their defaults."""
    if name == "records":
        return frame({**table, "rank": np.zeros(len(table), np.int16)}, RECORDS_SCHEMA)
    return upgrade_steps(table)


def upgrade_steps(steps: pd.DataFrame) -> pd.DataFrame:
    """An older version's steps table with the columns later versions added, at their
    defaults (``STEP_DEFAULTS``)."""
    columns: dict[str, Any] = {name: steps[name] for name in steps.columns}
    for name, default in STEP_DEFAULTS.items():
        if name not in columns:
            columns[name] = steps["loss_scale"] if default is None else [default] * len(steps)
    return frame(columns, STEPS_SCHEMA)


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


@dataclass(frozen=True)
class _Fields:
    """Range and type checks of meta.json's fields; each error names the file and field."""

    meta_file: Path

    def fail(self, field: str, problem: str) -> ReportError:
        return ReportError(f"{self.meta_file}: {field} {problem}")

    def whole(self, field: str, value: Any, low: int, high: int, *, none: bool = False) -> None:
        if value is None and none:
            return
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(field, f"must be a whole number, got {_shown(value)}")
        if not low <= value <= high:
            raise self.fail(field, f"{_shown(value)} out of range {low}..{high}")

    def number(self, field: str, value: Any, low: float, high: float) -> None:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise self.fail(field, f"must be a number, got {_shown(value)}")
        # an int compares with the float bounds exactly; math.isfinite(10**400) overflows
        finite = not isinstance(value, float) or math.isfinite(value)
        if not (finite and low <= value <= high):
            raise self.fail(field, f"{_shown(value)} out of range {low:g}..{high:g}")

    def text(self, field: str, value: Any) -> None:
        if not isinstance(value, str):
            raise self.fail(field, f"must be a string, got {_shown(value)}")


_BOUNDS = {
    "headroom_bits": (0, limits.MAX_HEADROOM_BITS),
    "steps": (0, _INT32_MAX),
    "steps_run": (0, _INT32_MAX),
    "every": (1, _INT32_MAX),
    "ranks": (1, MAX_RANKS),
    "world_size": (1, MAX_RANKS),
    "out_of_range": (0, 2**62),
}
_TRAINING_COUNTS = (
    "steps",
    "skipped",
    "calibration_steps",
    "steps_after_calibration",
    "skipped_after_calibration",
)


def _check_meta_values(meta: dict[str, Any], meta_file: Path) -> None:
    """Every number a reader uses lies in its range, and the findings, training and
    scaler blocks have the shape their readers expect; each message names the field."""
    check = _Fields(meta_file)
    for key, (low, high) in _BOUNDS.items():
        if key in meta:
            check.whole(key, meta[key], low, high)
    if "steps_requested" in meta:
        check.whole("steps_requested", meta["steps_requested"], 0, _INT32_MAX, none=True)
    if meta.get("loss_scale") is not None:
        check.number("loss_scale", meta["loss_scale"], 2.0**-149, _FP32_MAX)
    for key in ("amp", "amp_dtype", "command"):
        if meta.get(key) is not None:
            check.text(key, meta[key])
    selection = meta.get("selection")
    globs = selection.values() if isinstance(selection, dict) else [None]
    if selection is not None and not all(
        isinstance(v, list) and all(isinstance(p, str) for p in v) for v in globs
    ):
        raise check.fail("selection", "must map option names to lists of glob strings")
    for index, item in enumerate(meta.get("findings") or []):
        _check_finding(check, f"findings[{index}]", item)
    training = meta.get("training")
    if training is not None:
        for key in _TRAINING_COUNTS:
            check.whole(f"training.{key}", training.get(key), 0, _INT32_MAX)
        rate = training.get("skip_rate_after_calibration")
        check.number("training.skip_rate_after_calibration", rate, 0.0, 1.0)
    scaler = meta.get("scaler")
    if scaler is not None:
        check.text("scaler.class", scaler.get("class"))
        check.number("scaler.init_scale", scaler.get("init_scale"), 2.0**-149, _FP32_MAX)
        check.number("scaler.growth_factor", scaler.get("growth_factor"), 0.0, _FP32_MAX)
        check.number("scaler.backoff_factor", scaler.get("backoff_factor"), 0.0, _FP32_MAX)
        check.whole("scaler.growth_interval", scaler.get("growth_interval"), 0, _INT32_MAX)


def _check_finding(check: _Fields, where: str, item: Any) -> None:
    if not isinstance(item, dict):
        raise check.fail(where, f"must be an object, got {_shown(item)}")
    for key in ("code", "file", "message", "severity"):
        check.text(f"{where}.{key}", item.get(key))
    check.whole(f"{where}.line", item.get("line"), 0, _INT32_MAX)
    check.whole(f"{where}.count", item.get("count"), 0, _INT32_MAX)
    steps = item.get("steps")
    if not isinstance(steps, list):
        raise check.fail(f"{where}.steps", f"must be a list of steps, got {_shown(steps)}")
    for step in steps:
        check.whole(f"{where}.steps", step, 0, _INT32_MAX)


def _shown(value: Any) -> str:
    """A value for an error message: short, whatever it is."""
    text = json.dumps(value) if not isinstance(value, float) else f"{value:g}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**6:
        # past float's range (10**400) float() overflows; Decimal keeps every int
        text = f"{float(value):g}" if abs(value) < 2**1023 else f"{Decimal(value).normalize():.6g}"
    return text if len(text) <= 40 else text[:37] + "..."
