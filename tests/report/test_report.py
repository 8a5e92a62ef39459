"""The report directory: schema, round trip, atomic writes, and refusing bad reports."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from fpaudit.errors import ReportError
from fpaudit.kernels import histogram
from fpaudit.report.records import KIND_BACKWARD, RecordKey, ReportBuilder, StepRecords
from fpaudit.report.schema import BINS_SCHEMA, RECORDS_SCHEMA, SCHEMA_VERSION, STEPS_SCHEMA
from fpaudit.report.store import Report

from ..reports import report_from


@pytest.fixture
def report() -> Report:
    return report_from({"a": torch.tensor([2.0**-30, 1.0, 0.0]), "b": torch.randn(50)}, steps=2)


def test_round_trip(tmp_path: Path, report: Report) -> None:
    written = report.write(tmp_path / "r")
    back = Report.read(written)
    pd.testing.assert_frame_equal(back.records, report.records)
    pd.testing.assert_frame_equal(back.bins, report.bins)
    pd.testing.assert_frame_equal(back.steps, report.steps)
    assert back.meta["schema_version"] == SCHEMA_VERSION


def test_plain_pandas_and_pyarrow_read_it(tmp_path: Path, report: Report) -> None:
    root = report.write(tmp_path / "r")
    records = pd.read_parquet(root / "records.parquet")
    bins = pd.read_parquet(root / "bins.parquet")
    assert list(records.columns) == RECORDS_SCHEMA.names
    assert list(bins.columns) == BINS_SCHEMA.names
    assert list(pd.read_parquet(root / "steps.parquet").columns) == STEPS_SCHEMA.names
    assert (
        pq.read_schema(root / "bins.parquet").metadata[b"fpaudit.schema_version"]
        == str(SCHEMA_VERSION).encode()
    )
    meta = json.loads((root / "meta.json").read_text())
    assert meta["files"]["bins.parquet"]["rows"] == len(bins)
    # A query a user would write: values of module a at or below fp16's round-to-zero edge.
    joined = bins.merge(records[["record_id", "module", "step"]], on="record_id")
    tiny = joined[(joined["module"] == "a") & (joined["upper"] <= 2.0**-25)]
    assert int(tiny["count"].sum()) == 2  # 2**-30 in each of 2 steps


def test_bins_lower_and_upper_bound_their_values(tmp_path: Path, report: Report) -> None:
    # Written for plain-Parquet users, derived from (binade, cls); not kept in memory.
    bins = pd.read_parquet(report.write(tmp_path / "r") / "bins.parquet")
    for row in bins.itertuples():
        assert (row.lower, row.upper) == histogram.bin_value_bounds(row.binade, row.cls)
    assert (bins["lower"] <= bins["upper"]).all()
    assert list(report.bins.columns) == ["record_id", "binade", "cls", "count"]


def test_refuses_to_overwrite_without_force(tmp_path: Path, report: Report) -> None:
    target = report.write(tmp_path / "r")
    with pytest.raises(ReportError, match="already exists; pass force=True to overwrite it"):
        report.write(target)
    report.write(target, force=True)
    assert Report.read(target).meta["steps"] == 2


def test_force_never_replaces_something_that_is_not_a_report(
    tmp_path: Path, report: Report
) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(ReportError, match="not an fpaudit report; refusing"):
        report.write(precious, force=True)
    assert (precious / "thesis.tex").read_text() == "years of work"


def test_a_crash_while_writing_leaves_no_report_and_no_debris(
    tmp_path: Path, report: Report, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = pq.write_table
    calls = {"n": 0}

    def failing_write(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(pq, "write_table", failing_write)
    with pytest.raises(ReportError, match=r"cannot write .*/r: disk full"):  # one line
        report.write(tmp_path / "r")
    assert list(tmp_path.iterdir()) == []


def test_a_crash_while_replacing_keeps_the_old_report(
    tmp_path: Path, report: Report, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = report.write(tmp_path / "r")
    before = (target / "meta.json").read_text()
    monkeypatch.setattr(pq, "write_table", lambda *a, **k: (_ for _ in ()).throw(OSError("boom")))
    with pytest.raises(ReportError, match="boom"):
        report.write(target, force=True)
    assert (target / "meta.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


def _written(tmp_path: Path, report: Report) -> Path:
    return report.write(tmp_path / "r")


def _as_older_steps(root: Path, columns: list[str], version: int) -> None:
    """Make the report at ``root`` one of schema ``version``, whose steps table has only
    ``columns``: the table rewritten, its checksum and the version in meta.json updated."""
    import hashlib

    steps_file = root / "steps.parquet"
    pq.write_table(pq.read_table(steps_file, columns=columns), steps_file)
    meta = json.loads((root / "meta.json").read_text())
    meta["schema_version"] = version
    meta["files"]["steps.parquet"]["sha256"] = hashlib.sha256(steps_file.read_bytes()).hexdigest()
    (root / "meta.json").write_text(json.dumps(meta))


def test_missing_report(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match="does not exist"):
        Report.read(tmp_path / "nope")


def test_not_a_report(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match="not an fpaudit report"):
        Report.read(tmp_path)


def test_newer_schema_version(tmp_path: Path, report: Report) -> None:
    root = _written(tmp_path, report)
    meta = json.loads((root / "meta.json").read_text())
    meta["schema_version"] = SCHEMA_VERSION + 1
    (root / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ReportError, match="newer than this fpaudit reads"):
        Report.read(root)


def test_unknown_older_schema_version(tmp_path: Path, report: Report) -> None:
    root = _written(tmp_path, report)
    meta = json.loads((root / "meta.json").read_text())
    meta["schema_version"] = 0
    (root / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ReportError, match="unknown report schema version 0"):
        Report.read(root)


def test_corrupt_metadata(tmp_path: Path, report: Report) -> None:
    root = _written(tmp_path, report)
    (root / "meta.json").write_text("{not json")
    with pytest.raises(ReportError, match="corrupt metadata"):
        Report.read(root)


def test_truncated_parquet(tmp_path: Path, report: Report) -> None:
    root = _written(tmp_path, report)
    data = (root / "bins.parquet").read_bytes()
    (root / "bins.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(ReportError, match=r"bins.parquet is corrupt \(checksum mismatch\)"):
        Report.read(root)


def test_missing_table(tmp_path: Path, report: Report) -> None:
    root = _written(tmp_path, report)
    (root / "steps.parquet").unlink()
    with pytest.raises(ReportError, match=r"steps\.parquet is missing"):
        Report.read(root)


def test_builder_keeps_no_view_of_a_step_matrix() -> None:
    # A stored column that is a view would keep each step's whole gathered matrix
    # (records x 2219 int64) alive: memory growing with every captured step.

    from fpaudit.report.records import KIND_BACKWARD, RecordKey, ReportBuilder, StepRecords

    counts = np.ones((3, histogram.N_BINS), dtype=np.int64)
    keys = [
        RecordKey(KIND_BACKWARD, f"m{i}", "n", "aten.mul.Tensor", 0, "float32", True)
        for i in range(3)
    ]
    builder = ReportBuilder(modules=["m0", "m1", "m2"])
    builder.add_step(
        StepRecords(keys, counts, np.ones(3), np.ones(3, np.int64)),
        loss=1.0,
        loss_scale=1.0,
        seconds=0.0,
    )
    stored = [
        a
        for parts in (builder._records, builder._bins)
        for arrays in parts.values()
        for a in arrays
    ]
    assert not any(isinstance(a, np.ndarray) and np.shares_memory(a, counts) for a in stored)


def test_window_merges_steps_exactly() -> None:
    # Four steps of the same two tensors: per step, and merged two by two.
    from fpaudit.numerics.formats import FORMATS
    from fpaudit.rules import analysis

    tensors = {"a": torch.tensor([2.0**-30, 1.0, 0.0, float("inf")]), "b": torch.randn(100) * 1e-6}
    per_step = report_from(tensors, steps=4)
    windowed = report_from(tensors, steps=4, window=2)
    assert len(windowed.records) == len(per_step.records) // 2
    assert list(windowed.records["step"].unique()) == [0, 2]
    assert (windowed.records["steps"] == 2).all() and (per_step.records["steps"] == 1).all()
    assert len(windowed.steps) == 4  # the steps table keeps every step
    for name in FORMATS:
        for log2_scale in (-5, 0, 10, 30):
            a = analysis.module_table(per_step, FORMATS[name], log2_scale)
            b = analysis.module_table(windowed, FORMATS[name], log2_scale)
            pd.testing.assert_frame_equal(a, b)


def test_window_keeps_loss_scales_apart_and_reports_an_open_window() -> None:

    from fpaudit.report.records import KIND_BACKWARD, RecordKey, ReportBuilder, StepRecords

    key = RecordKey(KIND_BACKWARD, "m", "n", "aten.mul.Tensor", 0, "float32", True)
    builder = ReportBuilder(modules=["m"], window=3)
    counts = np.zeros((1, histogram.N_BINS), dtype=np.int64)
    counts[0, histogram.finite_bin(-10, 2)] = 5
    for scale in (1.0, 1.0, 2.0, 2.0):
        builder.add_step(
            StepRecords([key], counts, np.ones(1), np.ones(1, np.int64)),
            loss=1.0,
            loss_scale=scale,
            seconds=0.0,
        )
    records = Report.from_builder(builder).records
    # Window 1 (steps 0-2): scale 1 (2 steps) and scale 2 (1 step); window 2 still open: step 3.
    assert list(zip(records["step"], records["steps"], records["loss_scale"], strict=True)) == [
        (0, 2, 1.0), (0, 1, 2.0), (3, 1, 2.0)
    ]  # fmt: skip
    assert list(records["elements"]) == [10, 5, 5]
    builder.add_step(
        StepRecords([key], counts, np.ones(1), np.ones(1, np.int64)),
        loss=float("nan"),
        loss_scale=2.0,
        seconds=0.0,
    )
    assert list(Report.from_builder(builder).records["steps"]) == [
        2,
        1,
        1,
    ]  # the NaN step adds nothing


def test_a_version_1_report_reads_with_the_new_step_columns_at_their_defaults(
    tmp_path: Path, report: Report
) -> None:
    """Reports written by fpaudit 0.1.0 (schema 1) lack the training-loop step columns."""
    root = _written(tmp_path, report)
    v1_columns = ["step", "loss", "loss_finite", "loss_scale", "records", "nonfinite_grads",
                  "optimizer_step", "first_nonfinite", "seconds"]  # fmt: skip
    _as_older_steps(root, v1_columns, 1)
    back = Report.read(root)
    assert list(back.steps.columns) == STEPS_SCHEMA.names
    assert list(back.steps["scale_after"]) == list(back.steps["loss_scale"])
    assert not back.steps["skipped"].any() and back.steps["captured"].all()
    assert back.steps["grad_norm"].isna().all()
    pd.testing.assert_frame_equal(back.records, report.records)


def test_a_version_4_report_reads_without_clipping_by_value(tmp_path: Path, report: Report) -> None:
    """Schema 2 to 4 steps tables lack clip_value and clipped_fraction (version 5)."""
    root = _written(tmp_path, report)
    older = [n for n in STEPS_SCHEMA.names if n not in ("clip_value", "clipped_fraction")]
    _as_older_steps(root, older, 4)
    back = Report.read(root)
    assert list(back.steps.columns) == STEPS_SCHEMA.names
    assert back.steps["clip_value"].isna().all() and back.steps["clipped_fraction"].isna().all()
    pd.testing.assert_frame_equal(back.steps[older], report.steps[older])


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("records", [1, 7, 50])
def test_bins_are_summed_per_record_exactly_in_or_out_of_order(records: int, ordered: bool) -> None:
    from fpaudit.report.checks import sum_by_record

    generator = np.random.default_rng(records)
    refs = generator.integers(0, records, 400).astype(np.int32)
    refs = refs[(refs != records // 2) & (refs != records - 1)]  # records without bins
    refs = np.sort(refs) if ordered else refs
    counts = generator.integers(0, 2**40, len(refs))
    expected = [
        sum(int(c) for r, c in zip(refs, counts, strict=True) if r == i) for i in range(records)
    ]
    assert sum_by_record(refs, counts, records).tolist() == expected
    assert sum_by_record(refs[:0], counts[:0], records).tolist() == [0] * records


def _origin_rows(module: str, steps: list[int]) -> dict[str, list[Any]]:
    n = len(steps)
    return {
        "step": steps, "sequence": list(range(1, n + 1)), "phase": ["backward"] * n,
        "module": [module] * n, "node": ["MulBackward0"] * n, "op": ["aten.mul.Tensor"] * n,
        "output": [0] * n, "dtype": ["float32"] * n, "scales_with_loss": [True] * n,
        "loss_scale": [1.0] * n, "elements": [4] * n, "nonfinite": [1] * n, "amax": [2.0] * n,
        "inputs_nonfinite": [False] * n, "input_amax_scaled": [1.0] * n,
        "input_amax_fixed": [0.0] * n,
    }  # fmt: skip


def _block_rows(rank: int, module: str) -> dict[str, list[Any]]:
    from fpaudit.kernels import blockstats
    from fpaudit.report.records import BLOCK_COUNT_COLUMNS

    return {
        "rank": [rank], "step": [0], "kind": ["backward"], "module": [module],
        "node": ["MulBackward0"], "op": ["aten.mul.Tensor"], "output": [0],
        "dtype": ["float32"], "recipe": ["mxfp8_e4m3"],
        **{name: [rank + 1] for name in BLOCK_COUNT_COLUMNS},
        "scale_codes": [[0] * blockstats.N_SCALE_CODES],
        "dynamic_range": [[0] * blockstats.N_RANGES],
    }  # fmt: skip


def test_for_rank_keeps_that_ranks_rows_of_every_optional_table(tmp_path: Path) -> None:
    from fpaudit.report.records import SKIP_COLUMNS
    from fpaudit.report.schema import BLOCKS_SCHEMA, OPTIONAL_TABLES, SKIPS_SCHEMA, frame
    from fpaudit.report.store import _merge_ranks
    from fpaudit.rules.origins import table_from_columns

    # Two ranks' parts as a reader finds them: rank 0 has 2 origin rows, rank 1 has 1.
    parts = []
    for rank, module, origin_steps in ((0, "a", [0, 1]), (1, "b", [1])):
        part = report_from({module: torch.tensor([1.0, 2.0**-30])})
        part.records["rank"] = np.int16(rank)
        part.steps["rank"] = np.int16(rank)
        part.origins = table_from_columns(_origin_rows(module, origin_steps))
        part.blocks = frame(_block_rows(rank, module), BLOCKS_SCHEMA)
        blank = {"string": "", "bool": True}
        skip = {name: [blank.get(kind, 0)] for name, kind in SKIP_COLUMNS.items()}
        part.skips = frame({**skip, "rank": [rank], "step": [rank + 5]}, SKIPS_SCHEMA)
        parts.append(part)
    merged = _merge_ranks(parts, dataclasses.replace(parts[0].info, ranks=2), tmp_path)
    assert set(OPTIONAL_TABLES) == {"origins", "blocks", "skips"}  # all are checked below
    assert merged.origins is not None and len(merged.origins) == 3
    for rank, module, origin_steps in ((0, "a", [0, 1]), (1, "b", [1])):
        alone = merged.for_rank(rank)
        assert alone.origins is not None and alone.blocks is not None
        assert list(alone.origins["module"]) == [module] * len(origin_steps)
        assert list(alone.origins["step"]) == origin_steps
        assert list(alone.blocks["module"]) == [module]
        assert list(alone.blocks["zero"]) == [rank + 1]
        assert alone.skips is not None and list(alone.skips["step"]) == [rank + 5]
        assert list(alone.records["module"]) == [module]
    # a one-rank report keeps its whole optional tables
    single = parts[0].for_rank(0)
    assert single.origins is not None and len(single.origins) == 2


def test_the_record_key_is_declared_once_and_every_table_lays_it_out_in_order() -> None:
    from fpaudit.report.records import (
        BLOCK_KEY_COLUMNS,
        KEY_COLUMNS,
        OP_KEY_COLUMNS,
        RECORD_COLUMNS,
        RecordKey,
    )

    assert RecordKey._fields == (*KEY_COLUMNS, "scales_with_loss")
    assert OP_KEY_COLUMNS == ("kind", "module", "node", "op", "output")
    for table in (RECORD_COLUMNS, BLOCK_KEY_COLUMNS):
        names = list(table)
        start = names.index("kind")
        assert names[start : start + len(KEY_COLUMNS)] == list(KEY_COLUMNS)
        assert all(table[name] == KEY_COLUMNS[name] for name in KEY_COLUMNS)


# -- the last closed step alone (Audit.metrics reads it) ---------------------------------
def _builder_of(steps: list[list[float]], window: int) -> ReportBuilder:
    from fpaudit.kernels import histogram

    builder = ReportBuilder(modules=["a", "b"], window=window)
    for values in steps:
        records = {}
        for module, tensor in (("a", torch.tensor(values)), ("b", torch.tensor(values) * 4)):
            hist = histogram.Histogram(tensor.device)
            hist.add(tensor)
            key = RecordKey(KIND_BACKWARD, module, "MulBackward0", "aten.mul.Tensor", 0,
                            "float32", True)  # fmt: skip
            records[key] = hist.host()
        builder.add_step(StepRecords.from_histograms(records), loss=1.0, loss_scale=1.0,
                         seconds=0.0)  # fmt: skip
    return builder


def test_the_last_step_alone_is_what_the_whole_report_holds_of_it() -> None:
    from fpaudit.rules.drift import window_report

    steps = [[1.0, 2.0**-30, 0.0], [0.5, 0.25], [3.0, -(2.0**-20), 2.0**-140, 7.0]]
    builder = _builder_of(steps, window=1)
    last = builder.last_step()
    assert last is not None
    alone = Report.from_builder(last)
    whole = window_report(Report.from_builder(builder), 2, 2)
    assert alone.records.drop(columns="record_id").equals(whole.records.drop(columns="record_id"))
    assert alone.bins.equals(whole.bins)  # renumbered from 0 in both
    assert alone.steps["step"].tolist() == [2]
    # step 2 of module "a": 4 values, none zero; "b" the same values times 4
    assert alone.records["elements"].tolist() == [4, 4]


def test_with_a_window_the_last_step_is_its_window_so_far() -> None:
    builder = _builder_of([[1.0, 2.0], [4.0], [8.0, 16.0, 32.0]], window=2)
    last = builder.last_step()  # step 2 opens the second window: it alone so far
    assert last is not None
    records = Report.from_builder(last).records
    assert records["elements"].tolist() == [3, 3] and records["steps"].tolist() == [1, 1]
    assert ReportBuilder(modules=["a"]).last_step() is None
