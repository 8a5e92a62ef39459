"""``fpaudit fp16-plan``: the smallest set of modules to keep out of fp16, a scale, proof.

From an fp32 scan (forward and backward recorded), per module: the largest forward
value and the largest backward value that scales with the loss (unscaled). With
headroom ``H`` bits, a module's values fit fp16 at scale ``S`` when

    forward_amax <= 65504 / 2**H   and   backward_amax * S <= 65504 / 2**H

(forward values do not move with S). This criterion is per module: whether a
module passes depends on its own values only, so at a given S the modules that
fail it are exactly the ones that must leave fp16, and keeping out just those is
the smallest set (any smaller set leaves a failing module in; a greedy pass over
modules by amax picks the same set). The set only grows with S, so the plan takes
the smallest power-of-two S whose underflow (of the backward values left in fp16
that scale with the loss) is within ``--max-underflow``, and then the largest S
that keeps that same set (more room below, the same modules). Where no S short
of keeping the whole model out meets the limit, it takes ``recommend``'s scale
and says so.

The plan is then *verified by running it* (``fpaudit.run.verify``): one fp32 step
against one fp16-autocast step at S with those modules' forward run with autocast
disabled on fp32 inputs (:func:`fpaudit.run.verify.keep_out_of_autocast`), reporting whether the
step is finite, the fraction of gradient elements lost, and whether every
parameter that changes in fp32 changes. The fp32 scan cannot tell which values
autocast holds in fp16, so the criterion can name modules whose large values
autocast keeps in fp32 anyway (a norm's variance); each candidate, broadest
first, is dropped when the step still verifies without it. The result is minimal
for the verification: no single module of it can be returned to fp16.

``growth_interval``: a GradScaler that grows every N clean steps and backs off on
the first overflow pays for each growth attempt that overflows with one skipped
step, and attempts at most once per N + 1 steps (N clean steps, then the step at
the grown scale). Whatever the overflow rate at the grown scale, growth attempts
so skip at most 1/(N + 1) of the steps; the rule takes the smallest N that keeps
this strictly below ``TARGET_SKIP_RATE`` = 0.05%: N = floor(1 / 0.0005) = 2000
(1/2001 = 0.04998%), torch's default. A shorter interval would need the overflow
rate at every scale the scaler can climb to known small, which a scan of a few
steps cannot show: with none of n scanned steps overflowing, the rule of three
bounds the per-step rate only by 3/n (75% for n = 4). The scan's overflow rate at
2S (``r``, the fraction of scanned steps whose kept backward amax times 2S passes
65504) refines the prediction: the cycle is N clean steps and about 1/r at 2S,
so growth skips ``1 / (N + 1/r)`` of the steps.

The plan's headroom (default 1 bit, over the modules left in fp16, checked by a
verifying step) differs from ``scan``/``recommend``'s (4 bits, every module, no
step run): the plan carries both scales (``recommended_log2_scale``) and says why
they differ.

Known limitations: the fp32 scan does not know which values autocast keeps in
fp32; forward values count whatever their dtype would be, backward values that
do not scale with the loss (computed from saved forward values, usually in fp32)
do not limit the plan; interactions between modules (a kept-out module's output
cast back to fp16 downstream) are left to the verification.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from fpaudit import defaults
from fpaudit.errors import OptionError, UsageError
from fpaudit.numerics.formats import Format, get_format
from fpaudit.numerics.limits import DEFAULT_HEADROOM_BITS as RECOMMEND_HEADROOM_BITS
from fpaudit.report.records import KIND_BACKWARD, KIND_FORWARD, LOSS_MODULE
from fpaudit.report.store import Report
from fpaudit.rules import analysis, origins
from fpaudit.rules.recommendation import LEAST_UNDERFLOW, LimitedBy, UnscalableOp, recommend

# declared once in fpaudit.defaults (4 steps, 1 bit of headroom, 0.001)
DEFAULT_STEPS = defaults.FP16_PLAN_STEPS
DEFAULT_HEADROOM_BITS = defaults.FP16_PLAN_HEADROOM_BITS
DEFAULT_MAX_UNDERFLOW = defaults.FP16_PLAN_MAX_UNDERFLOW
MAX_GROWTH_INTERVAL = 2000  # torch.amp.GradScaler's default
TARGET_SKIP_RATE = 0.0005  # growth attempts skip fewer than 0.05% of the steps
_LOG2_RANGE = range(-24, 64)


@dataclass(frozen=True)
class ModuleRange:
    module: str
    forward_amax: float  # largest forward value (finfo sentinels aside)
    backward_amax: float  # largest backward value that scales with the loss, unscaled


def module_ranges(report: Report) -> pd.DataFrame:
    """Per module: ``forward_amax`` and unscaled ``backward_amax`` (loss-scaled values)."""
    records = report.records[report.records["module"] != LOSS_MODULE]
    records = records[~origins.is_sentinel(records["amax"])]  # finfo sentinels (masks)
    forward = records[records["kind"] == KIND_FORWARD].groupby("module")["amax"].max()
    scaled = records[(records["kind"] == KIND_BACKWARD) & records["scales_with_loss"]]
    unscaled = scaled["amax"] / scaled["loss_scale"]
    backward = unscaled.groupby(scaled["module"]).max()
    modules = [m for m in report.info.modules if m in set(forward.index) | set(backward.index)]
    return pd.DataFrame(
        {
            "module": modules,
            "forward_amax": [float(forward.get(m, 0.0)) for m in modules],
            "backward_amax": [float(backward.get(m, 0.0)) for m in modules],
        }
    )


def failing(ranges: pd.DataFrame, limit: float, scale: float) -> list[str]:
    """The modules whose values do not fit under ``limit`` at ``scale``."""
    bad = (ranges["forward_amax"] > limit) | (ranges["backward_amax"] * scale > limit)
    return [str(m) for m in ranges.loc[bad, "module"]]


def _underflow(report: Report, fmt: Format, log2_scale: int, kept_out: set[str]) -> float:
    """Underflow at ``2**log2_scale`` of the backward values in the modules left in fp16,
    judged as ``recommend`` and ``gate`` judge them (``judged_underflow`` of
    :mod:`fpaudit.rules.analysis`: values that underflow at every scale are counted apart)."""
    table = analysis.module_table(report, fmt, log2_scale, scope=analysis.default_scope(report))
    table = table[~table["module"].isin(kept_out)]
    nonzero = int(table["nonzero"].sum())
    return int(table["judged_underflow"].sum()) / nonzero if nonzero else 0.0


def overflow_rate(
    report: Report, fmt: Format, scale: float, kept_out: set[str]
) -> tuple[float, int]:
    """The fraction of scanned steps in which a kept module's backward value overflows at
    ``scale`` (0 when none does: then the rule of three bounds the true rate by 3/n),
    and the number of steps."""
    records = report.records
    scaled = records[
        (records["kind"] == KIND_BACKWARD)
        & records["scales_with_loss"]
        & (records["module"] != LOSS_MODULE)
        & ~records["module"].isin(kept_out)
    ]
    steps = max(1, report.steps["step"].nunique())
    per_step = (scaled["amax"] / scaled["loss_scale"]).groupby(scaled["step"]).max()
    overflowing = int((per_step * scale > fmt.max_finite).sum())
    return overflowing / steps, steps


def growth_interval(target_skip_rate: float = TARGET_SKIP_RATE) -> int:
    """The smallest N whose growth attempts skip fewer than ``target_skip_rate`` of the
    steps whatever the overflow rate at the grown scale: 1/(N + 1) < p, so N = floor(1/p)
    (0.0005 -> 2000), at most torch's default."""
    if not 0 < target_skip_rate <= 1:
        raise ValueError("target_skip_rate must be in (0, 1]")
    return int(min(MAX_GROWTH_INTERVAL, max(1, math.floor(1.0 / target_skip_rate))))


def growth_skip_rate(interval: int, rate_at_2s: float) -> float:
    """The fraction of steps growth attempts skip: one skip per cycle of ``interval``
    clean steps and about ``1 / rate_at_2s`` steps at the grown scale. With no overflow
    seen at 2S the scaler climbs past it to a scale that may overflow every step: the
    bound ``1 / (interval + 1)``."""
    if rate_at_2s <= 0:
        return 1.0 / (interval + 1)
    return 1.0 / (interval + 1.0 / min(rate_at_2s, 1.0))


@dataclass
class Fp16Plan:
    model_file: str
    format: str
    headroom_bits: int
    max_underflow: float
    log2_scale: int | None  # None: no scale meets the underflow limit
    keep_out: list[str]
    ranges: list[ModuleRange]  # of the kept-out modules
    underflow_fraction: float
    overflow_rate_at_2s: float
    steps: int
    growth_interval: int
    verification: Any = None  # fpaudit.run.verify.Verification
    notes: list[str] = field(default_factory=list)
    candidates: list[str] = field(default_factory=list)  # the criterion's set, before pruning
    # scan/recommend's scale for the same report (every module in fp16, its own headroom)
    recommended_log2_scale: int | None = None
    recommended_headroom_bits: int = 0
    recommended_limiting_module: str | None = None
    recommended_limited_by: LimitedBy | None = None  # the rule's reason
    # values that over/underflow fp16 at every scale (no scale fixes them), by node and op
    unscalable_overflow: int = 0
    unscalable_underflow: int = 0
    unscalable: list[UnscalableOp] = field(default_factory=list)

    @property
    def predicted_skip_rate(self) -> float:
        """The fraction of steps growth attempts skip (:func:`growth_skip_rate`)."""
        return growth_skip_rate(self.growth_interval, self.overflow_rate_at_2s)

    def scales_differ_because(self) -> str | None:
        """Why this plan's scale is not scan/recommend's, in plain words (None: the same)."""
        if self.recommended_log2_scale is None or self.log2_scale is None:
            return None
        if self.recommended_log2_scale == self.log2_scale:
            return None
        reasons = []
        if self.recommended_limited_by == LEAST_UNDERFLOW:
            reasons.append(
                "recommend takes the smallest S that loses no more values than the largest its "
                "headroom allows, this plan the largest that keeps the same modules in fp16"
            )
        if self.recommended_headroom_bits != self.headroom_bits:
            reasons.append(
                f"recommend keeps {self.recommended_headroom_bits} bits of headroom below "
                f"65504, this plan {self.headroom_bits} (the verifying step checks it)"
            )
        set_apart = self.candidates or self.keep_out
        if self.recommended_limiting_module in set_apart:
            pruned = sorted(set(set_apart) - set(self.keep_out))
            how = "kept out of fp16" if not pruned else (
                "kept out of fp16, or shown by the verifying step to fit: autocast runs "
                "their large values in fp32"
            )  # fmt: skip
            reasons.append(
                f"recommend's S is limited by {self.recommended_limiting_module}, one of the "
                f"{len(set_apart)} module(s) whose values would not fit fp16 at this plan's S "
                f"and so do not limit it ({how})"
            )
        if not reasons:
            reasons.append("the plan's scale meets the underflow limit with the same modules")
        return "; ".join(reasons)

    @property
    def scale(self) -> float | None:
        return None if self.log2_scale is None else math.ldexp(1.0, self.log2_scale)

    @property
    def passed(self) -> bool:
        return self.verification is not None and bool(self.verification.passed)

    def snippet(self, device_type: str = "cuda") -> str:
        names = ",\n    ".join(repr(m) for m in self.keep_out)
        scale = "None" if self.scale is None else f"{self.scale:g}"
        return (
            "import functools\nimport torch\n\n"
            f"KEEP_FP32 = [\n    {names},\n]\n\n" if self.keep_out else
            "import functools\nimport torch\n\nKEEP_FP32 = []\n\n"
        ) + (
            "def keep_out_of_fp16(model, names=KEEP_FP32, device_type=" + repr(device_type) + "):\n"
            "    def to_fp32(v):\n"
            "        return v.float() if torch.is_tensor(v) and v.is_floating_point() else v\n"
            "    for name in names:\n"
            "        module = model.get_submodule(name)\n"
            "        original = module.forward\n\n"
            "        @functools.wraps(original)\n"
            "        def fp32_forward(*args, _original=original, **kwargs):\n"
            "            with torch.autocast(device_type=device_type, enabled=False):\n"
            "                return _original(*map(to_fp32, args),\n"
            "                                 **{k: to_fp32(v) for k, v in kwargs.items()})\n\n"
            "        module.forward = fp32_forward\n\n"
            "keep_out_of_fp16(model)\n"
            f"scaler = torch.amp.GradScaler({device_type!r}, init_scale={scale}, "
            f"growth_interval={self.growth_interval})\n"
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_file": self.model_file,
            "format": self.format,
            "headroom_bits": self.headroom_bits,
            "max_underflow": self.max_underflow,
            "scale": self.scale,
            "log2_scale": self.log2_scale,
            "keep_out": self.keep_out,
            "candidates": self.candidates or self.keep_out,
            "ranges": [r.__dict__ for r in self.ranges],
            "underflow_fraction": self.underflow_fraction,
            "overflow_rate_at_2s": self.overflow_rate_at_2s,
            "steps": self.steps,
            "growth_interval": self.growth_interval,
            "target_skip_rate": TARGET_SKIP_RATE,
            "predicted_skip_rate": self.predicted_skip_rate,
            "recommended_log2_scale": self.recommended_log2_scale,
            "recommended_headroom_bits": self.recommended_headroom_bits,
            "recommended_limiting_module": self.recommended_limiting_module,
            "scales_differ_because": self.scales_differ_because(),
            "unscalable_overflow": self.unscalable_overflow,
            "unscalable_underflow": self.unscalable_underflow,
            "unscalable": [group.to_dict() for group in self.unscalable],
            "verification": None if self.verification is None else self.verification.to_dict(),
            "passed": self.passed,
            "snippet": self.snippet(),
            "notes": self.notes,
        }


def plan_from_report(
    report: Report,
    *,
    fmt: Format | None = None,
    headroom_bits: int = DEFAULT_HEADROOM_BITS,
    max_underflow: float = DEFAULT_MAX_UNDERFLOW,
) -> Fp16Plan:
    """The plan from an fp32 report with forward and backward values (no verification)."""
    fmt = fmt or get_format("fp16")
    _check(headroom_bits, max_underflow)
    ranges = module_ranges(report)
    limit = fmt.max_finite / 2**headroom_bits
    chosen: int | None = None
    for k in _LOG2_RANGE:
        out = set(failing(ranges, limit, math.ldexp(1.0, k)))
        if "" in out:
            break  # the whole model out of fp16 is no plan; larger scales only add modules
        if _underflow(report, fmt, k, out) <= max_underflow:
            chosen = k
            break
    notes: list[str] = []
    recommended = recommend(report, fmt, RECOMMEND_HEADROOM_BITS)
    if chosen is None:
        chosen = recommend(report, fmt, headroom_bits).log2_scale
        if chosen is None:
            raise UsageError(f"{report.info.model_file}: no backward values to plan on")
        notes.append(
            f"no scale keeps underflow within {max_underflow:g} without keeping the whole model "
            f"out of fp16; the plan uses the recommended scale ({headroom_bits} headroom bits)"
        )
    keep_out = failing(ranges, limit, math.ldexp(1.0, chosen))
    while (
        chosen + 1 in _LOG2_RANGE
        and failing(ranges, limit, math.ldexp(1.0, chosen + 1)) == keep_out
    ):
        chosen += 1  # the same modules still fit one binade higher: more room below
    kept = set(keep_out)
    rate, steps = overflow_rate(report, fmt, math.ldexp(2.0, chosen), kept)
    return Fp16Plan(
        report.info.model_file or "",
        fmt.name,
        headroom_bits,
        max_underflow,
        chosen,
        keep_out,
        _ranges_of(ranges, keep_out),
        _underflow(report, fmt, chosen, kept),
        rate,
        steps,
        growth_interval(),
        notes=notes,
        recommended_log2_scale=recommended.log2_scale,
        recommended_headroom_bits=RECOMMEND_HEADROOM_BITS,
        recommended_limiting_module=recommended.limiting_module,
        recommended_limited_by=recommended.limited_by,
        unscalable_overflow=recommended.unscalable_overflow,
        unscalable_underflow=recommended.unscalable_underflow,
        unscalable=recommended.unscalable,
    )


def _check(headroom_bits: int, max_underflow: float) -> None:
    if headroom_bits < 0:
        raise OptionError("headroom_bits", f"must be 0 or more, got {headroom_bits}")
    if not 0 <= max_underflow <= 1:
        raise OptionError("max_underflow", f"must be between 0 and 1, got {max_underflow}")


def _ranges_of(ranges: pd.DataFrame, modules: list[str]) -> list[ModuleRange]:
    rows = ranges.set_index("module")
    return [
        ModuleRange(m, float(rows.at[m, "forward_amax"]), float(rows.at[m, "backward_amax"]))
        for m in modules
    ]


def fp16_plan(
    model_path: str | Path,
    *,
    steps: int = DEFAULT_STEPS,
    headroom_bits: int = DEFAULT_HEADROOM_BITS,
    max_underflow: float = DEFAULT_MAX_UNDERFLOW,
    device: str = "auto",
    seed: int | None = 0,
) -> Fp16Plan:
    """Scan ``model_path`` in fp32 (forward and backward), plan, then verify the plan."""
    from fpaudit.run.scan import ScanOptions, scan
    from fpaudit.run.verify import verify

    _check(headroom_bits, max_underflow)
    report = scan(model_path, ScanOptions(steps=steps, device=device, seed=seed, forward=True))
    report.update_info(model_file=str(model_path))
    plan = plan_from_report(report, headroom_bits=headroom_bits, max_underflow=max_underflow)
    if plan.log2_scale is None:
        return plan
    log2_scale = plan.log2_scale

    def run(keep: list[str]) -> Any:
        return verify(model_path, log2_scale=log2_scale, amp="fp16", device=device, seed=seed,
                      keep_fp32=keep)  # fmt: skip

    plan.candidates = list(plan.keep_out)
    plan.verification = run(plan.keep_out)
    if not plan.verification.passed:
        plan.notes.append("the step with these modules kept out of fp16 did not pass")
        return plan
    # The fp32 scan cannot tell which values autocast holds in fp16 (a norm's fp32
    # variance, a residual add fed by a kept-out module): drop each candidate whose
    # removal still verifies, broadest modules first (a parent covers its children).
    depth = {m: m.count(".") for m in plan.keep_out}
    amax = {r.module: max(r.forward_amax, r.backward_amax) for r in plan.ranges}
    for module in sorted(plan.keep_out, key=lambda m: (depth[m], amax.get(m, 0.0))):
        trial = [m for m in plan.keep_out if m != module]
        result = run(trial)
        if result.passed:
            plan.keep_out, plan.verification = trial, result
    if plan.keep_out != plan.candidates:
        plan.notes.append(
            f"pruned by running: {', '.join(sorted(set(plan.candidates) - set(plan.keep_out)))} "
            "also fit when kept in fp16"
        )
    plan.ranges = [r for r in plan.ranges if r.module in plan.keep_out]
    return plan


__all__ = ["Fp16Plan", "fp16_plan", "module_ranges", "plan_from_report"]
