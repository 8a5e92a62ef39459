"""Drift: the recommended scale per window of steps, across a run.

Gradients change over training, so a static scale calibrated at step 500 can
be wrong at step 50,000. The run is cut into windows of consecutive steps;
each window gets the recommendation its own captured steps would give (the
rule of :func:`fpaudit.rules.recommendation.recommend`, applied by
:func:`~fpaudit.rules.recommendation.log2_scale_for` to the window's unscaled amax
and histogram: the smallest power of two that loses as little as the largest one
keeping amax ``headroom_bits`` below the format's maximum, within fp32's scale
range), the module that limited it, and its underflow at its own scale and at the
whole run's scale. Drift shows up as windows that could have used a larger scale
and, at the run's scale, lose more to underflow.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from fpaudit import defaults
from fpaudit.bounds import AT_LEAST_1
from fpaudit.numerics import limits
from fpaudit.numerics.formats import Format
from fpaudit.report.data import ReportData
from fpaudit.report.tables import Bins, Records, Steps
from fpaudit.rules import analysis
from fpaudit.rules.recommendation import log2_scale_for, loss_counter

DEFAULT_WINDOWS = 10  # windows per run when --drift-window is not given
# warn when per-window recommendations span more binades than this (declared with --drift-binades)
DEFAULT_DRIFT_BINADES = defaults.DRIFT_BINADES


@dataclass(frozen=True)
class Window:
    first_step: int
    last_step: int
    captured_steps: int
    amax: float  # largest unscaled in-scope backward value (0: none)
    log2_scale: int | None  # this window's recommendation (None: no nonzero values)
    limiting_module: str | None
    limiting_op: str | None
    underflow_fraction: float  # at this window's own scale
    underflow_at_run_scale: float


@dataclass(frozen=True)
class Drift:
    format: str
    headroom_bits: int
    window_steps: int
    windows: list[Window]
    run_log2_scale: int | None
    binades: int  # largest minus smallest per-window log2 scale (0 with fewer than 2)
    threshold_binades: int

    @property
    def warn(self) -> bool:
        return self.binades > self.threshold_binades

    @property
    def worst(self) -> Window | None:
        """The window with the smallest recommended scale (ties: the most underflow)."""
        judged = [w for w in self.windows if w.log2_scale is not None]
        if not judged:
            return None
        return min(judged, key=lambda w: (w.log2_scale, -w.underflow_at_run_scale))

    def to_dict(self) -> dict[str, Any]:
        worst = self.worst
        return {
            **{k: v for k, v in asdict(self).items() if k != "windows"},
            "warn": self.warn,
            "worst_window": asdict(worst) if worst is not None else None,
            "windows": [asdict(w) for w in self.windows],
        }


def drift(
    report: ReportData,
    fmt: Format,
    headroom_bits: int = limits.DEFAULT_HEADROOM_BITS,
    *,
    window_steps: int | None = None,
    threshold_binades: int = DEFAULT_DRIFT_BINADES,
    include_loss: bool = False,
) -> Drift:
    """Per-window recommendations of ``report`` for ``fmt`` (windows of ``window_steps``
    steps; default: the run in about ten windows)."""
    AT_LEAST_1.check("window_steps", window_steps)  # None: about ten windows
    scope = analysis.default_scope(report, include_loss)
    records = scope.select(report.records)
    steps = report.steps[Steps.step].to_numpy(dtype=np.int64)
    first = int(steps.min()) if len(steps) else 0
    last = int(steps.max()) if len(steps) else -1
    if window_steps is None:
        window_steps = max(1, math.ceil((last - first + 1) / DEFAULT_WINDOWS))

    scaling = records[records[Records.scales_with_loss]]
    unscaled = scaling[Records.amax] / scaling[Records.loss_scale]
    run_amax = float(unscaled.max()) if len(unscaled) and unscaled.max() > 0 else 0.0
    run_counter = loss_counter(analysis.condense(report, scope), fmt)
    run_k, _ = log2_scale_for(run_amax, fmt, headroom_bits, run_counter)

    # One pass over the bins grouped by window (not by step: a long run has thousands of
    # steps, and a cube of bins per step is hundreds of MB to allocate and sum again).
    step_of_record = report.records[Records.step].to_numpy(dtype=np.int64)
    by_window = ReportData(
        report.info,
        report.records.assign(**{_WINDOW: (step_of_record - first) // window_steps}),
        report.bins,
        report.steps,
    )
    condensed = analysis.condense(by_window, scope, (_WINDOW,))
    window_of_group = condensed.groups[_WINDOW].to_numpy(dtype=np.int64)
    steps_in_scope = records[Records.step].to_numpy(dtype=np.int64)
    window_of_record = (scaling[Records.step].to_numpy(dtype=np.int64) - first) // window_steps
    windows: list[Window] = []
    for w in range((last - first) // window_steps + 1 if last >= first else 0):
        lo, hi = first + w * window_steps, first + (w + 1) * window_steps - 1
        rows = np.flatnonzero(window_of_group == w)
        if not len(rows):
            continue  # no captured step in this window
        captured = np.unique(steps_in_scope[(steps_in_scope >= lo) & (steps_in_scope <= hi)])
        in_window = unscaled[window_of_record == w]
        amax = float(in_window.max()) if len(in_window) else 0.0
        limiter = scaling.loc[in_window.idxmax()] if amax > 0 else None
        part = analysis.Condensed(
            condensed.groups.iloc[rows].reset_index(drop=True),
            condensed.scaled[rows],
            condensed.fixed[rows],
        ).total()
        k, _ = log2_scale_for(amax, fmt, headroom_bits, loss_counter(part, fmt))
        own = part.at(fmt, k if k is not None else 0).iloc[0]
        at_run = part.at(fmt, run_k if run_k is not None else 0).iloc[0]
        windows.append(
            Window(
                first_step=lo,
                last_step=min(hi, last),
                captured_steps=len(captured),
                amax=amax,
                log2_scale=k,
                limiting_module=str(limiter[Records.module]) if limiter is not None else None,
                limiting_op=str(limiter[Records.op]) if limiter is not None else None,
                underflow_fraction=float(own["judged_underflow_fraction"]),
                underflow_at_run_scale=float(at_run["judged_underflow_fraction"]),
            )
        )
    ks = [w.log2_scale for w in windows if w.log2_scale is not None]
    return Drift(
        format=fmt.name,
        headroom_bits=headroom_bits,
        window_steps=window_steps,
        windows=windows,
        run_log2_scale=run_k,
        binades=(max(ks) - min(ks)) if len(ks) >= 2 else 0,
        threshold_binades=threshold_binades,
    )


_WINDOW = "_drift_window"


def window_report(report: ReportData, first_step: int, last_step: int) -> ReportData:
    """What ``report`` recorded in steps ``first_step..last_step`` (record ids renumbered)."""
    records = report.records
    keep = ((records[Records.step] >= first_step) & (records[Records.step] <= last_step)).to_numpy()
    new_id = np.full(len(records), -1, dtype=np.int64)
    new_id[keep] = np.arange(int(keep.sum()))
    bins = report.bins
    bin_records = bins[Bins.record_id].to_numpy()
    bins_kept = bins[keep[bin_records]].copy()
    bins_kept[Bins.record_id] = new_id[bins_kept[Bins.record_id].to_numpy()].astype(np.int32)
    kept = records[keep].copy()
    kept[Records.record_id] = np.arange(len(kept), dtype=np.int32)
    steps = report.steps
    in_range = (steps[Steps.step] >= first_step) & (steps[Steps.step] <= last_step)
    return ReportData(
        dataclasses.replace(
            report.info,
            settings={**report.info.settings, "window_of_run": [first_step, last_step]},
        ),
        kept.reset_index(drop=True),
        bins_kept.reset_index(drop=True),
        steps[in_range].reset_index(drop=True),
    )
