"""The report's schema: its version, the Arrow schema of every table, and the bins' layout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd
import pyarrow as pa

from fpaudit.numerics import layout
from fpaudit.report.records import (
    BLOCK_COUNT_COLUMNS,
    BLOCK_HISTOGRAM_COLUMNS,
    BLOCK_KEY_COLUMNS,
    ORIGINS_TABLE,
    SKIPS_TABLE,
    STEP_DEFAULTS,
)
from fpaudit.report.tables import Bins, Origins, Records, Skips, Steps, Table

SCHEMA_VERSION = 6


READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)


META_FILE = "meta.json"


# A reader trusts nothing it has not checked: meta.json is read only up to this size
# (a model of 100,000 modules needs a few MB) and this nesting depth (fpaudit writes 3).
MAX_META_BYTES = 64 << 20


MAX_META_DEPTH = 32


MAX_RANKS = 2**15  # ranks are int16 in the tables


_ARROW_TYPES = {
    "int8": pa.int8(),
    "int16": pa.int16(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float64": pa.float64(),
    "bool": pa.bool_(),
    "string": pa.string(),
}


def schema_of(table: type[Table]) -> pa.Schema:
    """The Arrow schema of a table's class (``fpaudit.report.tables``): its columns, in
    order, with their types."""
    return pa.schema([(name, _ARROW_TYPES[t]) for name, t in table.columns().items()])


RECORDS_SCHEMA = schema_of(Records)


BINS_SCHEMA = schema_of(Bins)


STEPS_SCHEMA = schema_of(Steps)


TABLES = {"records": RECORDS_SCHEMA, "bins": BINS_SCHEMA, "steps": STEPS_SCHEMA}


ORIGINS_SCHEMA = schema_of(Origins)


SKIPS_SCHEMA = schema_of(Skips)


def blocks_schema(counts: pa.DataType) -> pa.Schema:
    return pa.schema(
        [(name, _ARROW_TYPES[t]) for name, t in BLOCK_KEY_COLUMNS.items()]
        + [(name, counts) for name in BLOCK_COUNT_COLUMNS]
        + [(name, pa.list_(pa.int64())) for name in BLOCK_HISTOGRAM_COLUMNS]
    )


# float64 counts from version 4: a stochastic-rounding recipe's are expected values
BLOCKS_SCHEMA = blocks_schema(pa.float64())


# Optional tables, written only when present and read only when listed in meta.json's
# files (older reports have none): scan --origins's op calls (fpaudit.rules.origins) and,
# from version 3, block-scaled statistics when recipes were audited (fpaudit.kernels.blockstats),
# from version 6, the skipped steps of `fpaudit run` with their origins (fpaudit.run.skips).
OPTIONAL_TABLES = {
    ORIGINS_TABLE: ORIGINS_SCHEMA,
    "blocks": BLOCKS_SCHEMA,
    SKIPS_TABLE: SKIPS_SCHEMA,
}


DERIVED_BIN_COLUMNS = ("lower", "upper")


def histogram_layout() -> dict[str, Any]:
    """The histogram layout, stored in metadata so a report describes itself."""
    return {
        "binade_min": layout.BINADE_MIN,
        "binade_max": layout.BINADE_MAX,
        "fraction_bits": layout.FRACTION_BITS,
        "class_lower_bounds": list(layout.CLASS_LOWER_BOUNDS),
    }


def frame(columns: dict[str, Any], schema: pa.Schema, names: Sequence[str] = ()) -> pd.DataFrame:
    """A DataFrame of ``columns`` through Arrow, so its dtypes are exactly what a read gives."""
    fields = [schema.field(n) for n in names] if names else list(schema)
    arrays = [pa.array(columns[f.name], type=f.type) for f in fields]
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields)).to_pandas()


# Version 1 wrote no rank column and fewer step columns.
V1_RECORDS = pa.schema([f for f in RECORDS_SCHEMA if f.name != "rank"])
V1_STEPS = pa.schema(
    [
        f
        for f in STEPS_SCHEMA
        if f.name not in STEP_DEFAULTS
        or f.name in ("records", "nonfinite_grads", "optimizer_step", "first_nonfinite")
    ]
)
V1_TABLES = {"records": V1_RECORDS, "steps": V1_STEPS}
# Versions 2 to 4 wrote no clipping by value (clip_value, clipped_fraction: version 5).
V4_STEPS = pa.schema([f for f in STEPS_SCHEMA if f.name not in ("clip_value", "clipped_fraction")])
