"""Issue 50: every headline and verdict says what the numbers under it say.

Each case is checked against an oracle that does not share fpaudit's code: torch's own
cast of the values at the scale (``(x * 2**k).to(dtype) == 0``), hand-derived arithmetic
in a comment, or a real backward.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fpaudit.numerics.formats import FORMATS
from fpaudit.rules import analysis, gating
from fpaudit.rules.comparison import compare
from fpaudit.rules.gating import gate
from fpaudit.rules.recommendation import recommend

from ..conftest import MODELS
from ..reports import report_from

FP16, BF16 = FORMATS["fp16"], FORMATS["bf16"]


def zeros_at(values: torch.Tensor, log2_scale: int, dtype: torch.dtype) -> int:
    """The oracle: nonzero values that torch's cast at ``2**log2_scale`` turns into zero."""
    scaled = values.double() * 2.0**log2_scale
    return int(((scaled.to(dtype) == 0) & (values != 0)).sum())


def flushed_at(values: torch.Tensor, log2_scale: int, dtype: torch.dtype) -> int:
    """Nonzero values below the dtype's smallest normal after torch's cast (zero included)."""
    cast = (values.double() * 2.0**log2_scale).to(dtype)
    return int(((cast.abs() < torch.finfo(dtype).tiny) & (values != 0)).sum())


# -- item 1: one rule for the recommended scale ------------------------------------------
def test_bf16_with_nothing_below_normal_at_s_1_recommends_s_1() -> None:
    values = torch.randn(4096) * 1e-3  # |x| from about 1e-7 to 4e-3: bf16 normals (>= 2**-126)
    rec = recommend(report_from({"layer": values}), BF16)
    # the headroom allows up to 2**127 (clamped: 4e-3 * 2**k <= 3.4e38 / 16 needs k ~ 130)
    assert rec.ceiling_log2_scale == 127
    assert rec.log2_scale == 0 and rec.scale == 1.0 and rec.limited_by == "least underflow"
    assert rec.underflow_fraction_at_1 == rec.underflow_fraction == 0.0
    # the oracle: S = 1 loses nothing, so nothing above it can lose less
    assert zeros_at(values, 0, torch.bfloat16) == flushed_at(values, 0, torch.bfloat16) == 0


def test_fp16_keeps_the_ceiling_when_each_binade_below_it_still_saves_values() -> None:
    ladder = torch.tensor([2.0**-j for j in range(45)])  # one value a binade, 1 .. 2**-44
    rec = recommend(report_from({"layer": ladder}), FP16)
    # 1 * 2**11 = 2048 <= 65504 / 16 = 4094 < 4096: ceiling 2**11, and the cast oracle shows
    # one scale lower loses one more value (2**-36 * 2**10 = 2**-26 rounds to zero)
    assert rec.log2_scale == rec.ceiling_log2_scale == 11 and rec.limited_by == "amax"
    assert zeros_at(ladder, 10, torch.float16) == zeros_at(ladder, 11, torch.float16) + 1
    # at 2**11, 2**-j * 2**11 <= 2**-25 for j >= 36: 9 of 45 values
    assert rec.underflow_fraction == pytest.approx(9 / 45)
    assert zeros_at(ladder, 11, torch.float16) == 9


def _backward_values(model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """Every floating value every aten op made during ``loss.backward()``: the oracle's own
    capture (a plain dispatch mode), not fpaudit's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[torch.Tensor] = []

    class Capture(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            for value in out if isinstance(out, tuple | list) else (out,):
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    seen.append(value.detach().flatten().double())
            return out

    with Capture():
        loss.backward()
    values = torch.cat(seen)
    return values[torch.isfinite(values) & (values != 0)]


def test_bf16_on_the_sample_mlp_recommends_s_1_as_a_real_backward_shows(
    cli, tmp_path: Path
) -> None:
    import runpy

    from ..conftest import SAMPLES

    sample = runpy.run_path(str(SAMPLES / "mlp.py"))
    torch.manual_seed(0)
    model = sample["model"]()
    batch = next(iter(sample["batches"]()))
    values = _backward_values(model, sample["loss"](model, batch))
    # the oracle: every nonzero backward value is a bf16 normal at S = 1, so S = 1 loses
    # nothing and no larger scale can lose less
    assert len(values) > 10_000 and flushed_at(values, 0, torch.bfloat16) == 0
    out = tmp_path / "mlp"
    assert cli("scan", SAMPLES / "mlp.py", "--steps", "1", "--out", out).code == 0
    text = cli("recommend", out, "--format", "bf16").stdout
    assert text.startswith(
        "Recommended static loss scale for bf16: S = 2^0 = 1 (headroom 4 bits): no loss scale "
        "needed."
    )
    data = json.loads(cli("recommend", out, "--format", "bf16", "--json").stdout)
    assert data["underflow_fraction_at_1"] == 0.0 and data["limited_by"] == "least underflow"
    # fp16 keeps its headroom's ceiling on the same scan: each binade below it saves values
    # (the oracle: one scale lower flushes more of the real backward's values)
    fp16 = json.loads(cli("recommend", out, "--format", "fp16", "--json").stdout)
    k = fp16["log2_scale"]
    assert k == fp16["ceiling_log2_scale"]
    assert flushed_at(values, k - 1, torch.float16) > flushed_at(values, k, torch.float16)


# -- item 3: baseline comparisons at the scale users train with ----------------------------
def _wide() -> torch.Tensor:
    # |x| spread over 2**-40 .. 2**-4 (log-uniform), both signs: every binade holds values
    generator = torch.Generator().manual_seed(50)
    exponents = torch.rand(20000, generator=generator, dtype=torch.float64) * 36 - 40
    signs = torch.where(torch.rand(20000, generator=generator) < 0.5, -1.0, 1.0)
    return (signs * torch.pow(2.0, exponents)).float()


def test_the_baseline_gate_fails_a_loss_divided_by_8_at_the_baselines_scale() -> None:
    base_values = _wide()
    new_values = base_values / 8  # the loss divided by 8: every value 3 binades down
    base, new = report_from({"m": base_values}), report_from({"m": new_values})
    base_k = recommend(base, FP16).log2_scale
    new_k = recommend(new, FP16).log2_scale
    assert base_k is not None and new_k == base_k + 3  # NEW's own scale moved with the values
    # the oracle: torch's cast of each report's values at BASE's scale
    nonzero = int((base_values != 0).sum())
    base_lost = zeros_at(base_values, base_k, torch.float16) / nonzero
    new_lost = zeros_at(new_values, base_k, torch.float16) / nonzero
    assert new_lost > base_lost
    limit = (new_lost - base_lost) / 2
    result = gate(new, FP16, None, baseline=base, max_increase=limit)
    assert not result.passed
    assert result.scale_source == gating.BASELINE_RECOMMENDED and result.log2_scale == base_k
    assert result.underflow_fraction == pytest.approx(new_lost, abs=0)
    assert (result.base_recommended, result.new_recommended) == (base_k, base_k + 3)
    assert [f.kinds for f in result.failures] == [(gating.UNDERFLOW_INCREASE,)]
    # judged at NEW's own recommendation (the old default), the same change passes: the
    # scale moved 3 binades with the values and nothing more underflows there
    own = gate(new, FP16, None, log2_scale="recommended", baseline=base, max_increase=limit)
    assert own.passed and own.log2_scale == base_k + 3
    assert zeros_at(new_values, base_k + 3, torch.float16) == zeros_at(
        base_values, base_k, torch.float16
    )
    # identical runs still pass
    twin = report_from({"m": base_values.clone()})
    assert gate(twin, FP16, None, baseline=base, max_increase=0.0).passed
    # diff reads both at BASE's scale by default, and says how the recommendation moved
    diffed = compare(base, new, "fp16")
    assert diffed.log2_scale == base_k and diffed.recommended_change == 3
    assert diffed.overall.new_underflow == pytest.approx(new_lost, abs=0)


def test_the_gate_prints_the_move_of_the_recommended_scale(cli, tmp_path: Path) -> None:
    base_values = _wide()
    report_from({"m": base_values}).write(tmp_path / "base")
    report_from({"m": base_values / 8}).write(tmp_path / "new")
    result = cli("gate", tmp_path / "new", "--baseline", tmp_path / "base", "--max-increase",
                 "0.000001")  # fmt: skip
    assert result.code == 1
    k = recommend(report_from({"m": base_values}), FP16).log2_scale
    first, moved = result.stdout.splitlines()[:2]
    assert first.startswith(f"FAIL: fp16 at S = 2^{k} = {2**k} (the baseline's recommended)")
    assert moved.startswith(f"  Recommended S moved 2^{k} -> 2^{k + 3} (+3 binades)")
    assert "%" in first and "increase limit 0.0001%" in first  # one unit for people
    assert "e-0" not in result.stdout


def test_a_run_report_is_judged_at_the_scales_it_trained_at() -> None:
    # values recorded at the run's loss scale 2**16 (what the device held, scaled)
    recorded = torch.tensor([2.0**-10, 2.0**-26, 1.0, 2.0**-30])
    report = report_from({"m": recorded}, loss_scale=2.0**16)
    report.update_info(command="run")
    result = gate(report, FP16, 0.3)
    assert result.scale_source == gating.TRAINED and result.trained_log2_scales == (16, 16)
    assert result.scale_words == "the scale the run trained at (S = 2^16 = 65536)"
    # the oracle: the recorded values cast as they are: 2**-26 and 2**-30 round to zero
    assert result.underflow == zeros_at(recorded, 0, torch.float16) == 2
    assert not result.passed  # 2 of 4 = 50% > 30%
    # --scale still picks any scale: the recommended one by name
    own = gate(report, FP16, 0.3, log2_scale="recommended")
    assert own.scale_source == "recommended"
    with pytest.raises(Exception, match="'trained' needs a report of `fpaudit run`"):
        gate(report_from({"m": recorded}), FP16, 0.3, log2_scale="trained")


# -- item 4: non-finite steps are evidence -------------------------------------------------
NAN_SCRIPT = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(10):
    x = torch.randn(4, 6)
    if step >= 5:
        x[0, 0] = float("nan")  # the input turns NaN from step 5 on
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
"""


def test_a_run_with_nan_steps_and_no_scaler_fails_the_gate_naming_the_first(
    cli, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(NAN_SCRIPT)
    out = tmp_path / "r"
    ran = cli("run", "--out", out, "--capture-every", "1", "--", script)
    assert ran.code == 0, ran.stderr
    assert "inf or NaN in 5 step(s) that no loss scaler skipped, first at step 5" in ran.stdout
    from fpaudit.report.store import Report

    steps = Report.read(out).steps.set_index("step")
    # the oracle, by hand: steps 0-4 have finite inputs, 5-9 a NaN one
    assert steps["loss_finite"].tolist() == [True] * 5 + [False] * 5
    assert all(math.isnan(loss) for loss in steps.loc[5:, "loss"])
    result = cli("gate", out, "--max-underflow", "0.5")
    assert result.code == 1
    assert "the loss or gradients are inf or NaN in 5 step(s) that no loss scaler skipped " \
        "(first: step 5)" in result.stdout  # fmt: skip
    allowed = cli("gate", out, "--max-underflow", "0.5", "--allow-nonfinite")
    assert allowed.code == 0, allowed.stdout


def test_only_a_scalers_skip_excuses_a_nonfinite_step() -> None:
    report = report_from({"m": torch.tensor([1.0, 2.0])}, steps=3)
    steps = report.steps
    steps.loc[1, "nonfinite_grads"] = 4  # step 1's gradients overflowed
    assert analysis.nonfinite_steps(report) == [1]
    steps.loc[1, "skipped"] = True  # skipped, but with no scaler there is nothing to excuse
    assert analysis.nonfinite_steps(report) == [1]
    from fpaudit.report.runinfo import ScalerInfo

    report.update_info(scaler=ScalerInfo("torch.amp.GradScaler", 65536.0, 2.0, 0.5, 2000))
    assert analysis.nonfinite_steps(report) == []  # the scaler skipped it: its job


# -- item 2: live reports lead with what the device lost -----------------------------------
def test_a_live_shadow_report_leads_with_what_the_device_lost(cli, tmp_path: Path) -> None:
    out = tmp_path / "live"
    scan = cli("scan", MODELS / "tiny_grads.py", "--steps", "1", "--amp", "fp16", "--shadow",
               "--out", out)  # fmt: skip
    assert scan.code == 0, scan.stderr
    # by hand (tiny_grads.py): the cast of the 1e-8 gradient into fp16 makes 8 x 16 = 128
    # values, all <= 2**-25, all zero on the device and nonzero in the fp32 re-run
    lost_line = (
        "Lost on the device: 100% (128 of 128 nonzero values of the fp32 re-run were zero in "
        "float16 at the run's loss scale)"
    )
    assert scan.stdout.splitlines()[1].startswith(lost_line)
    assert cli("recommend", out).stdout.startswith(lost_line)
    rec = json.loads(cli("recommend", out, "--json").stdout)
    assert (rec["lost"], rec["shadow_nonzero"], rec["lost_fraction"]) == (128, 128, 1.0)
    # show counts the same values: the float16 ones, and says which it leaves out and why
    rows = json.loads(cli("show", out, "--json").stdout)
    assert sum(row["lost"] for row in rows) == rec["lost"]
    assert {row["dtype"] for row in rows} == {"float16"}
    shown = cli("show", out).stdout
    # left out: the loss seed (1.0) and the fp32 multiply by 1e-8 (1e-8): 2 nonzero values;
    # recommend leaves out the same fp32 values but not the <loss> seed (not in its scope)
    assert "2 nonzero value(s) held in float32 (ops autocast keeps in fp32) are left out" in shown
    assert rec["left_out_nonzero"] == 1 and rec["left_out_dtypes"] == ["float32"]


# -- item 7: one unit per line; a report that recommends nothing says so ---------------------
def test_a_report_that_recommends_nothing_says_so_in_the_verdict() -> None:
    result = gate(report_from({"m": torch.zeros(4)}), FP16, 0.01)
    assert not result.passed
    assert "nothing recommended" in result.scale_words and "(recommended)" not in result.scale_words


def test_gate_reasons_speak_percent_only() -> None:
    report = report_from({"m": torch.tensor([2.0**-30, 1.0, 1.0, 1.0])})
    (failure,) = gate(report, FP16, 0.1, log2_scale=0).failures
    # 1 of 4 underflows at S = 1 (2**-30 <= 2**-25): 25% against 10%
    assert failure.as_flag() == (
        "overall: underflow 25% exceeds the limit 10% (--max-underflow); 1 of 4 nonzero "
        "backward values underflow, 0 overflow; fp16 at S = 2^0 = 1 (given)"
    )
