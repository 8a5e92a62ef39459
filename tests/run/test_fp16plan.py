"""fpaudit fp16-plan: the smallest set of modules to keep out of fp16, verified by running."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fpaudit.kernels import histogram
from fpaudit.report.records import KIND_BACKWARD, RecordKey, ReportBuilder, StepRecords
from fpaudit.report.store import Report
from fpaudit.run import fp16plan, verify

from ..conftest import MODELS, one_error_line

KIND_FORWARD = "forward"


def hand_report(steps: int = 6) -> Report:
    """Module a: forward 70000 (too large for fp16 at any S); module b: forward 2, backward
    2**-3 and 2**-20 (scaled with the loss), a: backward 2**-10."""
    values = {
        (KIND_FORWARD, "a", False): [70000.0, 1.0],
        (KIND_FORWARD, "b", False): [2.0],
        (KIND_BACKWARD, "a", True): [2.0**-10],
        (KIND_BACKWARD, "b", True): [2.0**-3, 2.0**-20],
    }
    builder = ReportBuilder(modules=["a", "b"])
    for _ in range(steps):
        records = {}
        for (kind, module, scales), entries in values.items():
            hist = histogram.Histogram(torch.device("cpu"))
            hist.add(torch.tensor(entries))
            key = RecordKey(kind, module, "", "aten.mul.Tensor", 0, "float32", scales)
            records[key] = hist.host()
        builder.add_step(StepRecords.from_histograms(records), loss=1.0, loss_scale=1.0,
                         seconds=0.0)  # fmt: skip
    return Report.from_builder(builder)


def test_plan_keeps_out_exactly_the_failing_modules_at_the_largest_same_set_scale() -> None:
    # H = 1: limit 65504 / 2 = 32752. a fails at every S (forward 70000 > 32752).
    # b left in fp16: 2**-20 * S underflows iff <= 2**-25 (S <= 2**-5: 1 of 2 values, 50%),
    # so the smallest S within 0.1% is 2**-4. b's backward 2**-3 * S fits up to S = 2**17
    # (16384); 2**18 gives 32768 > 32752, b would fail: the plan takes 2**17, keeps out {a}.
    plan = fp16plan.plan_from_report(hand_report(), headroom_bits=1, max_underflow=0.001)
    assert plan.keep_out == ["a"] and plan.log2_scale == 17
    assert plan.underflow_fraction == 0.0
    # at 2S = 2**18, b's 2**-3 * 2**18 = 32768 < 65504: no step overflows (rate 0). The
    # growth interval keeps growth skips 1/(N + 1) below 0.05%: N = 2000, and with none
    # seen at 2S the scaler may climb to a scale that overflows every step: 1/2001.
    assert plan.overflow_rate_at_2s == 0.0 and plan.growth_interval == 2000
    assert plan.predicted_skip_rate == 1 / 2001
    # recommend (4 bits, every module): b's amax 2**-3 and a's 2**-10 -> 2**-3 * 2**14 =
    # 2048 <= 4094 < 4096: ceiling 2**14, where nothing is below fp16's smallest normal
    # 2**-14; the smallest S so: 2**6 (2**-20 * 2**6 = 2**-14). The plan's 2**17 differs
    # and says why
    assert plan.recommended_log2_scale == 6 and plan.recommended_headroom_bits == 4
    # (b limits both; a, kept out, does not limit recommend: the rule and the headroom differ)
    assert plan.scales_differ_because() == (
        "recommend takes the smallest S that loses no more values than the largest its headroom "
        "allows, this plan the largest that keeps the same modules in fp16; recommend keeps 4 "
        "bits of headroom below 65504, this plan 1 (the verifying step checks it)"
    )
    assert plan.ranges[0].forward_amax == 70000.0


def test_a_stricter_headroom_lowers_the_scale_and_a_looser_one_raises_it() -> None:
    # H = 3: limit 65504 / 8 = 8188; 2**-3 * 2**15 = 4096 fits, 2**16 gives 8192 > 8188
    assert fp16plan.plan_from_report(hand_report(), headroom_bits=3).log2_scale == 15
    # H = 0: limit 65504; a's 70000 still fails; 2**-3 * 2**18 = 32768 fits, 2**19 does not
    plan = fp16plan.plan_from_report(hand_report(), headroom_bits=0)
    assert plan.log2_scale == 18 and plan.keep_out == ["a"]


def test_overflow_rate_counts_steps_whose_kept_values_overflow_at_2s() -> None:
    # at S = 2**20: b's 2**-3 * 2**20 = 131072 > 65504 in all 6 steps -> rate 1 -> N = 1
    rate, steps = fp16plan.overflow_rate(hand_report(), fp16plan.get_format("fp16"), 2.0**20,
                                         {"a"})  # fmt: skip
    assert (rate, steps) == (1.0, 6)
    # every step overflows at 2S: a growth attempt skips at once, 1 skip per 2001 steps
    assert fp16plan.growth_skip_rate(fp16plan.growth_interval(), rate) == 1 / 2001
    assert fp16plan.growth_interval(1e-6) == fp16plan.MAX_GROWTH_INTERVAL  # capped


def test_keep_out_of_autocast_runs_the_module_in_fp32() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    verify.keep_out_of_autocast(model, ["1"], "cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        hidden = model[0](torch.ones(2, 4))
        out = model(torch.ones(2, 4))
    assert hidden.dtype == torch.float16 and out.dtype == torch.float32


@pytest.mark.parametrize("flag,value", [("--headroom-bits", "-1"), ("--max-underflow", "2")])
def test_bad_options_are_one_line(cli, flag: str, value: str) -> None:
    assert flag in one_error_line(cli("fp16-plan", MODELS / "fp16_breaking.py", flag, value))


def test_plan_for_the_forward_breaking_decoder_verifies(cli, monkeypatch, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    monkeypatch.setenv("FP16_CASE", "forward")
    result = cli("fp16-plan", MODELS / "fp16_breaking.py", "--steps", "1", "--device", "cpu",
                 "--json")  # fmt: skip
    assert result.code == 0, result.stderr
    plan = json.loads(result.stdout)
    # the scaled down_proj's forward output (~8.8e4) cannot be held in fp16 at any scale;
    # model.layers.1 (its residual add) and model.norm (fp32 variance) are candidates of the
    # fp32 criterion that the run shows can stay under autocast
    assert plan["keep_out"] == ["model.layers.1.mlp.down_proj"]
    assert set(plan["candidates"]) >= {"model.layers.1.mlp.down_proj"}
    check = plan["verification"]
    assert plan["passed"] and not check["skipped"]
    assert all(p["changed_mixed"] for p in check["parameters"])
    # the snippet is code that works: with it, a fp16 autocast forward is finite
    from tests.models import fp16_breaking

    model = fp16_breaking.build("forward")
    namespace = {"model": model}
    exec(plan["snippet"].replace("'cuda'", "'cpu'"), namespace)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = fp16_breaking.loss(model, fp16_breaking.batches()[0])
    assert math.isfinite(float(loss.detach()))
    assert namespace["scaler"].get_scale() == plan["scale"]
    # without it the same forward overflows
    bare = fp16_breaking.build("forward")
    with torch.autocast("cpu", dtype=torch.float16):
        assert not math.isfinite(
            float(fp16_breaking.loss(bare, fp16_breaking.batches()[0]).detach())
        )


def test_plan_for_the_backward_breaking_decoder_lowers_the_scale(cli, monkeypatch) -> None:
    pytest.importorskip("transformers")
    monkeypatch.setenv("FP16_CASE", "backward")
    result = cli("fp16-plan", MODELS / "fp16_breaking.py", "--steps", "1", "--device", "cpu",
                 "--json")  # fmt: skip
    assert result.code == 0, result.stderr
    plan = json.loads(result.stdout)
    # the forward fits fp16; the backward overflow at 2**16 (test_fp16_models) is avoided by
    # a smaller scale: no module has to leave fp16, and the fp16 step at that scale updates
    # every parameter
    assert plan["keep_out"] == [] and plan["scale"] < 2.0**16
    assert plan["passed"] and all(p["changed_mixed"] for p in plan["verification"]["parameters"])
