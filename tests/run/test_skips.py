"""Every skipped step explained (issue 54): overflows injected by construction into a
GradScaler loop (CPU autocast fp16, tests/scripts/train_skips.py), each skip's origin
named exactly, the verdict, and no host sync added on clean steps."""

from __future__ import annotations

import json
import math
import runpy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fpaudit.numerics.formats import get_format
from fpaudit.report.store import Report
from fpaudit.rules.skips import report_skip_verdict
from fpaudit.run.skips import BackwardOrder
from fpaudit.run.training import RunOptions, run_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_skips.py"
FP16 = get_format("fp16")


def gradient_order(model: nn.Module, loss: torch.Tensor) -> list[str]:
    """The oracle: the order autograd really accumulated the gradients in (hooks on a
    throwaway model, never on one fpaudit watches)."""
    names = {id(p): n for n, p in model.named_parameters()}
    order: list[str] = []
    handles = [
        p.register_post_accumulate_grad_hook(lambda p: order.append(names[id(p)]))
        for p in model.parameters()
    ]
    loss.backward()
    for handle in handles:
        handle.remove()
    return order


def test_the_backward_order_is_the_order_autograd_accumulates_gradients_in() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.c(torch.relu(self.b(h)) + h)  # a residual: a's gradient waits for b's

    torch.manual_seed(0)
    model = Branchy()
    params = dict(model.named_parameters())
    loss = model(torch.randn(3, 4)).sum()
    learned = BackwardOrder()
    learned.learn(loss)
    order = [list(params)[i] for i in learned.sort(list(params.values()))]
    assert order == gradient_order(model, loss)
    assert order[0].startswith("c.")  # nearest the loss first


def run(tmp_path: Path, *args: str, **options: int) -> tuple[Report, dict[str, dict]]:
    probe = tmp_path / "probe.json"
    outcome = run_script(SCRIPT, [*args, "--probe", str(probe)], RunOptions(**options))
    assert outcome.failure is None
    return outcome.report, json.loads(probe.read_text()) if probe.exists() else {}


def test_each_skip_names_its_parameters_forward_or_backward_and_the_op(tmp_path: Path) -> None:
    # init scale 2^8; no growth in 12 steps. Injected: the boost multiplies its gradient
    # by 2^14 at steps 3 and 4 (backward: some of its products pass 65504, some not); a NaN in `poison`'s forward at 6 and 7; an inf
    # loss at 9. Every skip halves the scale: 3 at 2^8, 4 at 2^7, 6 at 2^6, 7 at 2^5, 9 at 2^4.
    report, probe = run(
        tmp_path, "--steps", "12", "--boost-at", "3", "14", "--boost-at", "4", "14",
        "--nan-at", "6", "7", "--inf-loss-at", "9", capture_every=0,
    )  # fmt: skip
    verdict = report_skip_verdict(report, FP16)
    assert verdict is not None
    skips = {skip.step: skip for skip in verdict.skips}
    assert list(skips) == [3, 4, 6, 7, 9]
    assert [skips[s].loss_scale for s in skips] == [2.0**8, 2.0**7, 2.0**6, 2.0**5, 2.0**4]
    twin_order = _twin_order()
    inner = [name for name in twin_order if name.startswith("inner.")]
    # backward at 3 and 4: only the parameters before the boost (inner) got inf
    for step in (3, 4):
        skip = skips[step]
        assert (skip.origin, skip.loss_finite) == ("backward", True)
        # the script's own check of its scaled gradients: which ones hold inf/NaN
        expected = probe["nonfinite"][str(step)]
        assert set(expected) <= set(inner)
        assert (skip.nonfinite_params, skip.params_checked) == (len(expected), 4)
        assert list(skip.params) == [name for name in inner if name in expected]
    # the op: the step after 3 (4) was captured and overflowed too; 4 is captured itself.
    # The script saw its boost's multiply make inf there (the oracle of "first").
    assert probe["boost_made_inf"]["4"]
    assert (skips[3].op_step, skips[4].op_step) == (4, 4)
    for step in (3, 4):
        skip = skips[step]
        assert (skip.op_phase, skip.op_module, skip.op) == ("backward", "boost", "aten.mul.Tensor")
        # torch's own largest finite value of that multiply at step 4, from the script
        largest = probe["amax"]["4"]
        assert 0 < largest <= 65504 and skip.op_amax == largest and skip.op_scale == 2.0**7
        assert skip.edge_binades == math.log2(largest / 65504.0)
    # forward at 6, 7 (NaN) and 9 (inf loss): every parameter's gradient is NaN
    for step in (6, 7, 9):
        skip = skips[step]
        assert (skip.origin, skip.loss_finite) == ("forward", False)
        assert (skip.nonfinite_params, skip.params_checked) == (4, 4)
        assert sorted(probe["nonfinite"][str(step)]) == sorted(twin_order)
        assert list(skip.params) == twin_order[:4]
    # 7 was captured after the skip at 6, with its forward: the poison's multiply
    for step in (6, 7):
        assert (skips[step].op_step, skips[step].op_phase) == (7, "forward")
        assert (skips[step].op_module, skips[step].op) == ("poison", "aten.mul.Tensor")
    assert skips[9].op == ""  # three captures after a skip were spent (4, 5, 7)
    assert list(report.steps.loc[report.steps["captured"], "step"]) == [4, 5, 7]
    assert verdict.verdict == "persistent"
    assert "the loss itself was inf or NaN in 3 skipped step(s), first at step 6" in verdict.reason
    assert "poison aten.mul.Tensor made it first in forward" in verdict.reason
    assert verdict.counts() == {"calibration": 0, "forward": 3, "backward": 2}


def _twin_order() -> list[str]:
    """The oracle of the order: a twin of the script's model (the same layers, under the
    same fp16 autocast), its gradients' order as autograd accumulated them."""

    class Twin(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.act, self.outer = nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.outer(self.act(self.inner(x)))

    model = Twin()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(torch.randn(4, 8)).float(), torch.randn(4, 1))
    return gradient_order(model, loss)


def test_a_one_off_overflow_is_a_range_skip_with_its_static_scale(tmp_path: Path) -> None:
    # the boost at step 3 only (2^12 at 2^8); the back-off to 2^7 clears it
    report, _ = run(tmp_path, "--steps", "8", "--boost-at", "3", "12", capture_every=0)
    verdict = report_skip_verdict(report, FP16)
    assert verdict is not None and verdict.verdict == "range"
    # the one skip was at 2^8: a static scale of 2^7 (floor(log2 256) - 1) avoids it
    assert verdict.static_log2_scale == 7
    assert [s.step for s in verdict.skips] == [3]


def test_gradients_that_outgrow_every_scale_are_persistent(tmp_path: Path) -> None:
    # from step 2 the boost is 2^(6 * step): 2^12 at 2, 2^18 at 3, ...; each skip halves
    # the scale and the gradient grows 64x a step: every step from 2 on overflows
    report, _ = run(tmp_path, "--steps", "14", "--grow", "6", capture_every=0)
    verdict = report_skip_verdict(report, FP16)
    assert verdict is not None and verdict.verdict == "persistent"
    assert [s.step for s in verdict.skips] == list(range(2, 14))
    # 12 back-offs in a row from 2^8: down to 2^-4, more than max_backoffs (5)
    assert "backed off 12 times in a row" in verdict.reason
    assert verdict.culprit == "boost aten.mul.Tensor"
    # the captures after a skip (steps 3, 4, 5) saw the boost overflow at 2^7, 2^6, 2^5
    assert verdict.culprit_min_scale == 2.0**5
    assert all(s.origin == "backward" for s in verdict.skips)


def test_the_issue_example_fails_the_gate(cli, tmp_path: Path) -> None:
    # the last 40 of 90 steps skipped with a NaN loss, the scale falling from 2^16 (issue 54)
    out = tmp_path / "r"
    nan = [str(step) for step in range(50, 90)]
    result = cli("run", "--out", out, "--", SCRIPT, "--steps", "90", "--init-scale",
                 str(2.0**16), "--nan-at", *nan)  # fmt: skip
    assert result.code == 0, result.stderr
    assert "Skip verdict: persistent: the loss itself was inf or NaN in 40 skipped step(s)" in (
        result.stdout
    )
    report = Report.read(out)
    steps = report.steps
    # two overflows of the model's own at 2^16 and 2^15 (steps 3 and 23: range skips),
    # then 40 NaN losses: 42 halvings from 2^16 end at 2^(16 - 42) = 2^-26
    assert list(steps.loc[steps["skipped"], "step"]) == [3, 23, *range(50, 90)]
    assert steps["scale_after"].iloc[-1] == 2.0**-26
    gate = cli("gate", out, "--max-underflow", "1", "--json")
    assert gate.code == 1
    failures = json.loads(gate.stdout)["failures"]
    assert [f["kinds"] for f in failures] == [["persistent-skips"]]
    assert "--allow-nonfinite" in failures[0]["reason"]
    shown = cli("show", out, "--skips", "--json")
    assert shown.code == 0
    data = json.loads(shown.stdout)
    assert data["verdict"] == "persistent"
    assert data["by_origin"] == {"calibration": 0, "forward": 40, "backward": 2}
    # the dashboards count them by origin, so far, at each captured step (default: every
    # 10th, and the 3 steps after the first skips past calibration: 4, 24, 51)
    from fpaudit.rules.metrics import step_metrics

    found = {m.step: m.values for m in step_metrics(report, "fp16", top=0)}
    assert sorted(found) == [0, 4, 10, 20, 24, 30, 40, 50, 51, 60, 70, 80]
    # at step 51: the skips at 3 and 23 (backward) and 50, 51 (forward); at 80: 31 forward
    assert [found[51][f"fpaudit/skips_{o}"] for o in ("calibration", "forward", "backward")] == [
        0.0, 2.0, 2.0,
    ]  # fmt: skip
    assert found[80]["fpaudit/skips_forward"] == 31.0 and found[80]["fpaudit/skipped_steps"] == 33.0


def test_no_host_sync_is_added_on_clean_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The script's own reads (.item() in its prints and get_scale()) plus GradScaler's
    one per step, the same under fpaudit run as without it; fpaudit reads its device
    values once at the end (one numpy())."""
    args = ["--steps", "8", "--boost-at", "3", "12"]
    counts = {"item": 0, "numpy": 0}
    for name in counts:
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _o=original, _n=name, **k):  # type: ignore[no-untyped-def]
            counts[_n] += 1
            return _o(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    plain = dict(counts)
    counts.update(item=0, numpy=0)
    options = RunOptions(capture_every=0, capture_after_skip=0)
    outcome = run_script(SCRIPT, args, options)
    assert list(outcome.report.skips["step"]) == [3]  # the flags were taken
    assert counts == {"item": plain["item"], "numpy": plain["numpy"] + 1}
