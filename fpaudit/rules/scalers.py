"""Exact re-implementations of the dynamic loss-scaler update rules, and a replay.

Each policy reproduces one framework's rule step for step, in that framework's
number precision, so a replay over a recorded overflow pattern gives the scale
the framework would have used at every step. Every policy skips the optimizer
step when the step overflowed (DeepSpeed and Megatron skip even while
hysteresis delays the back-off). Nothing here imports torch.

``torch``
    ``torch.amp.GradScaler``; the update is ``torch._amp_update_scale_``
    (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp; the CUDA kernel in
    aten/src/ATen/native/cuda/AmpKernels.cu also takes double factors). The scale is a
    float32 tensor (``GradScaler._lazy_init_scale_growth_tracker``), but the
    factors arrive as C++ ``double``: ``scale * factor`` is computed in double
    and rounded once to float32. On overflow: scale *= backoff, tracker = 0.
    Otherwise the tracker counts clean steps; on reaching ``growth_interval``
    the scale grows unless that would make it inf, and the tracker resets. No
    floor and no cap: the scale can decay through subnormals to 0.
``apex``
    ``apex.amp`` ``LossScaler.update_scale`` (apex/amp/scaler.py). Python
    floats. On overflow: scale /= 2 (floored at ``min_loss_scale`` if set),
    unskipped = 0; otherwise unskipped += 1. Then, in both cases, when
    unskipped == ``scale_window`` the scale doubles (capped at
    ``max_loss_scale``, default 2**24) and unskipped resets. apex hard-codes
    the factors 2 and 1/2; ``growth_factor`` and ``backoff_factor`` generalise
    them (x * 0.5 == x / 2 exactly, so the defaults are exact).
``deepspeed``
    ``DynamicLossScaler.update_scale`` (deepspeed/runtime/fp16/loss_scaler.py)
    with the defaults of a DeepSpeed ``fp16`` config
    (deepspeed/runtime/precision_config.py: initial_scale_power 16,
    loss_scale_window 1000, hysteresis 2, consecutive_hysteresis false,
    min_loss_scale 1). Python floats. An overflow first spends hysteresis;
    once it is 1, each overflow divides the scale by ``scale_factor`` (floored
    at ``min_scale``). A clean step grows the scale and refills hysteresis when
    (iteration - last overflow iteration) is a multiple of the window.
    DeepSpeed has one ``scale_factor`` for both directions; here the back-off
    is ``scale * backoff_factor``, and the default 0.5 equals DeepSpeed's
    division by 2 exactly. The config does not pass
    ``raise_error_at_min_scale``, so it is True: an overflow that would back
    off while the scale already equals ``min_scale`` raises and ends the run.
    The replay records that step in ``Trajectory.aborted_at`` and carries on
    at the floor, as DeepSpeed does with ``raise_error_at_min_scale=False``.
``megatron``
    ``DynamicGradScaler.update`` (megatron/core/optimizer/grad_scaler.py).
    The scale, factors and floor are float32 tensors, so the arithmetic is
    float32 throughout (no finiteness check: the scale can grow to inf). An
    overflow resets the growth tracker and decrements the hysteresis tracker;
    at or below 0 every overflow backs off (floored at ``min_scale``). Only a
    growth step refills the hysteresis tracker.
``static``
    A constant scale (``init_scale``); overflowing steps are skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from fpaudit.errors import Named, OptionError


def _parameter(*, inert: float | int | None = None, scale: bool = False) -> Any:
    """A loss-scaler parameter of :class:`PolicySettings`: ``inert``, what a policy that
    lacks it behaves as if it had (a scaler that never changes); ``scale``, a value the
    command line reads as a scale (``2^16``)."""
    return field(metadata={"inert": inert, "scale": scale})


@dataclass(frozen=True)
class PolicySettings:
    """One policy with every parameter resolved; make one with :func:`settings`.

    Its fields after ``policy`` declare the loss-scaler parameters, once: ``PARAMETERS``,
    the inert values, ``simulate``'s overrides and its flags are read from them.
    Parameters the policy does not have hold inert values (factors 1.0, interval and
    hysteresis 1, no bounds) and are ``None`` in :meth:`to_dict`.
    """

    policy: str
    init_scale: float = _parameter(scale=True)  # every policy has one: no inert value
    growth_factor: float = _parameter(inert=1.0)
    backoff_factor: float = _parameter(inert=1.0)
    growth_interval: int = _parameter(inert=1)
    hysteresis: int = _parameter(inert=1)
    min_scale: float | None = _parameter(scale=True)
    max_scale: float | None = _parameter(scale=True)

    def to_dict(self) -> dict[str, Any]:
        """``policy`` plus every name in PARAMETERS; ``None`` where it does not apply.

        ``settings(d["policy"], **rest)`` rebuilds the same settings.
        """
        applies = REGISTRY[self.policy].defaults
        out: dict[str, Any] = {"policy": self.policy}
        for name in PARAMETERS:
            out[name] = getattr(self, name) if name in applies else None
        return out


_DECLARED = fields(PolicySettings)[1:]
PARAMETERS: tuple[str, ...] = tuple(item.name for item in _DECLARED)
SCALE_PARAMETERS: tuple[str, ...] = tuple(item.name for item in _DECLARED if item.metadata["scale"])
# What a policy that lacks a parameter behaves as if it had: a scaler that never changes.
_INERT: dict[str, Any] = {item.name: item.metadata["inert"] for item in _DECLARED[1:]}
_FP32_MAX = float(np.finfo(np.float32).max)


def settings(policy: str, **overrides: float | int | None) -> PolicySettings:
    """The policy's defaults with ``overrides`` applied (``None`` keeps the default).

    Raises OptionError, one line naming the parameter, for a parameter the policy
    does not take or a value out of range.
    """
    entry = REGISTRY.get(policy)
    if entry is None:
        raise OptionError("policy", f"must be one of {', '.join(POLICIES)}, got {policy!r}")
    unknown = sorted(set(overrides) - set(PARAMETERS))
    if unknown:
        raise TypeError(f"settings() got unknown parameter(s) {', '.join(unknown)}")
    defaults = entry.defaults
    values: dict[str, Any] = {**_INERT, **defaults}
    for name, value in overrides.items():
        if value is None:
            continue
        if name not in defaults:
            takes = [entry.option(p) for p in defaults]
            takes_named: list[str | Named] = [part for p in takes for part in (", ", Named(p))]
            raise OptionError(
                entry.option(name),
                "does not apply to ",
                Named("policy", policy),
                "; it takes ",
                *takes_named[1:],
            )
        values[name] = value
    for check in entry.checks:
        check(entry, values)
    return PolicySettings(policy=policy, **values)


# -- each policy's validation: checks of the values (the policy's defaults with the
# overrides), in place, raising an OptionError that names the parameter as its option.


def _bad(entry: Policy, v: dict[str, Any], name: str, *need: str | Named) -> OptionError:
    return OptionError(entry.option(name), "must be ", *need, f", got {v[name]!r}")


def _number(entry: Policy, v: dict[str, Any], name: str) -> float:
    value = v[name]
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise _bad(entry, v, name, "a number")
    return float(value)


def _check_scale(entry: Policy, v: dict[str, Any]) -> None:
    """Every policy: whole intervals, and an initial scale a scaler can hold."""
    for name in ("growth_interval", "hysteresis"):
        value = v[name]
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise _bad(entry, v, name, "a whole number >= 1")
        v[name] = int(value)
    init = v["init_scale"] = _number(entry, v, "init_scale")
    if not (math.isfinite(init) and init > 0):
        raise _bad(entry, v, "init_scale", "a finite number > 0")
    if entry.float32_scale and not (_f32(init) > 0 and init <= _FP32_MAX):
        raise _bad(
            entry, v, "init_scale", "within float32 range, where ",
            Named("policy", entry.name), " keeps the scale",
        )  # fmt: skip


def _check_dynamic(entry: Policy, v: dict[str, Any]) -> None:
    """A dynamic scaler: it grows, backs off, and stays within its bounds."""
    growth = v["growth_factor"] = _number(entry, v, "growth_factor")
    if not (math.isfinite(growth) and growth > 1):
        raise _bad(entry, v, "growth_factor", "a finite number > 1")
    backoff = v["backoff_factor"] = _number(entry, v, "backoff_factor")
    if not 0 < backoff < 1:
        raise _bad(entry, v, "backoff_factor", "between 0 and 1 (exclusive)")
    if v["max_scale"] is not None:
        top = v["max_scale"] = _number(entry, v, "max_scale")
        if not top > 0:
            raise _bad(entry, v, "max_scale", "> 0")
    if v["min_scale"] is not None:
        low = v["min_scale"] = _number(entry, v, "min_scale")
        if not (math.isfinite(low) and low > 0):
            raise _bad(entry, v, "min_scale", "a finite number > 0")
        if v["max_scale"] is not None and low > v["max_scale"]:
            raise _bad(entry, v, "min_scale", "<= ", Named("max_scale"), f" ({v['max_scale']!r})")


def _check_floor_below_start(entry: Policy, v: dict[str, Any]) -> None:
    """Megatron's DynamicGradScaler asserts its floor is at most its initial scale."""
    init, low = v["init_scale"], v["min_scale"]
    if low is not None and low > init:
        raise _bad(
            entry, v, "min_scale", "<= ", Named("init_scale"), f" ({init!r}) for ",
            Named("policy", entry.name),
        )  # fmt: skip


def _f32(x: float) -> float:
    """Round a double to float32 (to nearest even; overflow gives inf, underflow 0)."""
    with np.errstate(over="ignore", under="ignore"):
        return float(np.float32(x))


class Scaler:
    """A live loss scaler: ``scale`` is the scale in force for the next step.

    ``aborted`` turns True at the first update where the framework itself
    would have stopped the run (only DeepSpeed does so).
    """

    def __init__(self, s: PolicySettings) -> None:
        self.settings = s
        self.scale: float = s.init_scale
        self.aborted = False

    def update(self, found_inf: bool) -> None:
        """The static policy: the scale never changes."""


class _TorchScaler(Scaler):
    def __init__(self, s: PolicySettings) -> None:
        super().__init__(s)
        self.scale = _f32(s.init_scale)  # torch.full((), init_scale, dtype=torch.float32)
        self.growth_tracker = 0

    def update(self, found_inf: bool) -> None:
        s = self.settings
        if found_inf:
            self.scale = _f32(self.scale * s.backoff_factor)  # float * double -> float
            self.growth_tracker = 0
            return
        successful = self.growth_tracker + 1
        if successful == s.growth_interval:
            grown = _f32(self.scale * s.growth_factor)
            if math.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0
        else:
            self.growth_tracker = successful


class _ApexScaler(Scaler):
    def __init__(self, s: PolicySettings) -> None:
        super().__init__(s)
        self.unskipped = 0

    def update(self, found_inf: bool) -> None:
        s = self.settings
        if found_inf:
            self.scale *= s.backoff_factor
            if s.min_scale is not None:
                self.scale = max(s.min_scale, self.scale)
            self.unskipped = 0
        else:
            self.unskipped += 1
        if self.unskipped == s.growth_interval:
            grown = self.scale * s.growth_factor
            self.scale = grown if s.max_scale is None else min(s.max_scale, grown)
            self.unskipped = 0


class _DeepSpeedScaler(Scaler):
    def __init__(self, s: PolicySettings) -> None:
        super().__init__(s)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = s.hysteresis

    def update(self, found_inf: bool) -> None:
        s = self.settings
        floor = 0.0 if s.min_scale is None else s.min_scale
        if found_inf:
            if s.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.scale == floor:  # DeepSpeed raises here (raise_error_at_min_scale)
                    self.aborted = True
                self.scale = max(self.scale * s.backoff_factor, floor)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % s.growth_interval == 0:
            self.cur_hysteresis = s.hysteresis
            self.scale *= s.growth_factor
        self.cur_iter += 1


class _MegatronScaler(Scaler):
    def __init__(self, s: PolicySettings) -> None:
        super().__init__(s)
        self.scale = _f32(s.init_scale)
        self.growth = _f32(s.growth_factor)
        self.backoff = _f32(s.backoff_factor)
        self.floor = _f32(0.0 if s.min_scale is None else s.min_scale)
        self.growth_tracker = 0
        self.hysteresis_tracker = s.hysteresis

    def update(self, found_inf: bool) -> None:
        # Both operands are float32 values, so one rounding of the exact product
        # is float32 multiplication.
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(_f32(self.scale * self.backoff), self.floor)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.settings.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.settings.hysteresis
                self.scale = _f32(self.scale * self.growth)


Check = Callable[["Policy", dict[str, Any]], None]
INIT_SCALE = "init_scale"
STATIC_SCALE = "static_scale"  # simulate's option: the static scale every replay is compared with


@dataclass(frozen=True)
class Policy:
    """A policy ``simulate`` replays, declared once: for a loss scaler, the parameters it
    takes with their defaults (those it lacks hold inert values, see ``_INERT``), the
    class that replays its update rule, the checks its values must pass, the option that
    sets its initial scale (``static`` has one scale: the static scale every replay is
    compared with), whether it keeps its scale in a float32 (then ``init_scale`` must fit
    one) and whether a replay starts from the scaler a run recorded (torch's GradScaler).
    Adding a policy is one entry in ``REGISTRY``; ``simulate --help`` lists it. FP8
    delayed scaling is no loss scaler: its policies have a registry of their own
    (:mod:`fpaudit.rules.fp8_policies`)."""

    name: str
    defaults: Mapping[str, float | int | None]
    scaler: type[Scaler]
    checks: tuple[Check, ...] = (_check_scale, _check_dynamic)
    scale_option: str = INIT_SCALE
    float32_scale: bool = False
    recorded: bool = False

    @property
    def is_static(self) -> bool:
        """Its one scale is the static scale every replay is compared with (``static``)."""
        return self.scale_option == STATIC_SCALE

    def option(self, name: str) -> str:
        """The parameter ``name`` as messages and flags name it for this policy."""
        return self.scale_option if name == INIT_SCALE else name


REGISTRY: dict[str, Policy] = {
    policy.name: policy
    for policy in (
        Policy(
            "torch",
            {
                "init_scale": 2.0**16,
                "growth_factor": 2.0,
                "backoff_factor": 0.5,
                "growth_interval": 2000,
            },
            _TorchScaler,
            float32_scale=True,
            recorded=True,
        ),
        Policy(
            "apex",
            {
                "init_scale": 2.0**16,
                "growth_factor": 2.0,
                "backoff_factor": 0.5,
                "growth_interval": 2000,
                "min_scale": None,
                "max_scale": 2.0**24,
            },
            _ApexScaler,
        ),
        Policy(
            "deepspeed",
            {
                "init_scale": 2.0**16,
                "growth_factor": 2.0,
                "backoff_factor": 0.5,
                "growth_interval": 1000,
                "hysteresis": 2,
                "min_scale": 1.0,
            },
            _DeepSpeedScaler,
        ),
        Policy(
            "megatron",
            {
                "init_scale": 2.0**32,
                "growth_factor": 2.0,
                "backoff_factor": 0.5,
                "growth_interval": 1000,
                "hysteresis": 2,
                "min_scale": 1.0,
            },
            _MegatronScaler,
            checks=(_check_scale, _check_dynamic, _check_floor_below_start),
            float32_scale=True,
        ),
        Policy("static", {"init_scale": 2.0**16}, Scaler, (_check_scale,), STATIC_SCALE),
    )
}
POLICIES: tuple[str, ...] = tuple(REGISTRY)
POLICY_PARAMETERS: dict[str, tuple[str, ...]] = {
    name: tuple(policy.defaults) for name, policy in REGISTRY.items()
}


def make_scaler(s: PolicySettings) -> Scaler:
    """A fresh scaler in its initial state."""
    scaler = REGISTRY[s.policy].scaler
    assert scaler is not None  # settings() made s: a loss scaler's
    return scaler(s)


@dataclass(frozen=True)
class Trajectory:
    """What a scaler did over a replay, one entry per step."""

    scale: np.ndarray  # float64: the scale in force at each step
    skipped: np.ndarray  # bool: the step overflowed, so the optimizer step was skipped
    scale_after: np.ndarray  # float64: the scale after that step's update
    aborted_at: int | None = None  # first step at which the framework would have ended the run


def replay(s: PolicySettings, overflows: Callable[[int, float], bool], steps: int) -> Trajectory:
    """Run a fresh scaler for ``steps`` steps; ``overflows(i, scale)``: does step i overflow?"""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    scaler = make_scaler(s)
    scale = np.empty(steps, dtype=np.float64)
    skipped = np.empty(steps, dtype=bool)
    after = np.empty(steps, dtype=np.float64)
    aborted_at: int | None = None
    for i in range(steps):
        scale[i] = current = scaler.scale
        skipped[i] = found = bool(overflows(i, current))
        scaler.update(found)
        after[i] = scaler.scale
        if aborted_at is None and scaler.aborted:
            aborted_at = i
    return Trajectory(scale=scale, skipped=skipped, scale_after=after, aborted_at=aborted_at)


def replay_thresholds(s: PolicySettings, threshold: np.ndarray) -> Trajectory:
    """Replay where step i overflows iff the scale is >= ``threshold[i]`` (+inf: never)."""
    limits = np.asarray(threshold, dtype=np.float64).reshape(-1).tolist()
    return replay(s, lambda i, scale: scale >= limits[i], len(limits))
