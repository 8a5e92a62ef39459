"""The loss-scaler rules in fpaudit.rules.scalers: against torch's real GradScaler, and hand-worked traces."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from fpaudit.errors import OptionError
from fpaudit.rules.scalers import (
    PARAMETERS,
    POLICIES,
    REGISTRY,
    PolicySettings,
    Trajectory,
    make_scaler,
    replay,
    replay_thresholds,
    settings,
)

F32 = np.float32


def trace(policy: str, overflow_steps: set[int], n: int, **overrides: float | None) -> Trajectory:
    return replay(settings(policy, **overrides), lambda i, _s: i in overflow_steps, n)


def assert_trace(t: Trajectory, scales: list[float], overflow_steps: set[int]) -> None:
    """``scales`` is the scale in force at each step plus the one after the last update."""
    n = len(scales) - 1
    assert t.scale.tolist() == scales[:-1]
    assert t.scale_after.tolist() == scales[1:]
    assert t.skipped.tolist() == [i in overflow_steps for i in range(n)]


# --- torch: the real torch.amp.GradScaler("cpu") is the oracle ---------------------------------


def real_gradscaler(
    n: int, overflow_steps: set[int], **kwargs: Any
) -> tuple[list[float], list[bool]]:
    """Scale in force before each step, and whether the step was skipped, from the real GradScaler."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", **kwargs)
    scales, skipped = [], []
    for i in range(n):
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            param.zero_()
        scaler.scale(param.sum()).backward()  # grad = scale, finite
        scales.append(scaler.get_scale())
        if i in overflow_steps:
            assert param.grad is not None
            param.grad.fill_(math.inf)
        scaler.step(opt)
        skipped.append(param.item() == 0.0)  # any applied step moves the parameter off 0
        scaler.update()
    return scales, skipped


TORCH_CASES = {
    # growth after exactly 3 clean steps (0-2), again after 3-5; overflow at 7 resets the tracker
    # (6 clean, 7 overflow, 8-10 clean -> grow after 10); 12, 13 consecutive overflows.
    "growth-and-reset": ({"init_scale": 2.0**10, "growth_interval": 3}, {7, 12, 13}, 18),
    "consecutive-overflows": (
        {"init_scale": 2.0**16, "growth_interval": 2},
        {0, 1, 2, 3, 6, 7},
        12,
    ),
    # non-power-of-two factors: every product rounds; see test_torch_rounds_in_double
    "factor-1.5-0.3": (
        {"init_scale": 3.0, "growth_factor": 1.5, "backoff_factor": 0.3, "growth_interval": 2},
        {0, 1, 2, 5, 8, 9},
        30,
    ),
    # 2**-140 halves through the float32 subnormals to 2**-149, then 2**-150 rounds (to even) to 0,
    # and 0 * growth stays 0.
    "decay-to-zero": (
        {"init_scale": 2.0**-140, "growth_interval": 3},
        set(range(12)) | {14, 15},
        22,
    ),
    "decay-0.3-subnormal": (
        {"init_scale": 2.0**-120, "backoff_factor": 0.3, "growth_interval": 2},
        set(range(40)) - {20, 21},
        45,
    ),
    # 2**127 * 2 would be inf in float32: the kernel keeps 2**127 and resets the tracker.
    "never-grows-to-inf": ({"init_scale": 2.0**126, "growth_interval": 1}, {5}, 10),
}


@pytest.mark.parametrize("case", TORCH_CASES)
def test_torch_matches_real_gradscaler(case: str) -> None:
    kwargs, overflow_steps, n = TORCH_CASES[case]
    real_scales, real_skipped = real_gradscaler(n, overflow_steps, **kwargs)
    t = trace("torch", overflow_steps, n, **kwargs)
    assert t.scale.tolist() == real_scales
    assert t.skipped.tolist() == real_skipped == [i in overflow_steps for i in range(n)]
    assert t.aborted_at is None


def test_torch_hand_trace() -> None:
    # init 2**10, growth_interval 3 (tracker counts clean steps, grows on the 3rd):
    # 0,1,2 clean -> tracker 1,2, then 3 == interval -> 2**11; 3 overflow -> 2**10, tracker 0;
    # 4,5 clean -> tracker 1,2; 6 overflow -> 2**9; 7,8,9 clean -> 2**10 after 9.
    t = trace("torch", {3, 6}, 10, init_scale=2.0**10, growth_interval=3)
    k = 2.0**10
    assert_trace(t, [k, k, k, 2 * k, k, k, k, k / 2, k / 2, k / 2, k], {3, 6})
    # Growth stops below float32 inf: 2**127 * 2 = 2**128 overflows float32, so the scale stays.
    t = trace("torch", set(), 3, init_scale=2.0**126, growth_interval=1)
    assert t.scale_after.tolist() == [2.0**127, 2.0**127, 2.0**127]


def test_torch_rounds_in_double() -> None:
    # The kernel computes float * double in double and rounds once to float32:
    #   3 * 0.3 (double 0x1.3333333333333p-2) = 0.8999999999999999 -> float32 0x1.cccccc p-1
    #   = 0.89999997615814208984375.
    # Rounding the factor to float32 first (0x1.333334p-2 = 0.300000011920928955078125) gives
    #   3 * that = 0.900000035762786865234375 = 0x1.ccccce p-1 exactly, one ulp higher: wrong.
    t = trace("torch", {0}, 1, init_scale=3.0, backoff_factor=0.3)
    assert t.scale_after[0] == float.fromhex("0x1.ccccccp-1") == 0.89999997615814208984375
    assert float(F32(3.0) * F32(0.3)) == float.fromhex("0x1.cccccep-1")
    # ...and that is what the real GradScaler does:
    real, _ = real_gradscaler(2, {0}, init_scale=3.0, backoff_factor=0.3)
    assert real[1] == t.scale_after[0]


def test_torch_init_scale_rounds_to_float32() -> None:
    # GradScaler keeps the scale in torch.full(..., dtype=float32): 0.1 -> 0x1.99999ap-4.
    assert make_scaler(settings("torch", init_scale=0.1)).scale == float.fromhex("0x1.99999ap-4")


# --- apex ------------------------------------------------------------------------------------


def test_apex_cap_floor_and_window() -> None:
    # init 2**23, scale_window 2, max 2**24 (default), min 2**21:
    # 0 clean  unskipped 1                                  2**23
    # 1 clean  unskipped 2 == 2 -> min(2**24, 2**24)        2**24
    # 2 clean  unskipped 1                                  2**24
    # 3 clean  unskipped 2 -> min(2**24, 2**25) = cap       2**24
    # 4 over   max(2**21, 2**23), unskipped 0               2**23
    # 5 over   2**22;  6 over  2**21;  7 over max(2**21, 2**20) = floor 2**21
    # 8 clean  unskipped 1;  9 clean unskipped 2 -> 2**22
    over = {4, 5, 6, 7}
    t = trace("apex", over, 10, init_scale=2.0**23, growth_interval=2, min_scale=2.0**21)
    e = [23, 23, 24, 24, 24, 23, 22, 21, 21, 21, 22]
    assert_trace(t, [2.0**x for x in e], over)


def test_apex_default_no_floor_and_window_counts_only_clean_steps() -> None:
    # min_loss_scale None: 1.0 halves to 0.5, 0.25. scale_window 3, clean steps at 2,3 then
    # overflow at 4 resets unskipped, so growth needs 5,6,7 -> after 7: 0.125 * 2 = 0.25.
    over = {0, 1, 4}
    t = trace("apex", over, 8, init_scale=1.0, growth_interval=3)
    assert_trace(t, [1.0, 0.5, 0.25, 0.25, 0.25, 0.125, 0.125, 0.125, 0.25], over)


def test_apex_init_above_cap_is_kept_until_growth() -> None:
    # apex does not clamp the initial scale; the cap applies only at a growth step:
    # 2**25, window 1: step 0 clean -> min(2**24, 2**26) = 2**24.
    t = trace("apex", set(), 2, init_scale=2.0**25, growth_interval=1)
    assert_trace(t, [2.0**25, 2.0**24, 2.0**24], set())


# --- deepspeed -------------------------------------------------------------------------------


def test_deepspeed_hysteresis_and_window() -> None:
    # init 2**16, window 3, hysteresis 2, min 1; state (cur_iter, last_overflow_iter, cur_hysteresis)
    # 0 over  hysteresis 2 -> 1, scale kept (skipped)    last 0           2**16
    # 1 over  hysteresis 1 -> 2**16 / 2                  last 1           2**15
    # 2 clean (2-1) % 3 = 1;  3 clean (3-1) % 3 = 2                       2**15
    # 4 clean (4-1) % 3 = 0 -> grow, hysteresis back to 2                 2**16
    # 5 over  hysteresis 2 -> 1, kept                    last 5           2**16
    # 6 clean (6-5) % 3 = 1: hysteresis stays 1 (consecutive_hysteresis false)
    # 7 over  hysteresis 1 -> halve                      last 7           2**15
    # 8 clean 1;  9 clean 2;  10 clean (10-7) % 3 = 0 -> grow             2**16
    # 11 clean 4 % 3;  12 clean 5 % 3;  13 clean (13-7) % 3 = 0 -> grow   2**17
    over = {0, 1, 5, 7}
    t = trace("deepspeed", over, 14, growth_interval=3)
    e = [16, 16, 15, 15, 15, 16, 16, 16, 15, 15, 15, 16, 16, 16, 17]
    assert_trace(t, [2.0**x for x in e], over)
    assert t.aborted_at is None


def test_deepspeed_first_growth_counts_from_iteration_minus_one() -> None:
    # last_overflow_iter starts at -1: window 2 grows at cur_iter 1, 3, 5 (i.e. (i + 1) % 2 == 0).
    t = trace("deepspeed", set(), 6, init_scale=1.0, growth_interval=2)
    assert_trace(t, [1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 8.0], set())


def test_deepspeed_min_scale_floor_and_abort() -> None:
    # init 3 * 2**13 = 24576, min 2**14 = 16384, hysteresis 1:
    # 0 over  max(24576 / 2, 16384) = 16384 (floor)
    # 1 over  scale == min_scale: DeepSpeed raises (raise_error_at_min_scale); the replay marks
    #         aborted_at = 1 and stays at max(8192, 16384) = 16384
    # 2 over  stays 16384 (aborted_at still 1)
    t = trace("deepspeed", {0, 1, 2}, 3, init_scale=24576.0, hysteresis=1, min_scale=16384.0)
    assert_trace(t, [24576.0, 16384.0, 16384.0, 16384.0], {0, 1, 2})
    assert t.aborted_at == 1


def test_deepspeed_defaults_reach_min_and_abort() -> None:
    # defaults: 2**16, hysteresis 2, min 1. Overflow every step: step 0 spends hysteresis,
    # steps 1..16 halve 2**16 -> 2**0 = 1 = min, step 17 overflows at the minimum -> abort.
    t = trace("deepspeed", set(range(20)), 20)
    assert t.scale_after[0] == 2.0**16
    assert t.scale_after[16] == 1.0
    assert t.aborted_at == 17
    assert t.scale_after[-1] == 1.0


# --- megatron --------------------------------------------------------------------------------


def test_megatron_hysteresis_tracker() -> None:
    # init 8, min 1 (default), window 2, hysteresis 2; (growth_tracker, hysteresis_tracker):
    # 0 over  (0, 1): 1 > 0, kept (skipped)          8
    # 1 clean (1, 1): a clean step does not refill the hysteresis tracker
    # 2 over  (0, 0): <= 0 -> 8 * 0.5                4
    # 3 over  (0, -1) -> 2;  4 over (0, -2) -> 1;  5 over (0, -3) -> max(0.5, 1) = 1
    # 6 clean (1, -3);  7 clean (2 == 2) -> (0, 2), grow  2
    # 8 over  (0, 1): delayed again                  2
    # 9 clean (1, 1)                                 2
    over = {0, 2, 3, 4, 5, 8}
    t = trace("megatron", over, 10, init_scale=8.0, growth_interval=2)
    assert_trace(t, [8.0, 8.0, 8.0, 4.0, 2.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0], over)
    assert t.aborted_at is None


def test_megatron_float32_arithmetic() -> None:
    # Megatron's factor is a float32 tensor: 0.3 -> 0x1.333334p-2, and 3 * that = 0x1.ccccce p-1
    # exactly (0.900000035762786865234375), unlike torch's double factor (see above).
    t = trace("megatron", {0}, 1, init_scale=3.0, backoff_factor=0.3, hysteresis=1, min_scale=0.5)
    assert t.scale_after[0] == float.fromhex("0x1.cccccep-1")
    # No finiteness check: 2**127 * 2 overflows float32 to inf.
    t = trace("megatron", set(), 1, init_scale=2.0**127, growth_interval=1)
    assert t.scale_after[0] == math.inf


def test_megatron_default_initial_scale() -> None:
    # 2**32 with window 1000: unchanged over 999 clean steps, doubled at the 1000th.
    t = trace("megatron", set(), 1000)
    assert t.scale_after[998] == 2.0**32
    assert t.scale_after[999] == 2.0**33


# --- static ----------------------------------------------------------------------------------


def test_static() -> None:
    # 1024 forever; the overflowing steps 1 and 2 are skipped.
    t = trace("static", {1, 2}, 5, init_scale=1024.0)
    assert_trace(t, [1024.0] * 6, {1, 2})


# --- settings --------------------------------------------------------------------------------


# Each framework's documented defaults (the module docstring of fpaudit.rules.scalers cites
# the source of each), by parameter name: a parameter added to PolicySettings later is one
# these policies do not take, None in their dict, and breaks none of these rows.
DOCUMENTED_DEFAULTS: dict[str, dict[str, float | int | None]] = {
    "torch": {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5,
              "growth_interval": 2000},
    "apex": {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5,
             "growth_interval": 2000, "min_scale": None, "max_scale": 2.0**24},
    "deepspeed": {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5,
                  "growth_interval": 1000, "hysteresis": 2, "min_scale": 1.0},
    "megatron": {"init_scale": 2.0**32, "growth_factor": 2.0, "backoff_factor": 0.5,
                 "growth_interval": 1000, "hysteresis": 2, "min_scale": 1.0},
    "static": {"init_scale": 2.0**16},
}  # fmt: skip


@pytest.mark.parametrize("policy", list(DOCUMENTED_DEFAULTS))
def test_settings_defaults(policy: str) -> None:
    documented = DOCUMENTED_DEFAULTS[policy]
    s = settings(policy)
    assert {name: getattr(s, name) for name in documented} == documented
    assert {name: s.to_dict()[name] for name in documented} == documented
    # what the policy does not take is None in its dict, whatever else is declared (a
    # parameter added later, and its default where a policy takes it, is that change's test)
    taken = REGISTRY[policy].defaults
    assert set(documented) <= set(taken)
    assert [s.to_dict()[name] for name in PARAMETERS if name not in taken] == [
        None for name in PARAMETERS if name not in taken
    ]


def test_every_policy_has_its_documented_defaults() -> None:
    assert set(DOCUMENTED_DEFAULTS) == set(POLICIES)


def test_settings_overrides_and_none_keeps_default() -> None:
    s = settings("deepspeed", init_scale=2**12, growth_interval=50, hysteresis=None, min_scale=0.25)
    assert (s.init_scale, s.growth_interval, s.hysteresis, s.min_scale) == (4096.0, 50, 2, 0.25)
    assert isinstance(s.init_scale, float)
    assert settings("static", init_scale=128).init_scale == 128.0


def test_to_dict_round_trips() -> None:
    d = settings("torch", growth_interval=7).to_dict()
    # torch's documented defaults with the override; None for what torch does not take
    assert d == {
        **dict.fromkeys(PARAMETERS),
        **DOCUMENTED_DEFAULTS["torch"],
        "policy": "torch",
        "growth_interval": 7,
    }
    for policy in POLICIES:
        s = settings(policy, init_scale=64.0)
        d = s.to_dict()
        assert set(d) == {"policy", *PARAMETERS}
        assert settings(d.pop("policy"), **d) == s


@pytest.mark.parametrize(
    ("policy", "overrides", "message", "flag_message"),
    [
        (
            "torch",
            {"hysteresis": 3},
            "hysteresis does not apply to policy='torch'; it takes init_scale, growth_factor, backoff_factor, growth_interval",
            "--hysteresis does not apply to --policy torch; it takes --init-scale, --growth-factor, --backoff-factor, --growth-interval",
        ),
        (
            "torch",
            {"min_scale": 1.0},
            "min_scale does not apply to policy='torch'",
            "--min-scale does not apply to --policy torch",
        ),
        (
            "apex",
            {"hysteresis": 2},
            "hysteresis does not apply to policy='apex'; it takes init_scale, growth_factor, backoff_factor, growth_interval, min_scale, max_scale",
            "--hysteresis does not apply to --policy apex; it takes --init-scale, --growth-factor, --backoff-factor, --growth-interval, --min-scale, --max-scale",
        ),
        (
            "deepspeed",
            {"max_scale": 2.0**20},
            "max_scale does not apply to policy='deepspeed'; it takes init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale",
            "--max-scale does not apply to --policy deepspeed; it takes --init-scale, --growth-factor, --backoff-factor, --growth-interval, --hysteresis, --min-scale",
        ),
        (
            "megatron",
            {"max_scale": 2.0**20},
            "max_scale does not apply to policy='megatron'",
            "--max-scale does not apply to --policy megatron",
        ),
        (
            "static",
            {"growth_factor": 2.0},
            "growth_factor does not apply to policy='static'; it takes static_scale",
            "--growth-factor does not apply to --policy static; it takes --static-scale",
        ),
    ],
)
def test_settings_rejects_inapplicable(
    policy: str, overrides: dict[str, float], message: str, flag_message: str
) -> None:
    """The library names its parameters; the CLI prints the same error with flags."""
    with pytest.raises(OptionError) as err:
        settings(policy, **overrides)
    text = str(err.value)
    assert text.startswith(message)
    assert err.value.as_flag().startswith(flag_message)
    assert "\n" not in text


@pytest.mark.parametrize(
    ("policy", "overrides", "flag"),
    [
        ("torch", {"init_scale": 0.0}, "--init-scale"),
        ("torch", {"init_scale": -1.0}, "--init-scale"),
        ("apex", {"init_scale": math.inf}, "--init-scale"),
        ("apex", {"init_scale": math.nan}, "--init-scale"),
        ("torch", {"init_scale": 1e39}, "--init-scale"),  # overflows the float32 scale
        ("megatron", {"init_scale": 1e-46}, "--init-scale"),  # rounds to float32 0
        ("static", {"init_scale": 0.0}, "--static-scale"),
        ("torch", {"growth_factor": 1.0}, "--growth-factor"),
        ("deepspeed", {"growth_factor": 0.5}, "--growth-factor"),
        ("torch", {"backoff_factor": 1.0}, "--backoff-factor"),
        ("apex", {"backoff_factor": 0.0}, "--backoff-factor"),
        ("megatron", {"backoff_factor": -0.5}, "--backoff-factor"),
        ("torch", {"growth_interval": 0}, "--growth-interval"),
        ("torch", {"growth_interval": 2.5}, "--growth-interval"),
        ("deepspeed", {"hysteresis": 0}, "--hysteresis"),
        ("megatron", {"hysteresis": True}, "--hysteresis"),
        ("apex", {"min_scale": 0.0}, "--min-scale"),
        ("deepspeed", {"min_scale": -1.0}, "--min-scale"),
        ("apex", {"min_scale": 2.0**25}, "--min-scale"),  # above max_scale 2**24
        (
            "megatron",
            {"init_scale": 2.0, "min_scale": 4.0},
            "--min-scale",
        ),  # Megatron asserts min <= initial
        ("apex", {"max_scale": 0.0}, "--max-scale"),
        ("apex", {"init_scale": "big"}, "--init-scale"),
    ],
)
def test_settings_rejects_invalid(policy: str, overrides: dict[str, object], flag: str) -> None:
    with pytest.raises(OptionError) as err:
        settings(policy, **overrides)  # type: ignore[arg-type]
    text = str(err.value)
    assert text.startswith(flag[2:].replace("-", "_") + " must be ")  # init_scale must be
    assert err.value.as_flag().startswith(flag + " must be ")  # --init-scale must be
    assert "\n" not in text


def test_a_bound_in_the_message_is_worded_as_the_caller_names_it() -> None:
    with pytest.raises(OptionError) as err:
        settings("megatron", init_scale=2.0, min_scale=4.0)
    # Megatron's DynamicGradScaler asserts min_scale <= initial scale
    assert str(err.value) == "min_scale must be <= init_scale (2.0) for policy='megatron', got 4.0"
    assert err.value.as_flag() == (
        "--min-scale must be <= --init-scale (2.0) for --policy megatron, got 4.0"
    )


def test_settings_rejects_unknown_policy_and_parameter() -> None:
    with pytest.raises(OptionError, match=r"^policy must be one of torch, apex, .*got 'fairseq'"):
        settings("fairseq")
    with pytest.raises(TypeError, match="init_scal"):
        settings("torch", init_scal=2.0)


# --- replay_thresholds -----------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_replay_thresholds_equals_replay(policy: str) -> None:
    rng = np.random.default_rng(0)
    n = 400
    threshold = 2.0 ** rng.uniform(0, 20, n)
    threshold[rng.random(n) < 0.3] = math.inf
    s = settings(
        policy, init_scale=2.0**12, **({} if policy == "static" else {"growth_interval": 5})
    )
    got = replay_thresholds(s, threshold)
    want = replay(s, lambda i, scale: scale >= threshold[i], n)
    assert got.scale.tolist() == want.scale.tolist()
    assert got.skipped.tolist() == want.skipped.tolist()
    assert got.scale_after.tolist() == want.scale_after.tolist()
    assert got.aborted_at == want.aborted_at
    assert got.skipped.any()
    assert not got.skipped[np.isinf(threshold)].any()
    assert got.scale.dtype == np.float64
    assert got.skipped.dtype == np.bool_


def test_replay_passes_the_current_scale() -> None:
    # overflow whenever the scale reaches 2**4: torch with window 1 climbs 1, 2, 4, 8, 16, then
    # backs off to 8 and grows again, so it oscillates 8, 16, 8, 16.
    t = replay_thresholds(settings("torch", init_scale=1.0, growth_interval=1), np.full(8, 16.0))
    assert t.scale.tolist() == [1.0, 2.0, 4.0, 8.0, 16.0, 8.0, 16.0, 8.0]
    assert t.skipped.tolist() == [False] * 4 + [True, False, True, False]
    assert replay(settings("torch"), lambda i, s: False, 0).scale.shape == (0,)


def test_a_scaler_parameter_is_declared_once_as_a_field_of_the_settings() -> None:
    from dataclasses import fields

    from fpaudit.cli.options import SimulateArgs, spec
    from fpaudit.rules import scalers
    from fpaudit.rules.simulation import ScalerOverrides

    declared = tuple(f.name for f in fields(PolicySettings))
    assert declared == ("policy", *PARAMETERS)
    # what a policy lacks behaves as a scaler that never changes: static takes none of the
    # factors, intervals or bounds, and keeps its scale through overflows and clean runs
    held = trace("static", set(range(0, 40, 3)), 40, init_scale=1024.0)
    assert set(held.scale.tolist()) == set(held.scale_after.tolist()) == {1024.0}
    assert list(ScalerOverrides().to_dict()) == list(PARAMETERS)
    # simulate has a flag for each, and the static scale; a scale reads as one (2^16)
    options = SimulateArgs.option_names()
    assert set(PARAMETERS) | {scalers.STATIC_SCALE} <= set(options)
    for name in (*scalers.SCALE_PARAMETERS, scalers.STATIC_SCALE):
        assert spec("simulate", name).kind == "scale"


def test_the_two_registries_hold_every_policy_simulate_takes() -> None:
    from fpaudit.cli.options import spec
    from fpaudit.rules import delayed, fp8_policies, scalers

    choices = spec("simulate", "policy").bounds
    assert choices is not None and choices.choices is not None
    assert choices.choices() == (*scalers.REGISTRY, *fp8_policies.REGISTRY)
    assert POLICIES == ("torch", "apex", "deepspeed", "megatron", "static")
    assert delayed.POLICIES == ("te-delayed", "msamp-delayed")
    assert not set(scalers.REGISTRY) & set(fp8_policies.REGISTRY)  # one name, one kind
    # static's one scale is simulate's --static-scale; only torch starts from the run's
    assert {p.name: p.option("init_scale") for p in scalers.REGISTRY.values()}["static"] == (
        "static_scale"
    )
    assert [p.name for p in scalers.REGISTRY.values() if p.recorded] == ["torch"]


def test_no_policy_is_named_outside_the_registry() -> None:
    import re
    from pathlib import Path

    import fpaudit

    package = Path(fpaudit.__file__).parent
    named = re.compile(r"policy(\.name)?\s*[!=]=\s*[\"']")
    found = [
        f"{path.relative_to(package)}:{number}"
        for path in sorted(package.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if named.search(line)
    ]
    assert found == []  # a policy's behaviour is a field of its REGISTRY entry
