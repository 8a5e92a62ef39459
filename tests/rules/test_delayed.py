"""FP8 delayed scaling replay (``simulate --policy te-delayed``): hand traces and oracles."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fpaudit.numerics.formats import Fate, fate, get_format
from fpaudit.report.store import Report
from fpaudit.rules import delayed

from ..conftest import one_error_line
from ..reports import report_of_steps

E5M2 = get_format("fp8_e5m2")  # max 57344 = 1.75 * 2**15, smallest normal 2**-14
E4M3 = get_format("fp8_e4m3fn")


SPIKE_AT = 4
SMALL = 2.0**-20


def spike_report(steps: int = 12, spike: float = 1024.0, loss_scale: float = 1.0) -> Report:
    """Every step holds 1.0 and 2**-20; step 4 also holds ``spike``."""
    values = []
    for step in range(steps):
        entries = [1.0, SMALL] + ([spike] if step == SPIKE_AT else [])
        values.append(torch.tensor(entries) * loss_scale)
    return report_of_steps(values, loss_scale=loss_scale)


def test_te_delayed_hand_trace_history_1_margin_0() -> None:
    # Backward values go to E5M2 (HYBRID). Scales, with sf = (57344 / amax) / 2**0:
    #   step 0: the initial scale 1                      -> 2**-20 * 1 < 2**-14: flushed
    #   steps 1-4: amax 1 before -> sf = 57344 / 1 = 57344
    #     step 4: 1024 * 57344 = 2**10 * 1.75 * 2**15 > 61440 (E5M2's edge): overflow
    #     2**-20 * 57344 = 1.75 * 2**-5: normal, not flushed
    #   step 5: amax 1024 at step 4 -> sf = 57344 / 1024 = 56 (exact)
    #     2**-20 * 56 = 1.75 * 2**-15 < 2**-14: flushed
    #   step 6 on: amax 1 -> 57344 again
    result = delayed.replay(spike_report(), delayed.Settings("te-delayed", 1, 0))
    assert result.scale[0].tolist() == [1, *[57344] * 4, 56, *[57344] * 6]
    assert result.overflow_steps("lower") == result.overflow_steps("upper") == [SPIKE_AT]
    per_step = result.per_step()
    assert per_step["overflow_lower"].tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]
    assert per_step["flushed_lower"].tolist() == [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0]
    assert result.exact  # every value is a power of two: each bin is one value
    # 1 overflow of 2 + 11 * 2 + 1 = 25 nonzero values
    assert result.fraction("overflow_lower") == 1 / 25


@pytest.mark.parametrize("history", [1, 3, 16])
def test_the_history_keeps_the_scale_low_for_h_steps_after_the_spike(history: int) -> None:
    # The update after step t reads steps t-H+1..t, so the spike at 4 sets the scale of
    # steps 5..4+H to 57344 / 1024 = 56; step 5+H is back at 57344.
    steps = 4 + history + 3
    result = delayed.replay(spike_report(steps), delayed.Settings("te-delayed", history, 0))
    expected = [1.0, 57344, 57344, 57344, 57344] + [56.0] * history
    expected += [57344.0] * (steps - len(expected))
    assert result.scale[0].tolist() == expected
    # Each low-scale step flushes 2**-20 (1.75 * 2**-15 < 2**-14), plus step 0 at scale 1.
    flushed = result.per_step()["flushed_lower"].tolist()
    assert flushed == [1, 0, 0, 0, 0] + [1] * history + [0] * (steps - 5 - history)
    assert result.overflow_steps("upper") == [SPIKE_AT]


def test_a_margin_absorbs_a_small_spike_but_not_a_large_one() -> None:
    # margin 1: sf = 57344 / 1 / 2 = 28672. A spike of 1.5: 1.5 * 28672 = 43008 <= 57344,
    # no overflow; with margin 0: 1.5 * 57344 = 86016 > 61440, overflow.
    small = spike_report(spike=1.5)
    assert delayed.replay(small, delayed.Settings("te-delayed", 1, 1)).overflow_steps() == []
    assert delayed.replay(small, delayed.Settings("te-delayed", 1, 0)).overflow_steps() == [4]
    # 1024 * 28672 = 2**10 * 1.75 * 2**14 > 61440: margin 1 does not save it
    large = spike_report()
    assert delayed.replay(large, delayed.Settings("te-delayed", 1, 1)).overflow_steps() == [4]


def test_most_recent_forgets_the_spike_after_one_step() -> None:
    result = delayed.replay(spike_report(), delayed.Settings("te-delayed", 16, 0, "most_recent"))
    assert result.scale[0, 5] == 56 and result.scale[0, 6] == 57344


def test_msamp_power_of_two_hand_trace() -> None:
    # exp = floor(log2(57344 / amax)) - margin:
    #   amax 1:    floor(log2 57344) = floor(15.81) = 15 -> sf = 2**15
    #   amax 1024: floor(log2 56) = floor(5.81) = 5      -> sf = 2**5
    # step 4: 1024 * 2**15 = 2**25 > 61440: overflow; step 5: 2**-20 * 2**5 = 2**-15 < 2**-14
    result = delayed.replay(spike_report(), delayed.Settings("msamp-delayed", 1, 0))
    assert result.scale[0].tolist() == [1, *[2.0**15] * 4, 2.0**5, *[2.0**15] * 6]
    assert result.overflow_steps() == [4]
    assert result.per_step()["flushed_lower"].tolist() == [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0]
    assert result.exact  # powers of two: exact by construction


def test_scale_update_special_cases_follow_the_sources() -> None:
    previous = np.array([8.0, 8.0, 8.0, 8.0], dtype=np.float32)
    amax = np.array([0.0, np.inf, np.nan, 2.0**-140], dtype=np.float32)
    # TE: amax 0, inf, NaN keep the previous scale; 448 / 2**-140 overflows fp32 -> fp32 max
    te = delayed.scale_update("te-delayed", amax, previous, 448.0, 0)
    assert te.tolist() == [8.0, 8.0, 8.0, float(np.finfo(np.float32).max)]
    # MS-AMP: 0 and NaN keep it; inf gives exp = floor(log2(448 / inf)) = -inf < 0,
    # and so 1 / 8 (the code takes the reciprocal after restoring the previous scale)
    msamp = delayed.scale_update("msamp-delayed", amax[:3], previous[:3], 448.0, 0)
    assert msamp.tolist() == [8.0, 0.125, 8.0]
    # te formula in fp32: (448 / 3) rounds once in fp32, then / 2**2 is exact
    three = delayed.scale_update("te-delayed", np.float32([3.0]), np.float32([1.0]), 448.0, 2)
    assert three[0] == np.float32(np.float32(448.0) / np.float32(3.0)) / np.float32(4.0)


def test_classify_matches_a_torch_cast_and_formats_fate() -> None:
    generator = torch.Generator().manual_seed(1)
    values = torch.exp2(torch.rand(4000, generator=generator) * 60 - 40)  # 2**-40 .. 2**20
    values = torch.cat([values, torch.tensor([61440.0, 61439.996, 57344.0, 2.0**-14])])
    scales = torch.exp2(torch.rand(len(values), generator=generator) * 20 - 10)
    scales[-4:] = 1.0
    product = values * scales  # fp32, as the cast sees it
    over, flushed = delayed.classify(E5M2, values.numpy(), scales.numpy())
    cast = product.to(torch.float8_e5m2).float()
    assert over.tolist() == torch.isinf(cast).tolist()
    assert flushed.tolist() == (product < 2.0**-14).tolist()
    # E4M3 saturates in torch, so the oracle is formats.fate on the fp32 product
    over4, flushed4 = delayed.classify(E4M3, values.numpy(), scales.numpy())
    for i in range(0, len(values), 7):
        bits = int(product[i : i + 1].view(torch.int32).item())
        binade, fraction = (bits >> 23) - 127, bits & 0x7FFFFF
        expected = fate(E4M3, binade, fraction) if bits >> 23 else Fate.UNDERFLOW
        assert over4[i] == (expected == Fate.OVERFLOW)
        assert flushed4[i] == (expected in (Fate.UNDERFLOW, Fate.SUBNORMAL))


def test_bounds_bracket_a_real_cast_at_scales_that_are_not_powers_of_two() -> None:
    generator = torch.Generator().manual_seed(2)
    tensors = [torch.randn(3000, generator=generator) * (2.0 ** (k % 5)) for k in range(8)]
    tensors[5] = tensors[5] * 300  # a spike
    result = delayed.replay(report_of_steps(tensors), delayed.Settings("te-delayed", 2, 0))
    assert not result.exact
    per_step = result.per_step()
    overflowing = []
    for t, tensor in enumerate(tensors):
        magnitudes = tensor.abs()[tensor != 0]
        product = magnitudes * torch.tensor(float(result.scale[0, t]))
        overflowed = int(torch.isinf(product.to(torch.float8_e5m2).float()).sum())
        flushed = int((product < 2.0**-14).sum())
        row = per_step.iloc[t]
        assert row["overflow_lower"] <= overflowed <= row["overflow_upper"]
        assert row["flushed_lower"] <= flushed <= row["flushed_upper"]
        overflowing += [t] if overflowed else []
    # the amax doubles at steps 1-4 and jumps 300x at 5: each is seen one step late.
    # Which steps overflow is exact (the amax is a value held), though counts are bounds.
    assert overflowing == [1, 2, 3, 4, 5]
    assert result.overflow_steps("lower") == result.overflow_steps("upper") == overflowing


def test_values_are_replayed_in_unscaled_units() -> None:
    # Recorded under loss scale 2**8: the replay divides by it, so the trace is the same.
    scaled = delayed.replay(spike_report(loss_scale=256.0), delayed.Settings("te-delayed", 1, 0))
    plain = delayed.replay(spike_report(), delayed.Settings("te-delayed", 1, 0))
    assert scaled.scale.tolist() == plain.scale.tolist()
    assert scaled.per_step().equals(plain.per_step())


def test_a_replays_summary_counts_the_hand_traced_overflow_and_flush() -> None:
    # H=1, margin 0 on fp8_e5m2: step 0 has no history (scale 1), so 2**-20 flushes;
    # steps 1-4 run at 57344 / 1.0, and the spike 1024 * 57344 overflows at step 4; step
    # 5 runs at 57344 / 1024 = 56, so 2**-20 * 56 < 2**-14 flushes; then 57344 again.
    # 12 steps of 2 values and the spike: 25 nonzero, 1 overflows, 2 flush.
    summary = delayed.replay(spike_report(), delayed.Settings("te-delayed", 1, 0)).summary()
    assert (summary.steps, summary.ops, summary.exact) == (12, 1, True)
    assert summary.overflow_steps_lower == summary.overflow_steps_upper == 1
    assert summary.overflow_fraction_lower == summary.overflow_fraction_upper == 1 / 25
    assert summary.flushed_fraction_lower == summary.flushed_fraction_upper == 2 / 25
    # the JSON's keys, in the order --json has always printed them: the settings first
    assert list(summary.to_dict()) == [
        "policy", "amax_history_len", "margin", "amax_compute_algo", "exact", "steps", "ops",
        "overflow_steps_lower", "overflow_steps_upper", "overflow_fraction_lower",
        "overflow_fraction_upper", "flushed_fraction_lower", "flushed_fraction_upper",
    ]  # fmt: skip


def test_sweep_recommends_the_least_flushing_pair_without_overflow() -> None:
    # A spike of 1.5 at step 4: margin 0 overflows at 4 for every H (1.5 * 57344 > 61440);
    # margin 1 or 2 never overflows. Flushing: step 0 flushes 2**-20 at every setting; after
    # the spike the scale is 57344 / 1.5 / 2**m for H steps. 2**-20 * 38229.33 / 2 =
    # 1.17 * 2**-6 ... normal, so margin 1 flushes only step 0, as margin 2 does; the tie
    # goes to the smaller margin, then to the shorter history: (H=1, margin=1).
    result = delayed.sweep(spike_report(spike=1.5), history_lengths=(1, 16), margins=(0, 1, 2))
    grid = {(r.settings.amax_history_len, r.settings.margin): r for r in result.replays}
    assert grid[(1, 0)].overflow_steps() == grid[(16, 0)].overflow_steps() == [4]
    assert all(grid[(h, m)].overflow_steps() == [] for h in (1, 16) for m in (1, 2))
    assert result.recommended is grid[(1, 1)]
    # a gate that tolerates one overflow step admits margin 0, which flushes the same
    tolerant = delayed.sweep(spike_report(spike=1.5), max_overflow_steps=1)
    assert tolerant.recommended is not None and tolerant.recommended.settings.margin == 0


def test_sweep_without_a_passing_pair_says_so() -> None:
    # 2**20 * 57344 / 2**2 overflows at every margin of the grid
    result = delayed.sweep(spike_report(spike=2.0**20), history_lengths=(1,))
    assert result.recommended is None
    assert any("no pair" in note for note in result.notes)


def test_bad_settings_are_usage_errors() -> None:
    from fpaudit.errors import UsageError

    with pytest.raises(UsageError, match=r"^amax_history_len must be at least 1, got 0$"):
        delayed.Settings("te-delayed", 0, 0)
    with pytest.raises(UsageError, match=r"^margin must be 0 or more, got -1$"):
        delayed.Settings("te-delayed", 1, -1)
    with pytest.raises(UsageError, match=r"^amax_compute_algo must be one of max, most_recent"):
        delayed.Settings("te-delayed", 1, 0, "mean")


def test_cli_simulate_te_delayed_and_sweep(cli, tmp_path: Path) -> None:
    path = tmp_path / "report"
    spike_report().write(path)
    result = cli("simulate", path, "--policy", "te-delayed", "--amax-history-len", "1",
                 "--margin", "0", "--json")  # fmt: skip
    assert result.code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["overflow_step_numbers"] == [4] and data["exact"] is True
    assert [row["scale"] for row in data["per_op_step"]][:6] == [1, 57344, 57344, 57344, 57344, 56]
    text = cli("simulate", path, "--policy", "te-delayed", "--amax-history-len", "1")
    assert text.code == 0 and "overflow" in text.stdout
    swept = cli("simulate", path, "--policy", "msamp-delayed", "--sweep", "--json")
    assert swept.code == 0, swept.stderr
    assert json.loads(swept.stdout)["recommended"] is None  # 1024 * 2**15 / 4 > 61440
    bad = cli("simulate", path, "--policy", "te-delayed", "--margin", "-1")
    assert bad.code == 2 and "--margin" in one_error_line(bad)
    wrong = cli("simulate", path, "--policy", "torch", "--amax-history-len", "4")
    assert wrong.code == 2 and "te-delayed" in one_error_line(wrong)
