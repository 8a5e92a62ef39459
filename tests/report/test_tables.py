"""Every report table's columns are named once (fpaudit.report.tables) and are what the
files hold."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pytest

from fpaudit.report.records import RecordKey
from fpaudit.report.schema import (
    BINS_SCHEMA,
    BLOCKS_SCHEMA,
    OPTIONAL_TABLES,
    ORIGINS_SCHEMA,
    RECORDS_SCHEMA,
    SKIPS_SCHEMA,
    STEPS_SCHEMA,
    TABLES,
)
from fpaudit.report.tables import Bins, Blocks, Key, Origins, Records, Skips, Steps, Table

from ..reports import report_from


@pytest.mark.parametrize(
    ("table", "schema"),
    [(Records, RECORDS_SCHEMA), (Bins, BINS_SCHEMA), (Steps, STEPS_SCHEMA),
     (Origins, ORIGINS_SCHEMA), (Skips, SKIPS_SCHEMA)],
    ids=["records", "bins", "steps", "origins", "skips"],
)  # fmt: skip
def test_each_tables_class_is_its_files_columns_in_order(
    table: type[Table], schema: pa.Schema
) -> None:
    assert list(table.columns()) == schema.names


def test_the_blocks_key_columns_lead_its_file_and_every_table_is_declared() -> None:
    keys = list(Blocks.columns())
    assert BLOCKS_SCHEMA.names[: len(keys)] == keys
    assert set(TABLES) | set(OPTIONAL_TABLES) == {
        "records",
        "bins",
        "steps",
        "origins",
        "blocks",
        "skips",
    }


def test_the_record_key_is_declared_once_and_spliced_where_the_files_have_it() -> None:
    key = list(Key.columns())
    # RecordKey names the same columns, and whether the value scales with the loss
    assert key == [name for name in RecordKey._fields if name != "scales_with_loss"]
    for table, after in ((Records, "steps"), (Blocks, "step")):
        names = list(table.columns())
        at = names.index(after) + 1
        assert names[at : at + len(key)] == key


def test_a_column_is_its_name_on_the_class_and_the_column_on_a_wrapped_table() -> None:
    import torch

    report = report_from({"a": torch.tensor([1.0, 2.0**-30]), "b": torch.tensor([3.0])})
    assert Records.module == "module" and Steps.loss_scale == "loss_scale"
    records = Records(report.records)
    pd.testing.assert_series_equal(records.module, report.records["module"])
    assert list(records.module) == ["a", "b"]  # one backward record per module
    assert list(Bins(report.bins).count) == list(report.bins["count"])
