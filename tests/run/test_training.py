"""fpaudit run: a real training script, its scaler's trajectory, and the misuse it makes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fpaudit.report.store import Report
from fpaudit.run.training import RunOptions, run_script, skip_statistics

from ..conftest import ROOT, default_signals, one_error_line

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
AMP = SCRIPTS / "train_amp.py"
MISUSE = SCRIPTS / "train_misuse.py"


def mark(script: Path, name: str) -> int:
    """The line number of ``# mark: name`` in ``script``."""
    for number, line in enumerate(script.read_text().splitlines(), start=1):
        if re.search(rf"# mark: {re.escape(name)}\b", line):
            return number
    raise AssertionError(f"no mark {name!r} in {script}")


def findings(report: Report) -> dict[str, dict]:
    return {f["code"]: f for f in report.meta["findings"]}


@pytest.fixture(scope="module")
def amp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Report, list[dict], str]:
    """train_amp.py through the CLI: overflows at steps 3 and 7, clipping before unscale_."""
    from fpaudit.cli.commands import run

    tmp = tmp_path_factory.mktemp("amp")
    trace, out = tmp / "trace.json", tmp / "report"
    code = run(["run", "--out", str(out), "--capture-every", "4", "--", str(AMP),
                "--steps", "12", "--trace", str(trace)])  # fmt: skip
    assert code == 0
    return Report.read(out), json.loads(trace.read_text()), str(out)


def test_the_report_shows_exactly_the_skipped_steps_and_the_real_scale_trajectory(
    amp_run: tuple[Report, list[dict], str],
) -> None:
    report, trace, _ = amp_run
    steps = report.steps
    assert list(steps["step"]) == list(range(12))
    # What the script's own GradScaler said, step by step (get_scale() before step, after update).
    assert list(steps["loss_scale"]) == [t["scale"] for t in trace]
    assert list(steps["scale_after"]) == [t["scale_after"] for t in trace]
    assert list(np.flatnonzero(steps["skipped"])) == [3, 7]
    assert not steps.loc[steps["skipped"], "optimizer_step"].any()
    assert steps.loc[~steps["skipped"], "optimizer_step"].all()
    # init 2^10, growth every 4 clean steps: 0-2 clean, 3 overflows (x0.5), 4-6 clean, 7 overflows,
    # 8-11 are 4 clean steps: the scale doubles after step 11.
    assert list(steps["loss_scale"]) == [1024.0] * 4 + [512.0] * 4 + [256.0] * 4
    assert steps["scale_after"].iloc[-1] == 512.0
    assert list(steps["loss"]) == pytest.approx([t["loss"] for t in trace], rel=1e-6)
    assert (steps["backward_calls"] == 1).all()
    assert list(np.flatnonzero(steps["captured"])) == [0, 4, 8]
    assert set(report.records["step"]) == {0, 4, 8}
    # clip_grad_norm_ ran on scaled gradients: its norm divided by the scale is the unscaled one.
    clean = ~steps["skipped"]
    expected = np.array([t["norm"] for t in trace]) / steps["loss_scale"].to_numpy()
    assert np.array_equal(steps.loc[clean, "grad_norm"], expected[clean.to_numpy()])
    assert report.meta["scaler"]["growth_interval"] == 4
    assert report.meta["training"]["skipped"] == 2


def test_each_misuse_finding_names_the_right_line(amp_run: tuple[Report, list[dict], str]) -> None:
    report, _, _ = amp_run
    found = findings(report)
    assert set(found) == {"clip-before-unscale", "scheduler-on-skipped-step"}
    clip = found["clip-before-unscale"]
    assert (clip["file"], clip["line"]) == (str(AMP), mark(AMP, "clip"))
    assert clip["count"] == 12 and clip["severity"] == "error"
    scheduler = found["scheduler-on-skipped-step"]
    assert (scheduler["file"], scheduler["line"]) == (str(AMP), mark(AMP, "scheduler"))
    assert scheduler["steps"] == [3, 7] and scheduler["count"] == 2


def test_the_summary_tells_calibration_skips_findings_and_drift(cli, tmp_path: Path) -> None:
    result = cli("run", "--out", tmp_path / "r", "--capture-every", "1", "--", AMP,
                 "--steps", "10", "--overflow-at", "0", "1", "--unscale-first")  # fmt: skip
    assert result.code == 0, result.stderr
    out = result.stdout
    assert "10 optimizer step(s), 10 captured" in out
    assert "Skipped 2 of 10 step(s)" in out
    assert "The first 2 skip(s) were calibration" in out
    # the scheduler steps on the 2 skips, but they are calibration (the scaler's design,
    # the PyTorch AMP recipe does the same): not a finding (issue 24)
    assert "No misuse found in the training loop." in out
    assert f"{AMP}:{mark(AMP, 'scheduler')}" not in out
    assert "clip-before-unscale" not in out
    assert "Recommended static loss scale for fp16" in out
    assert "Drift (fp16)" in out


def test_max_steps_stops_the_script_cleanly_after_n_steps(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    outcome = run_script(AMP, ["--steps", "30", "--trace", str(trace)], RunOptions(max_steps=5))
    assert outcome.failure is None and outcome.interrupted is None
    report = outcome.report
    assert list(report.steps["step"]) == [0, 1, 2, 3, 4]
    assert report.meta["complete"] is True and report.meta["stopped_by"] == "max-steps"
    assert len(json.loads(trace.read_text())) == 5  # the script really did 5 steps, no more
    assert report.meta["steps_run"] == 5 and report.meta["steps_requested"] == 5


def test_the_correct_loop_has_no_findings_and_unscaled_norms(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    outcome = run_script(AMP, ["--unscale-first", "--trace", str(trace), "--overflow-at"],
                         RunOptions(capture_every=0))  # fmt: skip
    assert outcome.findings == []
    steps = outcome.report.steps
    assert list(steps["grad_norm"]) == [t["norm"] for t in json.loads(trace.read_text())]
    assert not steps["skipped"].any() and not steps["captured"].any()
    assert outcome.report.records.empty
    # unscaled gradients: grad_amax is at most the total 2-norm
    assert (steps["grad_amax"] <= steps["grad_norm"] + 1e-6).all()


@pytest.mark.parametrize(
    ("bug", "code", "line"),
    [
        ("unscale-twice", "unscale-twice", "unscale-again"),
        ("mixed-scale", "mixed-scale-accumulation", "mixed-backward"),
        ("grad-read", "grad-read-while-scaled", "grad-read"),
        ("no-unscale", "step-without-unscale", "no-unscale"),
        ("nan", "scale-falling", "update"),
        ("nan", "high-skip-rate", "update"),
    ],
)
def test_misuse_findings(bug: str, code: str, line: str) -> None:
    outcome = run_script(MISUSE, ["--bug", bug], RunOptions(capture_every=0))
    found = {f.code: f for f in outcome.findings}
    assert code in found, [f.code for f in outcome.findings]
    assert (found[code].file, found[code].line) == (str(MISUSE), mark(MISUSE, line))


def test_mixed_scale_names_the_scales_and_the_update_between_them() -> None:
    outcome = run_script(MISUSE, ["--bug", "mixed-scale"], RunOptions(capture_every=0))
    mixed = next(f for f in outcome.findings if f.code == "mixed-scale-accumulation")
    # step 2 overflows at 2^8 (loss x 1e38): the update halves the scale; step 3, in the same
    # accumulated batch (zero_grad every 2 steps), is scaled by 2^7.
    assert mixed.steps == (3,)
    assert "scaled by 2^7 was accumulated onto gradients scaled by 2^8" in mixed.message
    assert f"{MISUSE}:{mark(MISUSE, 'mixed-update')}" in mixed.message


def test_the_correct_misuse_script_loop_is_clean() -> None:
    outcome = run_script(MISUSE, ["--bug", "none"], RunOptions(capture_every=3))
    assert outcome.findings == []
    assert list(outcome.report.steps["captured"]) == [True, False, False] * 2 + [True, False]


def test_a_falling_scale_is_judged_from_the_trajectory() -> None:
    outcome = run_script(MISUSE, ["--bug", "nan"], RunOptions(capture_every=0, max_backoffs=8))
    steps = outcome.report.steps
    # every loss is NaN: 8 back-offs from 2^8 to 2^0 -- exactly 8, not more than --max-backoffs 8
    assert list(steps["scale_after"]) == [2.0**k for k in range(7, -1, -1)]
    assert "scale-falling" not in {f.code for f in outcome.findings}
    assert "high-skip-rate" in {f.code for f in outcome.findings}


def test_skip_statistics_separate_calibration() -> None:
    stats = skip_statistics(np.array([1, 1, 1, 0, 0, 1, 0, 0, 0, 0], dtype=bool))
    assert stats.calibration_steps == 3
    assert stats.skipped_after_calibration == 1 and stats.steps_after_calibration == 7
    never = skip_statistics(np.ones(4, dtype=bool))  # never found a working scale
    assert never.calibration_steps == 0 and never.skipped_after_calibration == 4


def test_a_script_that_raises_keeps_its_steps_and_says_where(cli, tmp_path: Path) -> None:
    out = tmp_path / "r"
    result = cli("run", "--out", out, "--", MISUSE, "--bug", "raise")
    line = one_error_line(result)
    assert f"{MISUSE}:{mark(MISUSE, 'raise')}: the script raised ValueError" in line
    report = Report.read(out)
    assert report.meta["complete"] is False and report.meta["stopped_by"] == "script error"
    assert list(report.steps["step"]) == [0, 1]


def test_a_script_that_exits_nonzero_keeps_its_steps_and_its_status(cli, tmp_path: Path) -> None:
    out = tmp_path / "r"
    result = cli("run", "--out", out, "--", MISUSE, "--bug", "exit")
    assert result.code == 3 and result.stderr == "", result  # as `python script` exits
    report = Report.read(out)
    assert len(report.steps) == 2
    assert report.meta["complete"] is False and report.meta["stopped_by"] == "script exit"


def test_a_script_that_exits_before_a_step_says_so_with_its_status(cli, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import sys\nsys.exit('no data')\n")
    result = cli("run", "--out", tmp_path / "r", "--", script)
    assert result.code == 1  # sys.exit("text"): Python prints it and exits 1
    assert result.stderr.splitlines() == [
        f"fpaudit: error: {script} exited before an optimizer step: nothing to audit",
        "no data",
    ]
    assert not (tmp_path / "r").exists()


def test_the_script_sees_its_own_argv_and_main(tmp_path: Path) -> None:
    script = tmp_path / "echo.py"
    script.write_text(
        "import sys, json\n"
        "if __name__ == '__main__':\n"
        "    json.dump({'argv': sys.argv, 'path0': sys.path[0]}, open(sys.argv[1], 'w'))\n"
    )
    seen = tmp_path / "seen.json"
    argv_before = list(sys.argv)
    run_script(script, [str(seen), "--flag", "x"], RunOptions())
    data = json.loads(seen.read_text())
    assert data["argv"] == [str(script), str(seen), "--flag", "x"]
    assert data["path0"] == str(tmp_path.resolve())
    assert sys.argv == argv_before


def test_patches_are_removed_after_the_run() -> None:
    originals = (torch.autograd.backward, torch.amp.GradScaler.step, torch.nn.utils.clip_grad_norm_,
                 torch.optim.Optimizer.zero_grad, torch.optim.lr_scheduler.StepLR.step)  # fmt: skip
    run_script(MISUSE, ["--bug", "raise"], RunOptions())
    after = (torch.autograd.backward, torch.amp.GradScaler.step, torch.nn.utils.clip_grad_norm_,
             torch.optim.Optimizer.zero_grad, torch.optim.lr_scheduler.StepLR.step)  # fmt: skip
    assert after == originals
    assert "grad" not in vars(torch.Tensor)  # the .grad watch is gone


def test_no_host_sync_beyond_gradscalers_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """GradScaler.step reads found_inf with .item() once per step; fpaudit adds no read
    until the run ends, then one transfer (numpy()) per device."""
    counts = {"item": 0, "numpy": 0, "float": 0, "bool": 0}
    for name, attr in (("item", "item"), ("numpy", "numpy"), ("float", "__float__"),
                       ("bool", "__bool__")):  # fmt: skip
        original = getattr(torch.Tensor, attr)

        def counted(self, *a, _o=original, _n=name, **k):  # type: ignore[no-untyped-def]
            counts[_n] += 1
            return _o(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, attr, counted)
    outcome = run_script(MISUSE, ["--bug", "none", "--steps", "8"], RunOptions(capture_every=0))
    assert len(outcome.report.steps) == 8
    assert counts == {"item": 8, "numpy": 1, "float": 0, "bool": 0}


def test_interrupting_a_run_keeps_the_steps_done(tmp_path: Path) -> None:
    marker, out = tmp_path / "ready", tmp_path / "report"
    process = subprocess.Popen(
        [sys.executable, "-m", "fpaudit", "run", "--out", str(out), "--", str(AMP),
         "--hang-at", "3", "--marker", str(marker)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ}, preexec_fn=default_signals,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert "interrupted by SIGINT after 3 step(s)" in stderr
    report = Report.read(out)
    assert list(report.steps["step"]) == [0, 1, 2]
    assert report.meta["complete"] is False and report.meta["stopped_by"] == "SIGINT"


def test_show_steps_renders_the_table_skip_rate_and_findings(
    cli, amp_run: tuple[Report, list[dict], str]
) -> None:
    _, _, out = amp_run
    result = cli("show", out, "--steps", "--limit", "4")
    assert result.code == 0, result.stderr
    assert "Skipped 2 of 12 step(s)" in result.stdout
    assert "Loss scale: 2^10 at the start, 2^9 at the end" in result.stdout
    assert "clip-before-unscale" in result.stdout and "…" in result.stdout
    data = json.loads(cli("show", out, "--steps", "--json").stdout)
    assert [s["skipped"] for s in data["steps"]].count(True) == 2
    assert {f["code"] for f in data["findings"]} == {
        "clip-before-unscale",
        "scheduler-on-skipped-step",
    }


def test_the_deprecated_cuda_alias_is_instrumented_through_its_base_class() -> None:
    from fpaudit.run.training import TrainingMonitor

    originals = {
        name: vars(torch.amp.GradScaler)[name] for name in ("scale", "unscale_", "step", "update")
    }
    monitor = TrainingMonitor()
    with monitor.installed():
        # torch.cuda.amp.GradScaler subclasses torch.amp.GradScaler without overriding these
        for name, original in originals.items():
            patched = getattr(torch.cuda.amp.GradScaler, name)
            assert patched is getattr(torch.amp.GradScaler, name)
            assert patched is not original and patched.__wrapped__ is original
    assert all(vars(torch.amp.GradScaler)[n] is o for n, o in originals.items())


def test_a_long_scan_reports_drift(cli, tmp_path: Path) -> None:
    from ..conftest import SAMPLES

    result = cli("scan", SAMPLES / "quadratic.py", "--steps", "20", "--out", tmp_path / "r")
    assert result.code == 0, result.stderr
    assert "Drift (fp16): per-window recommendations (windows of 2 steps)" in result.stdout


def test_a_scale_that_is_not_a_power_of_two_is_kept_and_read_with_a_note(
    cli, tmp_path: Path
) -> None:
    trace, out = tmp_path / "trace.json", tmp_path / "report"
    done = cli("run", "--out", out, "--capture-every", "2", "--", AMP, "--steps", "6",
               "--overflow-at", "3", "--init-scale", "1000", "--trace", trace)  # fmt: skip
    assert done.code == 0, done.stderr
    note = "loss scale (500, 1000) is not a power of two"  # steps 0, 2 and 4: 1000, 1000, 500
    assert note in done.stderr
    report = Report.read(out)  # readable: nothing the run recorded is lost
    assert list(report.steps["loss_scale"]) == [t["scale"] for t in json.loads(trace.read_text())]
    assert report.inexact_scales() == [500.0, 1000.0]
    shown = cli("show", out, "--json")
    assert shown.code == 0 and note in shown.stderr
    assert json.loads(shown.stdout)  # the numbers still come, after the note


# -- loops as people write them: no torch.optim, LBFGS, clipping by value, __file__ ----
_MANUAL_SGD = """
import json, sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
oracle = []
for step in range(4):
    if {zero_grad}:
        model.zero_grad()
    loss = model(torch.randn(6, 4)).pow(2).mean()
    loss.backward()
    # the oracle: what the script itself sees (no fpaudit code), before its own update
    amax = max(p.grad.abs().max() for p in model.parameters())
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    oracle.append({{"loss": loss.item(), "amax": amax.item(), "hooks": hooks}})
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-0.1)
        if not {zero_grad}:
            p.grad = None  # by hand, as some loops drop their gradients
json.dump(oracle, open(sys.argv[1], "w"))
"""


@pytest.mark.parametrize("zero_grad", [True, False])
def test_a_loop_without_torch_optim_gets_one_step_per_update(
    tmp_path: Path, zero_grad: bool
) -> None:
    # p.data.add_(p.grad, alpha=-lr) after backward, no optimizer (word_language_model's
    # default update): a step ends at the next zero_grad, or at the next forward once the
    # gradients were set to None, and the last one when the script ends
    script, oracle_file = tmp_path / "train.py", tmp_path / "oracle.json"
    script.write_text(_MANUAL_SGD.format(zero_grad=zero_grad))
    outcome = run_script(script, [str(oracle_file)], RunOptions(capture_every=2))
    assert outcome.failure is None and outcome.exit_status == 0
    oracle = json.loads(oracle_file.read_text())
    steps = outcome.report.steps
    assert list(steps["step"]) == [0, 1, 2, 3]
    assert outcome.report.meta["optimizers"] == []
    # each step's loss and largest |grad| are the script's own, exactly (float32 values)
    assert list(steps["loss"]) == [o["loss"] for o in oracle]
    assert list(steps["grad_amax"]) == [o["amax"] for o in oracle]
    assert list(steps["captured"]) == [True, False, True, False]  # every 2nd step
    assert list(steps["optimizer_step"]) == [True] * 4  # the script's own update
    # no hook of fpaudit's on the model, even inside a captured step
    assert [o["hooks"] for o in oracle] == [0, 0, 0, 0]


def test_an_lbfgs_step_is_its_closures_and_its_loss_is_the_first(tmp_path: Path) -> None:
    script, oracle_file = tmp_path / "train.py", tmp_path / "oracle.json"
    script.write_text(
        "import json, sys\n"
        "import torch\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Linear(5, 1)\n"
        "x, y = torch.randn(16, 5), torch.randn(16, 1)\n"
        "optimizer = torch.optim.LBFGS(model.parameters(), max_iter=4)\n"
        "closures, oracle = [], []\n"
        "def closure():\n"
        "    optimizer.zero_grad()\n"
        "    loss = torch.nn.functional.mse_loss(model(x), y)\n"
        "    loss.backward()\n"
        "    closures.append(loss.item())\n"
        "    return loss\n"
        "for step in range(3):\n"
        "    closures.clear()\n"
        "    loss = optimizer.step(closure)\n"
        "    amax = max(p.grad.abs().max() for p in model.parameters())\n"
        "    oracle.append({'loss': loss.item(), 'closures': list(closures),\n"
        "                   'amax': amax.item()})\n"
        "json.dump(oracle, open(sys.argv[1], 'w'))\n"
    )
    outcome = run_script(script, [str(oracle_file)], RunOptions(capture_every=1))
    oracle = json.loads(oracle_file.read_text())
    steps = outcome.report.steps
    assert len(steps) == 3 and all(steps["captured"])
    assert all(len(o["closures"]) > 1 for o in oracle)  # several closures per step
    # LBFGS.step returns its first closure's loss: the step's loss, not their sum
    assert list(steps["loss"]) == [o["closures"][0] for o in oracle] == [o["loss"] for o in oracle]
    assert list(steps["backward_calls"]) == [len(o["closures"]) for o in oracle]
    # the gradients of the last closure, as the script reads them after the step
    assert list(steps["grad_amax"]) == [o["amax"] for o in oracle]


def test_clipping_by_value_is_recorded_per_step(tmp_path: Path, cli) -> None:
    script, oracle_file = tmp_path / "train.py", tmp_path / "oracle.json"
    script.write_text(
        "import json, sys\n"
        "import torch\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "oracle = []\n"
        "for step in range(3):\n"
        "    optimizer.zero_grad()\n"
        "    model(torch.randn(5, 4) * (step + 1)).pow(2).mean().backward()\n"
        "    grads = [p.grad for p in model.parameters()]\n"
        "    # the oracle: elements above the clip value, counted by the script itself\n"
        "    over = sum(int((g.abs() > 0.05).sum()) for g in grads)\n"
        "    fraction = over / sum(g.numel() for g in grads)\n"
        "    torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=0.05)\n"
        "    oracle.append([fraction, max(g.abs().max() for g in grads).item()])\n"
        "    optimizer.step()\n"
        "json.dump(oracle, open(sys.argv[1], 'w'))\n"
    )
    out = tmp_path / "report"
    result = cli("run", "--out", out, "--", script, oracle_file)
    assert result.code == 0, result.stderr
    oracle, amax = zip(*json.loads(oracle_file.read_text()), strict=True)
    steps = Report.read(out).steps
    assert min(oracle) > 0 and max(oracle) < 1  # some elements clamped, not all
    # the largest gradient as the optimizer saw it: clipped, on the first step too
    assert list(steps["grad_amax"]) == list(amax) == [float(torch.tensor(0.05))] * 3  # fp32
    assert list(steps["clip_value"]) == [0.05] * 3
    assert list(steps["clipped_fraction"]) == list(oracle)  # exact: the same count / elements
    assert list(steps["clipped"]) == [True] * 3
    assert steps["grad_norm"].isna().all()  # no clipping by norm
    shown = cli("show", out, "--steps")
    assert "clip value: clamped" in shown.stdout
    assert f"0.05: {100 * oracle[0]:.3g}%" in shown.stdout


def test_the_script_sees_what_python_gives_it(
    tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    # __file__ absolute as Python 3.9+ sets it for `python train.py`; argv[0] as typed;
    # no __spec__; the working directory unchanged
    (tmp_path / "train.py").write_text(
        "import json, os, sys, torch\n"
        "model = torch.nn.Linear(2, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "model(torch.ones(1, 2)).sum().backward(); opt.step()\n"
        "json.dump([__file__, sys.argv[0], repr(__spec__), os.getcwd(), sys.path[0]],\n"
        "          open('seen.json', 'w'))\n"
    )
    monkeypatch.chdir(tmp_path)
    result = cli("run", "--out", "r", "--", "train.py")
    assert result.code == 0, result.stderr
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == [str(tmp_path / "train.py"), "train.py", "None", str(tmp_path),
                    str(tmp_path.resolve())]  # fmt: skip
