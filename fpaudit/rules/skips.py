"""Why a loss scaler skipped steps: each skip's origin and the run's verdict, in the
terms of dynamic loss scaling (pure functions over a report's steps and skips tables).

A dynamic scaler's first skips, backing off from its initial scale until the gradients
fit, are **calibration**. After it, a skip is an overflow at the scale in force:

* **range**: the back-off cleared it, about one skip per growth interval as the scaler
  probes the top of the range: the designed cost of dynamic scaling. A static scale below
  the smallest scale that skipped would have avoided them.
* **persistent**: not a range problem, the scaler reports a training problem: the loss
  itself was inf or NaN (the forward pass breaks; no loss scale can fix it), the scale
  kept falling (more than ``max_backoffs`` back-offs in a row), fell below 1, or the same
  op (or, where no op was seen, the same parameter) overflowed at three or more scales.

Each skip's **origin**: ``calibration``, ``forward`` (the loss was inf/NaN) or
``backward`` (a finite loss, inf/NaN gradients), with the parameters whose gradients held
inf/NaN (backward order: the first is nearest the origin) and, where a capture saw it,
the op that first made inf/NaN and how its largest finite output stood to the format's
largest value.

Known limitations: a report without a skips table (before version 6, or a loop without a
scaler) gives origins from the loss alone; an op is named only for skipped steps that
were captured, or whose next step was captured and broke too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fpaudit import defaults
from fpaudit.numerics.formats import Format
from fpaudit.report.tables import Records, Skips, Steps
from fpaudit.rules.analysis import Scope
from fpaudit.rules.findings import skip_statistics, true_runs
from fpaudit.text import power

if TYPE_CHECKING:
    import pandas as pd

    from fpaudit.report.data import ReportData
    from fpaudit.report.runinfo import ScalerInfo

__all__ = [
    "CALIBRATION",
    "NO_SKIPS",
    "ORIGINS",
    "PERSISTENT",
    "RANGE",
    "ReplayedSkip",
    "SkipOrigin",
    "SkipVerdict",
    "origins_of_steps",
    "replayed_skip_origins",
    "report_skip_verdict",
    "skip_verdict",
]

# Origins of one skip.
CALIBRATION = "calibration"
FORWARD = "forward"
BACKWARD = "backward"
ORIGINS = (CALIBRATION, FORWARD, BACKWARD)

# Verdicts of a run (NO_SKIPS: nothing was skipped).
NO_SKIPS = "none"
RANGE = "range"
PERSISTENT = "persistent"

SAME_OP_SCALES = 3
"""An op (or parameter) that overflows at this many scales or more overflows at every scale."""


@dataclass(frozen=True)
class SkipOrigin:
    """Where one skipped step's inf/NaN came from."""

    step: int
    loss_scale: float
    origin: str  # CALIBRATION, FORWARD or BACKWARD
    loss_finite: bool
    nonfinite_params: int  # -1: not checked (no skips table)
    params_checked: int
    params: tuple[str, ...]  # the first ones, in backward order
    op_step: int | None = None  # the captured step the op was seen in
    op_phase: str = ""
    op_module: str = ""
    op: str = ""
    op_amax: float = math.nan  # its largest finite |output| at op_scale
    op_scale: float = math.nan
    # log2(op_amax / the format's largest finite value): > 0 over its edge, < 0 under it
    edge_binades: float = math.nan

    @property
    def op_label(self) -> str:
        """``module op`` (``(root)`` for the model itself), or "" when none was seen."""
        return f"{self.op_module or '(root)'} {self.op}" if self.op else ""

    @property
    def culprit(self) -> str:
        """What overflowed, as named: the op, else the first parameter, else ""."""
        return self.op_label or (self.params[0] if self.params else "")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["params"] = list(self.params)
        for name in ("op_amax", "op_scale", "edge_binades"):
            if not math.isfinite(data[name]):
                data[name] = None
        return data


@dataclass(frozen=True)
class SkipVerdict:
    """The run's verdict on its skipped steps, the reason in words, each skip's origin,
    and (range) the static scale that would have avoided them or (persistent) the culprit
    and the smallest scale at which it still overflowed."""

    verdict: str  # NO_SKIPS, CALIBRATION, RANGE or PERSISTENT
    reason: str
    skips: tuple[SkipOrigin, ...]
    calibration_steps: int
    format: str
    static_log2_scale: int | None = None  # range: a static scale of 2^this avoids them
    culprit: str = ""  # persistent: the op or parameter, where named
    culprit_min_scale: float | None = None  # the smallest scale at which it overflowed

    @property
    def persistent(self) -> bool:
        return self.verdict == PERSISTENT

    def counts(self) -> dict[str, int]:
        """Skips by origin (every origin, 0 where none)."""
        found = {origin: 0 for origin in ORIGINS}
        for skip in self.skips:
            found[skip.origin] += 1
        return found

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "reason": self.reason,
            "format": self.format,
            "calibration_steps": self.calibration_steps,
            "by_origin": self.counts(),
            "static_log2_scale": self.static_log2_scale,
            "culprit": self.culprit,
            "culprit_min_scale": self.culprit_min_scale,
            "skips": [skip.to_dict() for skip in self.skips],
        }


def origins_of_steps(skipped: np.ndarray, loss_finite: np.ndarray) -> list[str]:
    """Per step of a steps table, the origin of its skip ("" where not skipped): the
    one rule the verdict, ``show --skips`` and the dashboards' counts share."""
    calibration = skip_statistics(skipped).calibration_steps
    return [
        "" if not skip else CALIBRATION if i < calibration else BACKWARD if finite else FORWARD
        for i, (skip, finite) in enumerate(zip(skipped, loss_finite, strict=True))
    ]


def skip_verdict(
    steps: pd.DataFrame,
    skips: pd.DataFrame | None,
    scaler: ScalerInfo | None,
    fmt: Format,
    max_backoffs: int = defaults.RUN_MAX_BACKOFFS,
) -> SkipVerdict | None:
    """The verdict on the skipped steps of a run (``steps``: its steps table, ``skips``:
    its skips table or None); None without a loss scaler (nothing is skipped by design).
    ``fmt``'s largest finite value is the edge an op's values are measured against."""
    if scaler is None:
        return None
    skipped = steps[Steps.skipped].to_numpy(dtype=bool)
    calibration = skip_statistics(skipped).calibration_steps
    origins = _origins(steps, skips, fmt)
    later = [s for s in origins if s.origin != CALIBRATION]

    def verdict(
        kind: str, reason: str, static: int | None = None, culprit: str = "",
        smallest: float | None = None,
    ) -> SkipVerdict:  # fmt: skip
        return SkipVerdict(kind, reason, tuple(origins), calibration, fmt.name, static, culprit,
                           smallest)  # fmt: skip

    if not origins:
        return verdict(NO_SKIPS, "no step was skipped")
    if not later:
        return verdict(
            CALIBRATION,
            f"all {len(origins)} skip(s) were calibration: a fresh scaler starts at "
            f"{power(scaler.init_scale)} and halves until the gradients fit",
        )
    persistent = _persistent(steps, later, calibration, max_backoffs)
    if persistent is not None:
        reason, culprit, smallest = persistent
        return verdict(PERSISTENT, reason, culprit=culprit, smallest=smallest)
    smallest_skip = min(s.loss_scale for s in later)
    static = math.floor(math.log2(smallest_skip)) - 1
    return verdict(
        RANGE,
        f"{len(later)} skip(s) after calibration, each cleared by the back-off: overflow at "
        f"the scale, the designed cost of dynamic scaling; none skipped below "
        f"{power(smallest_skip)}, so a static scale of {power(2.0**static)} would avoid them",
        static=static,
    )


def _origins(steps: pd.DataFrame, skips: pd.DataFrame | None, fmt: Format) -> list[SkipOrigin]:
    """Each skipped step's origin, from the skips table where there is one (else from
    the steps table: whether its loss was finite)."""
    table = steps.reset_index(drop=True)
    rows = {int(r[Skips.step]): r for r in skips.to_dict("records")} if skips is not None else {}
    finites = table[Steps.loss_finite].to_numpy(dtype=bool)
    origins = origins_of_steps(table[Steps.skipped].to_numpy(dtype=bool), finites)
    found = []
    for i, origin in enumerate(origins):
        if not origin:
            continue
        step = int(table[Steps.step].iloc[i])
        finite = bool(finites[i])
        row = rows.get(step)
        if row is None:
            scale = float(table[Steps.loss_scale].iloc[i])
            found.append(SkipOrigin(step, scale, origin, finite, -1, 0, ()))
            continue
        amax = float(row[Skips.op_amax])
        edge = math.log2(amax / fmt.max_finite) if amax > 0 and math.isfinite(amax) else math.nan
        found.append(
            SkipOrigin(
                step=step,
                loss_scale=float(row[Skips.loss_scale]),
                origin=origin,
                loss_finite=finite,
                nonfinite_params=int(row[Skips.nonfinite_params]),
                params_checked=int(row[Skips.params_checked]),
                params=tuple(p for p in str(row[Skips.params]).split(", ") if p),
                op_step=int(row[Skips.op_step]) if int(row[Skips.op_step]) >= 0 else None,
                op_phase=str(row[Skips.op_phase]),
                op_module=str(row[Skips.op_module]),
                op=str(row[Skips.op]),
                op_amax=amax,
                op_scale=float(row[Skips.op_scale]),
                edge_binades=edge,
            )
        )
    return found


def _persistent(
    steps: pd.DataFrame, later: list[SkipOrigin], calibration: int, max_backoffs: int
) -> tuple[str, str, float | None] | None:
    """Why the skips after calibration are not a range problem (the reason, the culprit
    and the smallest scale it overflowed at), or None."""
    forward = [s for s in later if s.origin == FORWARD]
    # the culprit: the op seen most often (at the scales its captured steps ran at), else
    # the parameter named first most often (at the skips' scales)
    by_culprit: dict[str, list[float]] = {}
    for skip in later:
        if skip.op:
            by_culprit.setdefault(skip.op_label, []).append(skip.op_scale)
    if not by_culprit:
        for skip in later:
            if skip.params:
                by_culprit.setdefault(skip.params[0], []).append(skip.loss_scale)
    culprit, smallest = "", None
    if by_culprit:
        culprit, seen_at = max(by_culprit.items(), key=lambda item: len(set(item[1])))
        smallest = min(seen_at)
    named = f"; {culprit} overflowed down to {power(smallest)}" if smallest is not None else ""
    if forward:
        first = forward[0]
        named_op = next((s for s in forward if s.op_phase == FORWARD and s.op), None)
        what = f" ({named_op.op_label} made it first in forward)" if named_op else ""
        return (
            f"the loss itself was inf or NaN in {len(forward)} skipped step(s), first at step "
            f"{first.step}{what}: the forward pass breaks, and no loss scale can fix that",
            named_op.op_label if named_op else "",
            None,
        )
    before = steps[Steps.loss_scale].to_numpy(dtype=np.float64)[calibration:]
    after = steps[Steps.scale_after].to_numpy(dtype=np.float64)[calibration:]
    longest = max((end - start for start, end in true_runs(after < before)), default=0)
    if longest > max_backoffs:
        return (
            f"the scale backed off {longest} times in a row after calibration: every step "
            f"overflowed whatever the scale{named}",
            culprit,
            smallest,
        )
    if len(after) and after.min() < 1.0:
        return (
            f"the scale fell below 1 ({power(after.min())}): the gradients overflow even "
            f"unscaled{named}",
            culprit,
            smallest,
        )
    if smallest is not None:
        scales = set(by_culprit[culprit])
        if len(scales) >= SAME_OP_SCALES:
            return (
                f"{culprit} overflowed at {len(scales)} different scales, down to "
                f"{power(smallest)}: it overflows at every scale",
                culprit,
                smallest,
            )
    return None


def report_skip_verdict(report: ReportData, fmt: Format) -> SkipVerdict | None:
    """:func:`skip_verdict` of a report (of several ranks: the first rank's steps, whose
    scaler decided for every rank); None without a loss scaler."""
    steps, skips = report.steps, report.skips
    if steps[Steps.rank].nunique() > 1:
        rank = scaler_rank(steps)
        steps = steps[steps[Steps.rank] == rank]
        skips = skips[skips[Skips.rank] == rank] if skips is not None else None
    return skip_verdict(steps, skips, report.info.scaler, fmt)


def scaler_rank(steps: pd.DataFrame) -> int | None:
    """The rank whose loss-scale trajectory stands for every rank's in a steps table (the
    lowest: the ranks of a DDP run share one scaler's decisions); None when empty."""
    return int(steps[Steps.rank].min()) if len(steps) else None


@dataclass(frozen=True)
class ReplayedSkip:
    """A skip of a replayed scaler (``simulate``): its step, the replayed scale, and what
    overflowed there as the records show it: the captured op whose largest value reaches
    the format's overflow edge at that scale (``source`` ``records``), else what the run
    itself saw skip at that step (``run``: its op or first parameter, at its own scale)."""

    step: int
    scale: float
    culprit: str
    source: str  # "records" or "run"
    value_at_scale: float = math.nan  # records: the op's largest |value| at ``scale``

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["value_at_scale"] = self.value_at_scale if math.isfinite(self.value_at_scale) else None
        return data


def replayed_skip_origins(
    report: ReportData,
    fmt: Format,
    scope: Scope,
    steps: Sequence[int],
    scales: Sequence[float],
) -> list[ReplayedSkip]:
    """What overflowed at each replayed skip (``steps``, at ``scales``), where the report
    shows it (see :class:`ReplayedSkip`); steps it does not show are left out. Only the
    records ``scope`` covers are candidates, as for the replay's thresholds: not the
    ``<loss>`` ops, nor, in a live report, values autocast held in fp32."""
    records = scope.select(report.records)
    records = records[records[Records.scales_with_loss]]
    records = records[records[Records.steps] == 1]  # a --window record is not one step's
    seen = report_skip_verdict(report, fmt)
    by_step = {skip.step: skip for skip in seen.skips} if seen is not None else {}
    found = []
    for step, scale in zip(steps, scales, strict=True):
        mine = records[records[Records.step] == step]
        values = (mine[Records.amax] / mine[Records.loss_scale] * scale).to_numpy(dtype=np.float64)
        if len(values) and values.max() >= fmt.overflow_edge:
            top = mine.iloc[int(np.argmax(values))]
            label = f"{top[Records.module] or '(root)'} {top[Records.op]}"
            found.append(ReplayedSkip(int(step), float(scale), label, "records",
                                      float(values.max())))  # fmt: skip
            continue
        run = by_step.get(int(step))
        if run is not None and run.culprit:
            found.append(ReplayedSkip(int(step), float(scale), run.culprit, "run"))
    return found
