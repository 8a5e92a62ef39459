"""A verdict needs evidence, and names are data: each case of issue 12 through a real process.

Every case runs ``python -m fpaudit`` in a subprocess, as a CI job would, and
checks the exit code and the words the user sees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from fpaudit.kernels import histogram
from fpaudit.report.store import Report

from ..conftest import MODELS, ROOT

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def fpaudit(*args: object, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GITHUB_ACTIONS": "false"}
    return subprocess.run(
        [sys.executable, "-m", "fpaudit", *map(str, args)],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=600,
    )  # fmt: skip


def error_line(done: subprocess.CompletedProcess[str]) -> str:
    """The one error line of a command that failed with exit 2."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("fpaudit: error: ")]
    assert len(lines) == 1, done.stderr
    return lines[0]


def gate_fails(report: Path, *reasons: str, extra: tuple[str, ...] = ()) -> str:
    done = fpaudit("gate", report, "--max-underflow", "0.01", *extra)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout.startswith("FAIL: "), done.stdout
    for reason in reasons:
        assert reason in done.stdout, done.stdout
    return done.stdout


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


NAN_LOSS = """import torch
model = torch.nn.Linear(2, 1)
batches = [torch.ones(3, 2)] * 3
def loss(model, batch):
    return model(batch).sum() * float("nan")
"""

# sqrt'(0) is inf and the product with 0 makes NaN: the loss, 0, is finite, and every
# backward value of the Linear is inf or NaN.
NONFINITE_BACKWARD = """import torch
model = torch.nn.Linear(2, 2)
batches = [torch.ones(3, 2)]
def loss(model, batch):
    return torch.sqrt(model(batch) * 0).sum()
"""

NO_BACKWARD = """import torch
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    optimizer.zero_grad()
    loss = model(torch.ones(2, 4)).sum()  # never backpropagated
    optimizer.step()
"""

MARKUP_NAMES = """import torch
from torch import nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict(
            {"[/]": nn.Linear(4, 4), "$\\\\nocommand$": nn.Linear(4, 4), "[bold]x": nn.Linear(4, 1)}
        )

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x

model = Model
batches = [torch.ones(2, 4)]
def loss(model, x):
    return model(x).sum()
"""


def test_a_module_glob_typo_stops_the_scan_before_a_step(tmp_path: Path) -> None:
    done = fpaudit(
        "scan", MODELS / "tiny_grads.py", "--steps", "1", "--module", "linaer",
        "--out", tmp_path / "r",
    )  # fmt: skip
    assert error_line(done) == (
        "fpaudit: error: --module 'linaer' matches no module of the model (closest: linear)"
    )
    assert not (tmp_path / "r").exists()


def test_a_module_glob_typo_stops_run_as_a_usage_error(tmp_path: Path) -> None:
    """Found inside the script's first forward (a hook): still the user's error, exit 2,
    not fpaudit's internal error."""
    script = write(tmp_path / "train.py", NO_BACKWARD)
    done = fpaudit("run", "--module", "linaer", "--out", tmp_path / "r", "--", script)
    assert done.returncode == 2, done.stderr
    line = error_line(done)
    assert line.startswith("fpaudit: error: --module 'linaer' matches no module of the model")
    assert "internal error" not in done.stderr and "Traceback" not in done.stderr


def test_excluding_every_module_is_an_error(tmp_path: Path) -> None:
    done = fpaudit("scan", MODELS / "tiny_grads.py", "--steps", "1", "--exclude-module", "*",
                   "--out", tmp_path / "r")  # fmt: skip
    assert "the selection --exclude-module '*' leaves no module" in error_line(done)
    assert not (tmp_path / "r").exists()


def test_a_loss_that_is_nan_at_every_step_fails_the_gate(tmp_path: Path) -> None:
    model = write(tmp_path / "model.py", NAN_LOSS)
    assert fpaudit("scan", model, "--steps", "3", "--out", tmp_path / "r").returncode == 0
    gate_fails(
        tmp_path / "r",
        "measured nothing",
        # every one of the 3 steps, the first named
        "the loss or gradients are inf or NaN in 3 step(s) that no loss scaler skipped "
        "(first: step 0)",
    )
    # --allow-nonfinite judges the inf/NaN, but there is still nothing measured.
    gate_fails(tmp_path / "r", "measured nothing", extra=("--allow-nonfinite",))


def test_backward_values_that_are_all_nonfinite_fail_the_gate(tmp_path: Path) -> None:
    model = write(tmp_path / "model.py", NONFINITE_BACKWARD)
    assert fpaudit("scan", model, "--steps", "1", "--out", tmp_path / "r").returncode == 0
    report = Report.read(tmp_path / "r")
    records = report.records
    linear = records[(records["module"] == "") & (records["kind"] == "backward")]
    nonfinite = int(linear["infs"].sum() + linear["nans"].sum())
    assert nonfinite > 0 and int(linear["elements"].sum() - linear["zeros"].sum()) == nonfinite
    gate_fails(
        tmp_path / "r", "measured nothing", f"{nonfinite} backward value(s) in scope are inf or NaN"
    )


def test_the_readme_live_example_fails_on_lost_values(tmp_path: Path) -> None:
    """tiny_grads under fp16 autocast: every fp16 backward value is lost (README)."""
    out = tmp_path / "live"
    done = fpaudit("scan", MODELS / "tiny_grads.py", "--steps", "1", "--amp", "fp16",
                   "--shadow", "--out", out)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = Report.read(out)
    fp16 = report.records[report.records["dtype"] == "float16"]
    lost, shadow_nonzero = int(fp16["lost"].sum()), int(fp16["shadow_nonzero"].sum())
    assert lost == shadow_nonzero > 0  # all of them: the values sit below 2**-25
    stdout = gate_fails(out, f"the device lost 100% of its values at the run's loss scale "
                             f"({lost} of {shadow_nonzero} nonzero in the fp32 re-run)")  # fmt: skip
    junit = tmp_path / "j.xml"
    done = fpaudit("gate", out, "--max-underflow", "0.01", "--junit", junit)
    assert done.returncode == 1
    failures = list(ET.parse(junit).getroot().iter("failure"))
    assert [f.attrib["type"] for f in failures] == ["lost"]
    assert failures[0].attrib["message"] in stdout  # one verdict, read by both


def test_run_with_capture_every_0_measured_nothing(tmp_path: Path) -> None:
    out = tmp_path / "r"
    done = fpaudit("run", "--capture-every", "0", "--out", out, "--", SCRIPTS / "train_amp.py",
                   "--steps", "4")  # fmt: skip
    assert done.returncode == 0, done.stderr
    gate_fails(out, "measured nothing", "the report holds no records")


def test_a_script_without_backward_measured_nothing(tmp_path: Path) -> None:
    script = write(tmp_path / "train.py", NO_BACKWARD)
    out = tmp_path / "r"
    done = fpaudit("run", "--capture-every", "1", "--out", out, "--", script)
    assert done.returncode == 0, done.stderr
    gate_fails(out, "measured nothing")


def test_a_run_whose_scaler_skipped_overflowing_steps_still_passes(tmp_path: Path) -> None:
    """GradScaler skipping the steps it overflowed on (train_amp.py: steps 3 and 7) is
    the scaler working, not a broken run: those steps' inf values are excused."""
    out = tmp_path / "r"
    done = fpaudit("run", "--capture-every", "1", "--out", out, "--", SCRIPTS / "train_amp.py")
    assert done.returncode == 0, done.stderr
    report = Report.read(out)
    skipped = set(report.steps.loc[report.steps["skipped"], "step"])
    assert skipped == {3, 7}
    bad = report.records[(report.records["infs"] + report.records["nans"]) > 0]
    assert set(bad["step"]) <= skipped and len(bad)  # inf/NaN only where the scaler skipped
    # train_amp.py clips before unscale_ (an error finding): the gate fails on that alone,
    # naming it (issue 24); --allow-errors judges the values, whose skipped steps are excused
    gate = fpaudit("gate", out, "--max-underflow", "1", "--json")
    result = json.loads(gate.stdout)
    assert gate.returncode == 1 and result["nonfinite"] == 0, result
    (failure,) = result["failures"]
    assert failure["subject"] == "(findings)" and failure["kinds"] == ["error-finding"]
    assert failure["reason"].startswith("the run found an error: clip-before-unscale at ")
    assert "train_amp.py:" in failure["reason"]
    assert failure["reason"].endswith("pass --allow-errors to gate on the values alone")
    text = fpaudit("gate", out, "--max-underflow", "1")
    assert text.returncode == 1 and "the run found an error: clip-before-unscale" in text.stdout
    gate = fpaudit("gate", out, "--max-underflow", "1", "--json", "--allow-errors")
    result = json.loads(gate.stdout)
    assert result["nonfinite"] == 0 and result["failures"] == [], result
    assert gate.returncode == 0


def test_fp64_values_below_fp32_are_counted_not_silently_zero(tmp_path: Path) -> None:
    out = tmp_path / "r"
    done = fpaudit("scan", MODELS / "fp64_tiny.py", "--steps", "1", "--out", out)
    assert done.returncode == 0, done.stderr
    counted = Report.read(out).meta["out_of_range"]
    # At least the 16 + 4 parameter gradients, each below 1e-49 (see the model file).
    assert counted >= 20
    assert f"{counted} recorded fp64 value(s) lay outside fp32's range" in done.stderr
    stdout = gate_fails(out, "measured nothing")
    assert f"{counted} value(s) lay outside fp32's range" in stdout


def test_out_of_range_count_matches_a_torch_cast() -> None:
    values = torch.tensor(
        [1e-50, 1e-300, 0.0, -0.0, 1.0, 1e300, -1e300, float("inf"), float("nan"),
         2.0**-150, 0.75 * 2.0**-149, 2.0**-149],
        dtype=torch.float64,
    )  # fmt: skip
    narrowed = values.float()
    # Oracle: torch's own cast; nonzero finite values that it turns into 0 or inf.
    expected = int(
        (((values != 0) & (narrowed == 0)) | (values.isfinite() & narrowed.isinf())).sum()
    )
    # By hand: 1e-50, 1e-300, 2**-150 (a tie, to even: 0), 1e300, -1e300 -> 5
    assert expected == 5
    table = histogram.HistogramTable(torch.device("cpu"))
    row = table.new_row()
    table.add(row, values)
    table.add(row, values.float())  # fp32 values are in range by definition: not counted
    table.reset()  # the count is cumulative over steps
    assert int(table.out_of_range) == expected


def test_verify_needs_a_reference_gradient(tmp_path: Path) -> None:
    model = write(
        tmp_path / "model.py",
        "import torch\nmodel = torch.nn.Linear(2, 1)\nbatches = [torch.ones(3, 2)]\n"
        "def loss(model, batch):\n    return model(batch).sum() * 0\n",
    )
    done = fpaudit("verify", model, "--scale", "1")
    assert done.returncode == 1, done.stderr
    assert "FAIL: measured nothing: no fp32 reference gradient element is nonzero" in done.stdout
    assert "PASS" not in done.stdout


NAMES = ("layers.[/]", "layers.$\\nocommand$", "layers.[bold]x")


@pytest.fixture(scope="module")
def markup_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One scan of a model whose module names look like markup, into a path that does."""
    tmp = tmp_path_factory.mktemp("markup")
    model = write(tmp / "model.py", MARKUP_NAMES)
    out = tmp / "runs" / "[/]exp"
    scanned = fpaudit("scan", model, "--steps", "1", "--out", out)
    assert scanned.returncode == 0, scanned.stderr
    return out, scanned.stdout


def test_scan_prints_names_and_paths_as_data(markup_report: tuple[Path, str]) -> None:
    out, stdout = markup_report
    assert f"report written to {out}" in stdout
    for name in NAMES:  # the summary table lists every module
        assert name in stdout, stdout


@pytest.mark.parametrize("command", ["show", "gate", "plot"])
def test_readers_print_names_and_paths_as_data(
    markup_report: tuple[Path, str], tmp_path: Path, command: str
) -> None:
    out, _ = markup_report
    if command == "show":
        done = fpaudit("show", out)
        assert done.returncode == 0, done.stderr
        shown = done.stdout
    elif command == "gate":
        done = fpaudit("gate", out, "--max-underflow", "0", "--scale", "2^-40", "--per-module")
        assert done.returncode == 1, done.stderr
        shown = done.stdout
    else:
        image = tmp_path / "[bold]p.svg"
        done = fpaudit("plot", out, "-o", image)
        assert done.returncode == 0, done.stderr
        assert f"Wrote {image}" in done.stdout
        # SVG text stays text (svg.fonttype none): the labels, XML-escaped.
        svg = image.read_text()
        shown = svg.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
    for name in NAMES:
        assert name in shown, (name, shown[:2000])
