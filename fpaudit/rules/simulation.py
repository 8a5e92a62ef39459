"""Replay a loss-scaler policy over the steps of a report: ``fpaudit simulate``.

Each step ``i`` gets an *overflow threshold* ``T[i]``: the step overflows at
any scale ``S >= T[i]``. It comes from two sources:

* **amax**: the largest unscaled backward value in scope (captured steps) or
  the largest unscaled parameter gradient (``grad_amax``, every step of an
  ``fpaudit run``). A value ``x`` overflows the format when ``|x| * S``
  reaches the format's overflow edge (65520 for fp16), so the estimate is
  ``edge / amax``. A parameter gradient is a lower bound of the backward
  values, so this estimate can only be too high (too optimistic).
* **what the run saw**: an ``fpaudit run`` (or a live ``scan --amp``) knows
  whether each step really overflowed at the scale it ran under, ``S_real``.
  A skipped step has ``T <= S_real``; a clean one ``T > S_real``. The
  estimate is clamped to agree, so at the real scales the replay sees exactly
  the real overflow events; replaying the run's own policy reproduces its
  scale trajectory step for step.

Underflow per step is measured on captured steps only: the fraction of
nonzero in-scope values that round to zero at the step's scale (at a scale
that is not a power of two, at the power of two below it: an upper bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from fpaudit.numerics.formats import Format
from fpaudit.report.data import ReportData
from fpaudit.report.tables import Records, Steps
from fpaudit.rules import analysis, scalers
from fpaudit.rules.recommendation import recommend
from fpaudit.rules.skips import ReplayedSkip, replayed_skip_origins, scaler_rank

SOURCE_OBSERVED = "observed"  # the threshold was pinned by what the run saw
SOURCE_AMAX = "amax"  # estimated from the step's amax
SOURCE_NONE = "unknown"  # neither: the step never overflows in the replay


class ScalerOverrides:
    """The scaler settings a replay changes (``fpaudit simulate``'s flags), by the names
    :data:`fpaudit.rules.scalers.PARAMETERS` declares; ``None`` keeps the policy's (or,
    for a policy that starts from the recorded scaler, the run's) own. Immutable."""

    __slots__ = ("_given",)
    _given: dict[str, float | int]

    def __init__(self, **settings: float | int | None) -> None:
        unknown = sorted(set(settings) - set(scalers.PARAMETERS))
        if unknown:
            raise TypeError(f"ScalerOverrides() got unknown setting(s) {', '.join(unknown)}")
        given = {name: value for name in scalers.PARAMETERS
                 if (value := settings.get(name)) is not None}  # fmt: skip
        object.__setattr__(self, "_given", given)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"ScalerOverrides is immutable: cannot set {name!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ScalerOverrides) and self._given == other._given

    def __hash__(self) -> int:
        return hash(tuple(self._given.items()))

    def __repr__(self) -> str:
        return f"ScalerOverrides({', '.join(f'{k}={v!r}' for k, v in self._given.items())})"

    def to_dict(self) -> dict[str, float | int | None]:
        """Every setting by name, ``None`` included, in PARAMETERS' order (a policy that
        does not take one is told so about the first)."""
        return {name: self._given.get(name) for name in scalers.PARAMETERS}

    @property
    def given(self) -> dict[str, float | int]:
        """The settings that are set."""
        return dict(self._given)


NO_OVERRIDES = ScalerOverrides()  # every setting the policy's own


@dataclass(frozen=True)
class Thresholds:
    steps: np.ndarray  # int: the report's step numbers
    threshold: np.ndarray  # float64: overflow at any scale >= this (inf: never)
    source: list[str]
    real_scale: np.ndarray  # float64: the scale the step ran under
    real_skipped: np.ndarray  # bool


def observed(report: ReportData) -> bool:
    """Do the report's skips tell real overflow in low precision? (run, or a live scan)"""
    info = report.info
    return info.command == "run" or bool(info.amp_dtype)


def thresholds(report: ReportData, fmt: Format, scope: analysis.Scope) -> Thresholds:
    """The overflow threshold of every step of ``report`` (see the module docstring)."""
    steps = report.steps  # several ranks share one scaler trajectory (DDP): take the first's
    steps = steps[steps[Steps.rank] == scaler_rank(steps)].sort_values(Steps.step, kind="stable")
    index = steps[Steps.step].to_numpy(dtype=np.int64)
    real_scale = steps[Steps.loss_scale].to_numpy(dtype=np.float64)
    skipped = steps[Steps.skipped].to_numpy(dtype=bool) | (
        steps[Steps.nonfinite_grads].to_numpy(dtype=np.int64) > 0
    )
    amax = steps[Steps.grad_amax].to_numpy(dtype=np.float64).copy()
    amax[~np.isfinite(amax)] = np.nan
    records = scope.select(report.records)
    records = records[records[Records.scales_with_loss]]
    if not records.empty:
        unscaled = records[Records.amax] / records[Records.loss_scale]
        per_step = unscaled.groupby(records[Records.step]).max()
        position = {step: i for i, step in enumerate(index)}
        for step, value in per_step.items():
            i = position.get(int(step))
            if i is not None and value > 0:
                amax[i] = max(value, amax[i]) if not math.isnan(amax[i]) else value
    edge = fmt.overflow_edge
    with np.errstate(divide="ignore", invalid="ignore"):
        estimate = np.where(amax > 0, edge / amax, np.inf)
    estimate[np.isnan(amax)] = np.nan
    threshold = np.empty(len(index))
    source: list[str] = []
    seen = observed(report)
    for i in range(len(index)):
        guess = estimate[i]
        if seen and skipped[i]:
            threshold[i] = real_scale[i] if math.isnan(guess) else min(guess, real_scale[i])
            source.append(SOURCE_OBSERVED)
        elif seen:
            above = math.nextafter(real_scale[i], math.inf)
            if math.isnan(guess):
                threshold[i] = math.inf
                source.append(SOURCE_NONE)
            else:
                threshold[i] = max(guess, above)
                source.append(SOURCE_AMAX if guess >= above else SOURCE_OBSERVED)
        elif math.isnan(guess):
            threshold[i] = math.inf
            source.append(SOURCE_NONE)
        else:
            threshold[i] = guess
            source.append(SOURCE_AMAX)
    return Thresholds(index, threshold, source, real_scale, skipped)


@dataclass(frozen=True)
class RunSummary:
    """What one replay comes to: its skips, the range of its scale, its underflow. The
    JSON keys are the fields' names, in field order (``settings`` as the policy's own)."""

    policy: str
    settings: scalers.PolicySettings
    skipped: int
    skipped_steps: tuple[int, ...]
    final_scale: float | None  # None: no steps
    min_scale: float | None
    max_scale: float | None
    underflow_fraction: float
    aborted_at: int | None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {item.name: getattr(self, item.name) for item in fields(self)}
        out["settings"] = self.settings.to_dict()
        out["skipped_steps"] = list(self.skipped_steps)
        return out


@dataclass
class Run:
    """One policy's replay: scales, skips and underflow per step."""

    name: str
    settings: scalers.PolicySettings
    trajectory: scalers.Trajectory
    underflow: np.ndarray  # float64 per step: underflow fraction at its scale (NaN: not captured)
    underflow_count: int = 0  # over captured steps, at their scales
    nonzero: int = 0

    @property
    def underflow_fraction(self) -> float:
        return self.underflow_count / self.nonzero if self.nonzero else 0.0

    def summary(self) -> RunSummary:
        t = self.trajectory
        skipped = np.flatnonzero(t.skipped)
        return RunSummary(
            policy=self.name,
            settings=self.settings,
            skipped=len(skipped),
            skipped_steps=tuple(int(s) for s in skipped),
            final_scale=float(t.scale_after[-1]) if len(t.scale_after) else None,
            min_scale=float(t.scale.min()) if len(t.scale) else None,
            max_scale=float(t.scale.max()) if len(t.scale) else None,
            underflow_fraction=self.underflow_fraction,
            aborted_at=t.aborted_at,
        )


@dataclass
class Simulation:
    format: str
    thresholds: Thresholds
    policy: Run
    static: Run
    notes: list[str] = field(default_factory=list)
    # per skip of the replayed policy, what overflowed there where the report shows it
    skip_origins: list[ReplayedSkip] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        t = self.thresholds
        rows = []
        for i, step in enumerate(t.steps):
            rows.append(
                {
                    "step": int(step),
                    "threshold": _json_float(t.threshold[i]),
                    "threshold_source": t.source[i],
                    "real_scale": float(t.real_scale[i]),
                    "real_skipped": bool(t.real_skipped[i]),
                    "scale": float(self.policy.trajectory.scale[i]),
                    "skipped": bool(self.policy.trajectory.skipped[i]),
                    "underflow_fraction": _json_float(self.policy.underflow[i]),
                    "static_skipped": bool(self.static.trajectory.skipped[i]),
                    "static_underflow_fraction": _json_float(self.static.underflow[i]),
                }
            )
        return {
            "format": self.format,
            "policy": self.policy.summary().to_dict(),
            "static": self.static.summary().to_dict(),
            "notes": self.notes,
            "skip_origins": [skip.to_dict() for skip in self.skip_origins],
            "steps": rows,
        }


def _json_float(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def _underflow(
    report: ReportData, fmt: Format, scope: analysis.Scope, steps: np.ndarray, scale: np.ndarray
) -> tuple[np.ndarray, int, int]:
    """Per step, the underflow fraction at its scale (captured steps; NaN elsewhere), of the
    values the scale answers for (``analysis``'s ``judged_underflow``, as ``gate`` judges)."""
    fractions = np.full(len(steps), np.nan)
    if report.records.empty:
        return fractions, 0, 0
    condensed = analysis.condense(report, scope, (Records.step,))
    if condensed.groups.empty:
        return fractions, 0, 0
    row_of = {int(s): i for i, s in enumerate(condensed.groups[Records.step])}
    log2 = np.array([math.floor(math.log2(s)) if s > 0 else -150 for s in scale])
    log2 = np.clip(log2, -149, 127)
    underflow = nonzero = 0
    for k in np.unique(log2):
        table = condensed.at(fmt, int(k))
        for i in np.flatnonzero(log2 == k):
            row = row_of.get(int(steps[i]))
            if row is None:
                continue
            n = int(table["nonzero"].iloc[row])
            u = int(table["judged_underflow"].iloc[row])
            fractions[i] = u / n if n else 0.0
            underflow += u
            nonzero += n
    return fractions, underflow, nonzero


def default_settings(report: ReportData, policy: str) -> dict[str, float]:
    """The real scaler's settings where the report recorded them (torch policy only)."""
    recorded = report.info.scaler
    if not scalers.REGISTRY[policy].recorded or recorded is None:
        return {}
    return {
        "init_scale": recorded.init_scale,
        "growth_factor": recorded.growth_factor,
        "backoff_factor": recorded.backoff_factor,
        "growth_interval": recorded.growth_interval,
    }


def simulate(
    report: ReportData,
    fmt: Format,
    policy: str = "torch",
    overrides: ScalerOverrides = NO_OVERRIDES,
    static_scale: float | None = None,
    *,
    headroom_bits: int = 4,
) -> Simulation:
    """Replay ``policy`` (with ``overrides``) and a static scale over ``report``'s steps."""
    if report.steps.empty:
        from fpaudit.errors import ReportError

        raise ReportError("the report has no steps to replay")
    given = overrides.given
    resolved = scalers.settings(policy, **{**default_settings(report, policy), **given})
    scope = analysis.default_scope(report)
    limits = thresholds(report, fmt, scope)
    notes: list[str] = []
    if static_scale is None:
        rec = recommend(report, fmt, headroom_bits)
        static_scale = rec.scale if rec.scale is not None else resolved.init_scale
        if scalers.REGISTRY[policy].is_static and "init_scale" not in given:  # one, not two
            resolved = scalers.settings(policy, init_scale=static_scale)
        notes.append(
            f"static scale: the recommended one for {fmt.name} ({headroom_bits} headroom bits)"
            if rec.scale is not None
            else "static scale: the policy's initial scale (no recommendation: no values)"
        )
    static = scalers.settings("static", init_scale=static_scale)
    runs = []
    for name, chosen in ((policy, resolved), ("static", static)):
        trajectory = scalers.replay_thresholds(chosen, limits.threshold)
        fractions, under, nonzero = _underflow(report, fmt, scope, limits.steps, trajectory.scale)
        runs.append(Run(name, chosen, trajectory, fractions, under, nonzero))
    unknown = limits.source.count(SOURCE_NONE)
    if unknown:
        notes.append(
            f"{unknown} step(s) had no amax and no observed overflow: they never overflow here"
        )
    if not observed(report):
        notes.append(
            "overflow is estimated from amax (the report did not run in low precision): "
            "values that would overflow only inside a low-precision op are not seen"
        )
    replayed = runs[0].trajectory
    skipped = np.flatnonzero(replayed.skipped)
    origins = replayed_skip_origins(
        report,
        fmt,
        scope,
        [int(limits.steps[i]) for i in skipped],
        [replayed.scale[i] for i in skipped],
    )
    return Simulation(fmt.name, limits, runs[0], runs[1], notes, origins)
