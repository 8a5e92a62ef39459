"""Fuzz the report readers: tampered reports give a correct result or one clean error line.

Three kinds of damage, each with checksums fixed up afterwards so that the
readers see it (a plain checksum mismatch is caught first and is tested in
test_report.py): random JSON in the metadata, random bytes in the Parquet
files, and well-formed Parquet tables holding impossible values. Every
reading command (show, recommend, gate) must then exit 0 or 1 with a result,
or 2 with one ``fpaudit: error:`` line: never an internal error or a traceback.
A result must be a correct one: every ``show --json`` row's counts add up (elements =
zeros + non-finite + nonzero, each class within its total, fractions = count / nonzero),
``recommend --json``'s scale is 2 to its exponent; and where only the metadata was
tampered with (the tables are the pristine ones), the format-independent numbers of every
module (elements, zeros, infs, NaNs, nonzero, amax) equal the pristine report's.
Bounded: about 150 examples in all.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fpaudit.cli.commands import run

from ..reports import report_from

COMMANDS = (
    ("show", "--json"),
    ("recommend", "--json"),
    ("gate", "--max-underflow", "0.01"),
    ("show", "--by", "op", "--scale", "recommended"),
)
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    report = report_from(
        {
            "a": torch.tensor([2.0**-30, 1.0, 0.0, float("inf"), float("nan")]),
            "b": torch.randn(64) * 1e-5,
        },
        steps=2,
    )
    report.update_info(formats=("fp16",), headroom_bits=4)
    return report.write(tmp_path_factory.mktemp("pristine") / "report")


def _copy(pristine: Path, tmp: Path) -> Path:
    target = tmp / "report"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(pristine, target)
    return target


def _fix_checksums(root: Path) -> None:
    meta = json.loads((root / "meta.json").read_text())
    for name in meta["files"]:
        data = (root / name).read_bytes()
        meta["files"][name]["sha256"] = hashlib.sha256(data).hexdigest()
        with contextlib.suppress(Exception):
            meta["files"][name]["rows"] = pq.ParquetFile(root / name).metadata.num_rows
    (root / "meta.json").write_text(json.dumps(meta))


UNSCALED = ("elements", "zeros", "infs", "nans", "nonfinite", "nonzero", "amax")


def _show(root: Path) -> dict[str, dict[str, object]] | None:
    """``show --json``'s rows by module, or None when it refused (exit 2)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = run(["show", str(root), "--json"])
    return {row["module"]: row for row in json.loads(out.getvalue())} if code == 0 else None


def _check_rows(rows: list[dict[str, object]]) -> None:
    """What holds of any correct ``show --json`` result, whatever the report holds."""
    for row in rows:
        n: dict[str, int] = {k: int(row[k]) for k in ("elements", "zeros", "infs", "nans",
                             "nonfinite", "nonzero", "underflow", "flushed", "subnormal",
                             "overflow")}  # fmt: skip
        assert all(v >= 0 for v in n.values()), row
        assert n["nonfinite"] == n["infs"] + n["nans"], row
        assert n["elements"] == n["zeros"] + n["nonfinite"] + n["nonzero"], row
        assert max(n["underflow"], n["subnormal"], n["overflow"]) <= n["nonzero"], row
        assert n["underflow"] <= n["flushed"] <= n["nonzero"], row
        for name in ("underflow", "flushed", "overflow"):
            expected = n[name] / n["nonzero"] if n["nonzero"] else 0.0
            assert row[f"{name}_fraction"] == pytest.approx(expected, rel=1e-12, abs=0), row


def _assert_clean(root: Path) -> None:
    for args in COMMANDS:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run([args[0], str(root), *args[1:]])
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        assert "Traceback" not in err.getvalue()
        assert "internal error" not in err.getvalue(), err.getvalue()
        if code == 2:
            assert len(lines) == 1 and lines[0].startswith("fpaudit: error: "), err.getvalue()
        else:
            assert code in (0, 1), (args, code, err.getvalue())
            if args[0] == "show" and "--json" in args:
                _check_rows(json.loads(out.getvalue()))
            elif args[0] == "recommend":
                result = json.loads(out.getvalue())
                assert result["scale"] == 2.0 ** result["log2_scale"], result
                assert 0 <= result["underflow_fraction"] <= 1, result


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=6,
)
META_KEYS = ["schema_version", "histogram", "files", "modules", "formats", "headroom_bits",
             "include_loss", "complete", "stopped_by", "steps", "steps_run", "steps_requested"]  # fmt: skip


@SETTINGS
@given(key=st.sampled_from(META_KEYS), value=json_values, delete=st.booleans())
def test_tampered_metadata(
    pristine: Path, tmp_path: Path, key: str, value: object, delete: bool
) -> None:
    root = _copy(pristine, tmp_path)
    meta = json.loads((root / "meta.json").read_text())
    if delete:
        meta.pop(key, None)
    else:
        meta[key] = value
    (root / "meta.json").write_text(json.dumps(meta))
    _assert_clean(root)
    shown = _show(root)
    if shown is not None:  # the tables are untouched: so are their format-free numbers
        before = _show(pristine)
        assert before is not None and set(shown) <= set(before), (shown, before)
        for module, row in shown.items():
            assert {k: row[k] for k in UNSCALED} == {k: before[module][k] for k in UNSCALED}


@SETTINGS
@given(
    table=st.sampled_from(["records.parquet", "bins.parquet", "steps.parquet"]),
    edits=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1, max_size=8),
    truncate=st.none() | st.floats(0, 1),
)
def test_damaged_parquet_bytes(
    pristine: Path,
    tmp_path: Path,
    table: str,
    edits: list[tuple[float, int]],
    truncate: float | None,
) -> None:
    root = _copy(pristine, tmp_path)
    data = bytearray((root / table).read_bytes())
    for where, byte in edits:
        data[int(where * (len(data) - 1))] = byte
    if truncate is not None:
        data = data[: int(truncate * len(data))]
    (root / table).write_bytes(bytes(data))
    _fix_checksums(root)
    _assert_clean(root)


COLUMN_DAMAGE = {
    "records.parquet": [
        "record_id",
        "step",
        "steps",
        "calls",
        "elements",
        "zeros",
        "infs",
        "nans",
        "amax",
        "loss_scale",
        "output",
    ],
    "bins.parquet": ["record_id", "binade", "cls", "count", "lower", "upper"],
    "steps.parquet": ["step", "loss", "loss_scale", "records", "seconds"],
}
numbers = st.sampled_from([0, -1, 1, 2**31 - 1, -(2**31), 2**62, 127, -149, 300, 8, 7]) | st.floats(
    allow_nan=True, allow_infinity=True
)


@SETTINGS
@given(
    table=st.sampled_from(list(COLUMN_DAMAGE)),
    data=st.data(),
)
def test_well_formed_tables_with_impossible_values(
    pristine: Path, tmp_path: Path, table: str, data: st.DataObject
) -> None:
    root = _copy(pristine, tmp_path)
    arrow = pq.read_table(root / table)
    column = data.draw(st.sampled_from(COLUMN_DAMAGE[table]))
    row = data.draw(st.integers(0, max(0, arrow.num_rows - 1)))
    value = data.draw(numbers)
    values = arrow.column(column).to_pylist()
    if values:
        kind = arrow.schema.field(column).type
        if pa.types.is_integer(kind):
            info = np.iinfo(kind.to_pandas_dtype())
            values[row] = int(np.clip(int(value) if np.isfinite(value) else 0, info.min, info.max))
        else:
            values[row] = float(value)
    arrow = arrow.set_column(
        arrow.schema.get_field_index(column),
        column,
        pa.array(values, arrow.schema.field(column).type),
    )
    pq.write_table(arrow, root / table)
    _fix_checksums(root)
    _assert_clean(root)
