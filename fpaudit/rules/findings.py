"""The misuse rules of ``fpaudit run``: pure functions from what a run did to findings.

``training.TrainingMonitor`` notes the calls; the rules over them (a
:class:`CallLog` of calls on gradients, each with whether they were still scaled)
and over the run's values (the steps table, the scalar log) live here, so each can
be tested on a hand-built log or table: a log or table in, findings out. A
finding names the file and line of the script's call and the first steps it
happened at.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from fpaudit.report.runinfo import Finding, SkipStatistics
from fpaudit.report.tables import Steps
from fpaudit.text import power

__all__ = [
    "FINDINGS",
    "CallLog",
    "Finding",
    "Findings",
    "GradCall",
    "SchedulerCall",
    "Site",
    "SpanScale",
    "finding",
    "grad_call_findings",
    "mixed_scale_findings",
    "scale_findings",
    "scheduler_findings",
    "skip_statistics",
    "sorted_findings",
]

Site = tuple[str, int]  # file and line of the script's call


class SchedulerCall(NamedTuple):
    """A scheduler's ``step()`` from the script."""

    site: Site
    attempt: int  # the step its optimizer last attempted (-1: none)
    name: str  # the scheduler's class name


class SpanScale(NamedTuple):
    """One scale a micro-batch of an accumulated batch was scaled by."""

    version: int  # scaler.update() calls before it: the scale's version
    slot: int  # the scale's slot in the scalar log
    site: Site  # the script's scale() call
    step: int


FINDINGS = {
    # code: (severity, what it means)
    "clip-before-unscale": (
        "error",
        "gradients clipped while still multiplied by the loss scale",
    ),
    "step-without-unscale": (
        "error",
        "optimizer.step() on gradients still multiplied by the loss scale",
    ),
    "mixed-scale-accumulation": (
        "error",
        "micro-batches of one accumulated batch were scaled differently",
    ),
    "unscale-twice": ("error", "unscale_() ran twice on the same accumulated gradients"),
    "grad-read-while-scaled": ("warning", ".grad read while gradients are still scaled"),
    "scheduler-on-skipped-step": ("warning", "LR scheduler stepped on a skipped optimizer step"),
    "scale-falling": ("warning", "the loss scale keeps falling"),
    "scale-below-one": ("warning", "the loss scale fell below 1"),
    "high-skip-rate": ("warning", "many optimizer steps skipped after calibration"),
}
_MAX_LISTED_STEPS = 20


def finding(code: str, site: Site, message: str, steps: Sequence[int], count: int) -> Finding:
    """A finding of rule ``code`` (its severity from :data:`FINDINGS`) at ``site``."""
    file, line = site
    return Finding(code, FINDINGS[code][0], file, line, message, tuple(steps), count)


class Findings:
    """Findings keyed by (code, site); each keeps a count and its first steps."""

    def __init__(self) -> None:
        self.items: dict[tuple[str, Site], CallSteps] = {}

    def add(self, code: str, site: Site, step: int, message: str) -> None:
        """Rule ``code`` found at ``site`` in step ``step``; the first ``message`` is kept."""
        self.items.setdefault((code, site), CallSteps(message)).seen_in(step)

    def found(self) -> list[Finding]:
        """The findings, in the order first found."""
        return [
            finding(code, site, seen.detail, seen.steps, seen.count)
            for (code, site), seen in self.items.items()
        ]


class GradCall(NamedTuple):
    """A kind of call of the script's on the gradients, at one site, and whether the
    gradients were still multiplied by the loss scale when it ran."""

    kind: str  # "read" (of .grad), "step" (optimizer.step), "clip", "unscale" (unscale_)
    site: Site
    scaled: bool  # unscale: False when they were already unscaled since last zeroed


@dataclass
class CallSteps:
    """When a :class:`GradCall` (or a finding, in :class:`Findings`) happened: its first
    steps and in how many steps."""

    # step: the optimizer's class; clip: the call, as "clip_grad_norm_(..., 1)"; a
    # finding: its message
    detail: str
    steps: list[int] = field(default_factory=list)
    count: int = 0
    last_step: int = -1

    def seen_in(self, step: int) -> None:
        """Once more in step ``step`` (counted once per step)."""
        if step != self.last_step:
            self.count += 1
            self.last_step = step
            if len(self.steps) < _MAX_LISTED_STEPS:
                self.steps.append(step)


class CallLog:
    """The script's calls on the gradients, as the run saw them; each kind of call is
    kept once, with its first steps and a count, so a long run's log stays small.
    Reads of ``.grad`` are logged only while the gradients are scaled (the others are
    no concern, and many)."""

    def __init__(self) -> None:
        self.items: dict[GradCall, CallSteps] = {}

    def add(self, kind: str, site: Site, step: int, scaled: bool, detail: str = "") -> None:
        """A call at ``site`` in step ``step``; ``detail`` of its first one is kept."""
        self.items.setdefault(GradCall(kind, site, scaled), CallSteps(detail)).seen_in(step)


def grad_call_findings(log: CallLog) -> list[Finding]:
    """Calls on gradients that were (or, for unscale_, were no longer) scaled: clipping,
    stepping or reading them scaled, and unscaling them twice."""
    found: list[Finding] = []
    for (kind, site, scaled), seen in log.items.items():
        if kind == "clip" and scaled:
            code, message = (
                "clip-before-unscale",
                f"{seen.detail} clipped gradients still multiplied by the loss scale S: the "
                "threshold is meant for unscaled gradients, so clipping is off by a factor S; "
                "call scaler.unscale_(optimizer) before clipping",
            )
        elif kind == "step" and scaled:
            code, message = (
                "step-without-unscale",
                f"{seen.detail}.step() ran on gradients still multiplied by the loss scale; "
                "call scaler.step(optimizer) (or scaler.unscale_(optimizer) first)",
            )
        elif kind == "read" and scaled:
            code, message = (
                "grad-read-while-scaled",
                ".grad read while the gradients are still multiplied by the loss scale: values "
                "logged or checked here are S times too large; call scaler.unscale_(optimizer) "
                "first",
            )
        elif kind == "unscale" and not scaled:
            code, message = (
                "unscale-twice",
                "unscale_() ran again on gradients already unscaled since they were last "
                "zeroed: they are divided by the scale twice",
            )
        else:
            continue
        found.append(finding(code, site, message, seen.steps, seen.count))
    return found


def mixed_scale_findings(
    spans: Sequence[Sequence[tuple[int, int, Site, int]]],
    values: np.ndarray,
    update_site: Site | None,
) -> list[Finding]:
    """Micro-batches of one effective batch that ran under different scale values.

    ``spans``: per accumulated batch, its scales (:class:`SpanScale`) in order;
    ``values``: the scalar log's values. A micro-batch whose scale's value differs
    from the first micro-batch's is a finding at its ``scale()`` call; the
    ``scaler.update()`` at ``update_site`` is named as the cause."""
    found = Findings()
    for scales in spans:
        if len(scales) < 2:
            continue
        first = values[scales[0][1]]
        for _version, slot, site, step in scales[1:]:
            if values[slot] != first:
                update = f" (scaler.update() at {_where(update_site)} ran between them)"
                found.add(
                    "mixed-scale-accumulation",
                    site,
                    step,
                    f"a micro-batch scaled by {power(values[slot])} was accumulated onto "
                    f"gradients scaled by {power(first)}{update if update_site else ''}"
                    ": unscale_ divides the sum by one scale, so micro-batches are weighted "
                    "unequally; update the scaler once per optimizer step",
                )
    return found.found()


def sorted_findings(findings: Sequence[Finding]) -> list[Finding]:
    """Errors first, then warnings, each by file and line (ties keep their order)."""
    return sorted(
        findings,
        key=lambda f: (("error", "warning", "info").index(f.severity), f.file, f.line),
    )


def scheduler_findings(
    table: dict[str, list[Any]], calls: Sequence[tuple[Site, int, str]]
) -> list[Finding]:
    """Scheduler steps (site, the step its optimizer last attempted, class name) that
    followed a skipped optimizer step. The calibration skips (the leading run of skips
    while a fresh dynamic scaler backs off from its initial scale, see
    :func:`skip_statistics`) are the scaler's design, not the script's mistake: the
    PyTorch AMP recipe steps its scheduler on them too, and is not flagged."""
    found = Findings()
    calibration = skip_statistics(np.array(table[Steps.skipped], dtype=bool)).calibration_steps
    calibrating = set(table[Steps.step][:calibration])
    skipped = dict(zip(table[Steps.step], table[Steps.skipped], strict=True))
    for site, attempt, name in calls:
        if skipped.get(attempt, False) and attempt not in calibrating:
            found.add(
                "scheduler-on-skipped-step",
                site,
                attempt,
                f"{name}.step() ran after a skipped optimizer step: the learning rate moved "
                "on while the weights did not; step the scheduler only when "
                "scaler.get_scale() did not fall",
            )
    return found.found()


def scale_findings(
    table: dict[str, list[Any]], site: Site, max_backoffs: int, max_skip_rate: float
) -> list[Finding]:
    """A scale that keeps falling, falls below 1, or skips too often after calibration,
    from the steps table's ``step``, ``loss_scale``, ``scale_after`` and ``skipped``;
    each finding is placed at ``site`` (the script's ``scaler.update()``)."""
    found = Findings()
    if not table[Steps.step]:
        return []
    steps = np.array(table[Steps.step])
    before = np.array(table[Steps.loss_scale])
    after = np.array(table[Steps.scale_after])
    backoff = after < before
    stats = skip_statistics(np.array(table[Steps.skipped], dtype=bool))
    # Backing off from the initial scale until gradients fit is calibration, not decay.
    runs = [r for r in true_runs(backoff) if not (r[0] == 0 and stats.calibration_steps)]
    for start, end in [(start, end) for start, end in runs if end - start > max_backoffs]:
        found.add(
            "scale-falling",
            site,
            int(steps[start]),
            f"the scale backed off {end - start} times in a row (steps {steps[start]} to "
            f"{steps[end - 1]}, {power(before[start])} to {power(after[end - 1])}): every "
            "step overflows whatever the scale, which points at inf/NaN from the forward "
            "pass or the data (try `fpaudit scan --amp --forward`), not at a too-large scale",
        )
    below = np.flatnonzero(after < 1.0)
    if len(below):
        first = int(below[0])
        found.add(
            "scale-below-one",
            site,
            int(steps[first]),
            f"the scale fell below 1 ({power(after[first])} after step {steps[first]}): "
            "gradients are now held smaller than unscaled, so loss scaling only adds "
            "underflow; something overflows at every scale",
        )
    if stats.skipped_after_calibration >= 3 and stats.skip_rate_after_calibration > max_skip_rate:
        rate = stats.skip_rate_after_calibration
        phase = " after calibration" if stats.calibration_steps else ""
        found.add(
            "high-skip-rate",
            site,
            int(steps[stats.calibration_steps]),
            f"{stats.skipped_after_calibration} of {stats.steps_after_calibration} "
            f"steps{phase} were skipped ({rate:.1%}, more than {max_skip_rate:.1%}): each "
            "skip discards a batch; look for steps that overflow at every scale, or a "
            "growth interval too short",
        )
    return found.found()


def skip_statistics(skipped: np.ndarray) -> SkipStatistics:
    """Skipped steps (``skipped``: one bool per step), split at the end of calibration
    (see :class:`SkipStatistics`)."""
    # A run that never takes a step never calibrated: its skips all count.
    calibration = int(np.argmin(skipped)) if not skipped.all() else 0
    after = skipped[calibration:]
    return SkipStatistics(
        steps=len(skipped),
        skipped=int(skipped.sum()),
        calibration_steps=calibration,
        steps_after_calibration=len(after),
        skipped_after_calibration=int(after.sum()),
        skip_rate_after_calibration=float(after.mean()) if len(after) else 0.0,
    )


def true_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of every run of True in ``mask``."""
    padded = np.concatenate([[False], mask, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def _number(value: Any) -> str:
    try:
        return f"{float(value):g}"
    except (TypeError, ValueError):
        return repr(value)


def _where(site: Site | None) -> str:
    return f"{site[0]}:{site[1]}" if site is not None else "?"
