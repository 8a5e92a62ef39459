"""The command line: exit codes, output, JSON keys, and one clear line for every bad input."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from fpaudit.numerics.formats import FORMATS

from ..conftest import MODELS, SAMPLES, one_error_line
from ..oracle import oracle_counts

SHOW_KEYS = {"module", "elements", "zeros", "nonfinite", "underflow", "flushed", "subnormal",
             "overflow", "underflow_fraction", "amax"}  # fmt: skip
RECOMMEND_KEYS = {"format", "headroom_bits", "scale", "log2_scale", "underflow_fraction",
                  "underflow_fraction_at_1", "limiting_module", "limiting_op", "amax"}  # fmt: skip


@pytest.fixture(scope="module")
def known_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fpaudit.cli.commands import run

    out = tmp_path_factory.mktemp("known") / "report"
    assert run(["scan", str(MODELS / "known_grads.py"), "--steps", "1", "--loss-scale", "2^10",
                "--out", str(out)]) == 0  # fmt: skip
    return out


@pytest.fixture(scope="module")
def mlp_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fpaudit.cli.commands import run

    out = tmp_path_factory.mktemp("mlp") / "report"
    assert run(["scan", str(SAMPLES / "mlp.py"), "--steps", "2", "--out", str(out),
                "--format", "fp16", "--format", "bf16"]) == 0  # fmt: skip
    return out


def test_version_and_help(cli) -> None:
    assert cli("--version").stdout.startswith("fpaudit ")
    result = cli("--help")
    assert result.code == 0
    for command in ("scan", "show", "recommend", "gate", "formats"):
        assert command in result.stdout


def test_formats(cli) -> None:
    result = cli("formats")
    assert result.code == 0
    for name in FORMATS:
        assert name in result.stdout
    rows = json.loads(cli("formats", "--json").stdout)
    fp16 = next(r for r in rows if r["format"] == "fp16")
    assert (fp16["smallest_subnormal"], fp16["round_to_zero_edge"], fp16["smallest_normal"],
            fp16["max_finite"], fp16["overflow_edge"]) == (2.0**-24, 2.0**-25, 2.0**-14, 65504.0, 65520.0)  # fmt: skip


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("log2_scale", [-10, 0, 7, 10, 24])
def test_show_json_matches_the_cast_oracle(
    cli, known_report: Path, name: str, log2_scale: int
) -> None:
    values = runpy.run_path(str(MODELS / "known_grads.py"))["VALUES"]
    result = cli("show", known_report, "--format", name, "--scale", f"2^{log2_scale}", "--json")
    assert result.code == 0, result.stderr
    rows = {row["module"]: row for row in json.loads(result.stdout)}
    assert set(rows["probe"]) >= SHOW_KEYS
    expected = oracle_counts(values, FORMATS[name], log2_scale)
    probe = rows["probe"]
    assert {k: probe[k] for k in expected} == expected
    nonzero = expected["nonzero"]
    assert probe["underflow_fraction"] == expected["underflow"] / nonzero


def test_recommend_json_by_hand(cli, known_report: Path) -> None:
    rec = json.loads(cli("recommend", known_report, "--format", "fp16", "--json").stdout)
    assert set(rec) >= RECOMMEND_KEYS
    # amax of VALUES is the float just above 65520 = 65520.0039...; limit 65504 / 2**4 = 4094:
    # 65520.004 * 2**-4 = 4095.0002 > 4094, * 2**-5 = 2047.5 <= 4094 -> 2**-5.
    assert rec["log2_scale"] == -5 and rec["scale"] == 2.0**-5
    assert rec["limiting_module"] == "probe" and rec["limiting_op"] == "aten.mul.Tensor"
    fp8 = json.loads(cli("recommend", known_report, "--format", "fp8_e4m3fn", "--headroom-bits", "0",
                         "--json").stdout)  # fmt: skip
    # 448 / 65520.004: 2**-7 gives 511.9 > 448, 2**-8 gives 255.9 -> 2**-8.
    assert fp8["log2_scale"] == -8


def test_gate_agrees_with_hand_arithmetic(cli, known_report: Path) -> None:
    values = runpy.run_path(str(MODELS / "known_grads.py"))["VALUES"]
    # At S = 2**-5 nothing overflows (65520.004 * 2**-5 = 2047.5), so only underflow decides.
    counts = oracle_counts(values, FORMATS["fp16"], -5)
    assert counts["overflow"] == 0
    fraction = counts["underflow"] / counts["nonzero"]
    passing = cli("gate", known_report, "--max-underflow", fraction, "--scale", "2^-5", "--json")
    assert passing.code == 0, passing.stdout
    assert json.loads(passing.stdout)["underflow_fraction"] == fraction
    failing = cli("gate", known_report, "--max-underflow", fraction * 0.99, "--scale", "2^-5")
    assert failing.code == 1 and failing.stdout.startswith("FAIL")
    # At S = 1 the values at and above 65520 overflow fp16: the gate fails whatever the limit.
    overflowing = cli("gate", known_report, "--max-underflow", "1", "--scale", "1", "--json")
    assert (
        overflowing.code == 1
        and json.loads(overflowing.stdout)["overflow"]
        == oracle_counts(values, FORMATS["fp16"], 0)["overflow"]
    )


def test_scan_prints_a_summary(cli, tmp_path: Path) -> None:
    result = cli("scan", SAMPLES / "mlp.py", "--steps", "2", "--out", tmp_path / "r")
    assert result.code == 0, result.stderr
    assert "Recommended static loss scale for fp16" in result.stdout
    assert "modules losing the most to underflow at S = 1" in result.stdout
    assert (tmp_path / "r" / "meta.json").is_file()


def test_show_table_and_options(cli, mlp_report: Path) -> None:
    table = cli("show", mlp_report)
    assert table.code == 0 and "fp16 at S = 2^0" in table.stdout
    top = json.loads(cli("show", mlp_report, "--top", "2", "--json").stdout)
    assert len(top) == 2
    assert top[0]["underflow_fraction"] >= top[1]["underflow_fraction"]
    grads = json.loads(cli("show", mlp_report, "--kind", "grad", "--json").stdout)
    assert "<loss>" not in {row["module"] for row in grads}
    ops = json.loads(cli("show", mlp_report, "--by", "op", "--json").stdout)
    assert {"module", "node", "op"} <= set(ops[0])
    recommended = cli("show", mlp_report, "--scale", "recommended")
    assert "(recommended)" in recommended.stdout


def test_reading_commands_default_to_the_scanned_format(cli, mlp_report: Path) -> None:
    assert json.loads(cli("recommend", mlp_report, "--json").stdout)["format"] == "fp16"
    assert (
        json.loads(cli("recommend", mlp_report, "--format", "bf16", "--json").stdout)["format"]
        == "bf16"
    )


def test_config_file_sets_options(cli, mlp_report: Path, tmp_path: Path) -> None:
    config = tmp_path / "gate.toml"
    config.write_text(
        'format = "bf16"\n[gate]\nmax_underflow = 1.0\nper-module = true\njson = true\n'
    )
    result = cli("gate", mlp_report, "--config", config)
    assert result.code == 0
    data = json.loads(result.stdout)
    assert data["format"] == "bf16" and data["per_module"] is True
    # The command line wins over the file.
    assert (
        json.loads(cli("gate", mlp_report, "--config", config, "--format", "fp16").stdout)["format"]
        == "fp16"
    )


# -- bad input: one line, exit 2, never a traceback ----------------------------------------
def _model(tmp_path: Path, text: str, name: str = "model.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


GOOD = """
import torch
model = torch.nn.Linear(2, 1)
batches = [torch.ones(3, 2)]
def loss(model, batch):
    return model(batch).sum()
"""


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("import torch\ndef broken(:\n", r"model\.py:2: syntax error"),
        ("import torch\nraise ValueError('no data here')\n", r"model\.py:2: importing the model file raised ValueError: no data here"),
        ("import torch\nbatches = []\ndef loss(m, b): return b\n", r"does not define `model`; expected: model = MyModel\(\)"),
        ("import torch\nmodel = torch.nn.Linear(2, 1)\ndef loss(m, b): return b\n", r"does not define `batches`"),
        ("import torch\nmodel = torch.nn.Linear(2, 1)\nbatches = [1]\n", r"does not define `loss`; expected: def loss\(model, batch\)"),
        ("import torch\nmodel = 3\nbatches = []\ndef loss(m, b): return b\n", r"`model` is an int; expected"),
        (GOOD.replace("batches = [torch.ones(3, 2)]", "batches = []"), r"`batches` yielded no batches"),
        (GOOD.replace("batches = [torch.ones(3, 2)]", "batches = 5"), r"`batches` is an int"),
        (GOOD.replace("return model(batch).sum()", "return model(batch)"), r"returned a tensor of shape \[3, 1\]; expected a scalar"),
        (GOOD.replace("return model(batch).sum()", "return 1.0"), r"returned a float; expected a scalar tensor"),
        (GOOD.replace("return model(batch).sum()", "raise KeyError('label')"), r"model\.py:6: loss\(model, batch\) raised KeyError: 'label'"),
        (GOOD.replace("return model(batch).sum()", "return model(batch).sum().detach()"), r"the loss does not require grad"),
        (GOOD.replace("torch.nn.Linear(2, 1)", "torch.nn.Linear(2, 1).requires_grad_(False)"), r"no parameters that require grad"),
        (GOOD + "optimizer = 3\n", r"`optimizer` is an int"),
        (GOOD + "def optimizer(params):\n    return 3\n", r"optimizer\(params\) returned an int"),
    ],
)  # fmt: skip
def test_bad_model_files(cli, tmp_path: Path, source: str, message: str) -> None:
    path = _model(tmp_path, source)
    line = one_error_line(cli("scan", path, "--steps", "1", "--out", tmp_path / "r"))
    assert str(path) in line or "model.py" in line
    import re

    assert re.search(message, line), line
    assert not (tmp_path / "r").exists()  # no partial report


def test_missing_and_unreadable_model_file(cli, tmp_path: Path) -> None:
    assert "does not exist" in one_error_line(cli("scan", tmp_path / "nope.py"))
    assert "is not a file" in one_error_line(cli("scan", tmp_path))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--headroom-bits", "-1"], "--headroom-bits must be between 0 and 64"),
        (["--format", "fp9"], "unknown format 'fp9'; known: fp16, bf16, fp8_e4m3fn, fp8_e5m2"),
        (
            ["--loss-scale", "1000"],
            "is not a power of two; the nearest are 512 (2^9) and 1024 (2^10)",
        ),
        (["--loss-scale", "nan"], "--loss-scale must be a positive number, got nan"),
        (["--loss-scale", "-4"], "--loss-scale must be a positive number, got -4"),
        (["--device", "tpu"], "invalid device 'tpu'"),
        (["--steps", "many"], "Invalid value"),
    ],
)
def test_bad_scan_flags(cli, tmp_path: Path, args: list[str], message: str) -> None:
    path = _model(tmp_path, GOOD)
    assert message in one_error_line(cli("scan", path, "--out", tmp_path / "r", *args))


def test_scan_refuses_to_overwrite(cli, tmp_path: Path) -> None:
    path = _model(tmp_path, GOOD)
    assert cli("scan", path, "--steps", "1", "--out", tmp_path / "r").code == 0
    assert "already exists; pass --force" in one_error_line(
        cli("scan", path, "--out", tmp_path / "r")
    )
    assert cli("scan", path, "--steps", "1", "--out", tmp_path / "r", "--force").code == 0


def test_cuda_requested_without_cuda(cli, tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    path = _model(tmp_path, GOOD)
    assert "CUDA is not available" in one_error_line(
        cli("scan", path, "--device", "cuda", "--out", tmp_path / "r")
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["show", "{report}", "--format", "fp9"], "unknown format 'fp9'"),
        (["show", "{report}", "--scale", "0"], "--scale must be a positive number, got 0"),
        (["show", "{report}", "--scale", "3"], "--scale 3 is not a power of two"),
        (["show", "{report}", "--scale", "nan"], "--scale must be a positive number, got nan"),
        (["show", "{report}", "--scale", "2^200"], "outside the range of an fp32 scale"),
        (["show", "{report}", "--scale", "lots"], "--scale 'lots' is not a number"),
        (["show", "{report}", "--kind", "weights"], "--kind must be backward, grad or forward"),
        (["show", "{report}", "--top", "0"], "--top must be at least 1"),
        (
            ["recommend", "{report}", "--headroom-bits", "-2"],
            "--headroom-bits must be between 0 and 64",
        ),
        (["gate", "{report}"], "gate needs --max-underflow"),
        (["gate", "{report}", "--max-underflow", "2"], "between 0 and 1"),
        (["gate", "{report}", "--max-underflow", "nan"], "between 0 and 1"),
        (["show", "{missing}"], "does not exist"),
        (["show"], "Missing argument"),
        (["show", "{report}", "--bogus"], "No such option: --bogus"),
    ],
)
def test_bad_reading_flags(
    cli, mlp_report: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    filled = [a.format(report=mlp_report, missing=tmp_path / "missing") for a in args]
    assert message in one_error_line(cli(*filled))


def test_corrupt_and_future_reports(cli, mlp_report: Path, tmp_path: Path) -> None:
    import shutil

    corrupt = tmp_path / "corrupt"
    shutil.copytree(mlp_report, corrupt)
    (corrupt / "records.parquet").write_bytes(b"PAR1 garbage")
    assert "records.parquet is corrupt" in one_error_line(
        cli("gate", corrupt, "--max-underflow", "0.1")
    )
    future = tmp_path / "future"
    shutil.copytree(mlp_report, future)
    meta = json.loads((future / "meta.json").read_text())
    meta["schema_version"] = 99
    (future / "meta.json").write_text(json.dumps(meta))
    assert "schema version 99 is newer" in one_error_line(cli("recommend", future))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("steps = [", "invalid TOML"),
        ("stepz = 3", "unknown key 'stepz'"),
        ("[scan]\nmax_underflow = 0.1", "unknown key 'max_underflow' in [scan]"),
        ("[scan]\nsteps = 'ten'", "[scan] steps must be an integer"),
        ("[scan]\nsteps = 0", "--steps must be at least 1"),
        ("headroom_bits = -3", "--headroom-bits must be between 0 and 64"),
    ],
)
def test_bad_config_files(cli, tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "c.toml"
    config.write_text(text)
    path = _model(tmp_path, GOOD)
    assert message in one_error_line(cli("scan", path, "--config", config, "--out", tmp_path / "r"))


def test_missing_config_file(cli, tmp_path: Path) -> None:
    path = _model(tmp_path, GOOD)
    assert "config file" in one_error_line(cli("scan", path, "--config", tmp_path / "none.toml"))


def test_debug_shows_the_traceback(cli, tmp_path: Path) -> None:
    path = _model(tmp_path, "raise ValueError('x')\n")
    result = cli("--debug", "scan", path, "--out", tmp_path / "r")
    assert result.code == 2 and "Traceback" in result.stderr


def test_non_finite_loss_is_reported_as_a_forward_problem(cli, tmp_path: Path) -> None:
    source = GOOD.replace("return model(batch).sum()", "return model(batch).sum() * float('nan')")
    path = _model(tmp_path, source)
    result = cli("scan", path, "--steps", "2", "--out", tmp_path / "r")
    assert result.code == 0, result.stderr
    assert "non-finite loss" in result.stdout
    show = json.loads(cli("show", tmp_path / "r", "--json").stdout)
    assert all(row["overflow"] == 0 and row["nonfinite"] == 0 for row in show)


def test_scan_every_and_selection(cli, tmp_path: Path) -> None:
    import pandas as pd

    out = tmp_path / "r"
    result = cli("scan", SAMPLES / "mlp.py", "--steps", "7", "--every", "3", "--out", out,
                 "--exclude-module", "<loss>", "--op", "aten.mm.*")  # fmt: skip
    assert result.code == 0, result.stderr
    assert "Scanned 7 step(s), captured 3" in result.stdout
    steps = pd.read_parquet(out / "steps.parquet")
    assert list(steps["step"]) == [0, 3, 6] and steps["optimizer_step"].all()
    records = pd.read_parquet(out / "records.parquet")
    backward = records[records["kind"] == "backward"]
    assert set(backward["op"]) == {"aten.mm.default"} and "<loss>" not in set(records["module"])
    meta = json.loads((out / "meta.json").read_text())
    assert meta["every"] == 3 and meta["steps_run"] == 7
    assert meta["selection"] == {"exclude_modules": ["<loss>"], "ops": ["aten.mm.*"]}


def test_every_and_patterns_from_config(cli, tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[scan]\nevery = 2\nmodule = "0"\nexclude-op = ["aten.sum.*"]\n')
    out = tmp_path / "r"
    assert (
        cli("scan", SAMPLES / "mlp.py", "--steps", "3", "--config", config, "--out", out).code == 0
    )
    meta = json.loads((out / "meta.json").read_text())
    assert meta["every"] == 2 and meta["selection"] == {
        "modules": ["0"],
        "exclude_ops": ["aten.sum.*"],
    }
    assert "--every must be at least 1" in one_error_line(
        cli("scan", SAMPLES / "mlp.py", "--every", "0", "--out", out)
    )


def test_a_multi_format_scan_says_scanned_once_then_each_format(cli, tmp_path: Path) -> None:
    out = tmp_path / "r"
    result = cli("scan", SAMPLES / "quadratic.py", "--steps", "2", "--out", out,
                 "--format", "fp16", "--format", "bf16")  # fmt: skip
    assert result.code == 0, result.stderr
    assert result.stdout.count("Scanned 2 step(s); report written to") == 1
    assert result.stdout.index("Scanned") < result.stdout.index("for fp16")
    assert "for fp16" in result.stdout and "for bf16" in result.stdout
