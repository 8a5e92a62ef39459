"""What the commands show about a report, decided once: frozen results with ``to_dict()``.

A command reads a report, calls one function here and hands the result to its renderer;
the renderer prints it without deciding anything again. Each function is the
combination of rules (the recommendation, range loss, drift, origins) that one view
needs: ``scan_summary`` and ``run_summary`` (what ``fpaudit scan`` and ``fpaudit run``
print at the end), ``module_view`` (``show``), ``recommendation_view`` (``recommend``),
``origins_view`` (``show --origins``), ``steps_view`` (``show --steps``) and
``worst_blocks`` (the block tables after a scan or run with recipes).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fpaudit.defaults import DRIFT_BINADES
from fpaudit.numerics.formats import Format, get_format
from fpaudit.numerics.limits import DEFAULT_HEADROOM_BITS
from fpaudit.report.records import KIND_BACKWARD
from fpaudit.report.tables import Key, Steps
from fpaudit.rules.skips import SkipVerdict, report_skip_verdict

if TYPE_CHECKING:
    import pandas as pd

    from fpaudit.report.data import ReportData
    from fpaudit.report.runinfo import Finding, ScalerInfo, SkipStatistics
    from fpaudit.rules.analysis import LeftOut
    from fpaudit.rules.drift import Drift, Window
    from fpaudit.rules.origins import Origins
    from fpaudit.rules.recommendation import Recommendation

# a long scan shows how the recommendation moved even when it did not drift past the
# threshold: from this many windows on
LONG_SCAN_WINDOWS = 10


def json_rows(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows as JSON-ready dicts: NaN and infinities become null."""
    return [
        {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
        for row in frame.to_dict(orient="records")
    ]


def reading_format(report: ReportData, name: str | None = None) -> Format:
    """The format a report is read in: ``name``, else the first its scan summarised, else fp16."""
    if name is None:
        formats = report.info.formats
        name = formats[0] if formats else "fp16"
    return get_format(name)


def run_format(report: ReportData, name: str | None = None) -> Format:
    """The format a run's report is judged in: ``name``, else its autocast dtype, else fp16."""
    return get_format(name if name is not None else report.info.amp or "fp16")


def report_headroom(report: ReportData) -> int:
    """The headroom the report's scan used, else the declared default."""
    stored = report.info.headroom_bits
    return DEFAULT_HEADROOM_BITS if stored is None else stored


def recommended_log2(report: ReportData, fmt: Format) -> int:
    """log2 of the scale recommended for ``fmt`` at the report's own headroom (0 when
    nothing limits it): the scale ``show`` and ``show --origins`` read at by default."""
    from fpaudit.rules.recommendation import recommend

    return recommend(report, fmt, report_headroom(report)).log2_scale or 0


# -- scan ------------------------------------------------------------------------------
@dataclass(frozen=True)
class FormatSummary:
    """One format's part of a scan's summary: the recommendation, the per-module tables
    at S = 1 and at the recommended S, and how the recommendation moved over the scan."""

    recommendation: Recommendation
    at_1: pd.DataFrame
    at_scale: pd.DataFrame
    drift: Drift

    @property
    def show_drift(self) -> bool:
        """Whether the summary says how the scale moved: it drifted, or the scan was long."""
        return self.drift.warn or len(self.drift.windows) >= LONG_SCAN_WINDOWS

    def worst_modules(self, top: int) -> tuple[WorstModule, ...]:
        """The ``top`` modules losing the most to underflow at S = 1 (:func:`worst_modules`)."""
        return worst_modules(self.at_1, self.at_scale, top)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.recommendation.format,
            "recommendation": self.recommendation.to_dict(),
            "at_1": json_rows(self.at_1),
            "at_scale": json_rows(self.at_scale),
            "drift": self.drift.to_dict(),
        }


@dataclass(frozen=True)
class WorstModule:
    """One row of a scan's "modules losing the most to underflow at S = 1": the module's
    nonzero values and judged underflow fraction at S = 1, that fraction at the
    recommended scale, and its amax at S = 1."""

    module: str
    nonzero: int
    underflow_fraction_at_1: float
    underflow_fraction: float  # at the recommended scale
    amax: float
    lost: int = 0  # live --shadow: the fp32 re-run's nonzero values the device held as zero
    lost_fraction: float = 0.0


def worst_modules(at_1: pd.DataFrame, at_scale: pd.DataFrame, top: int) -> tuple[WorstModule, ...]:
    """The ``top`` modules of the module tables ``at_1`` (S = 1) and ``at_scale`` (the
    recommended S) with the largest judged underflow fraction at S = 1 (what the
    recommendation judges), in table order among equals; in a live ``--shadow`` report,
    the largest fraction the device really lost."""
    judged = "judged_underflow_fraction"
    merged = at_1.merge(at_scale, on=Key.module, suffixes=("_at_1", "_at_s"))
    live = bool((merged["shadow_nonzero_at_1"] > 0).any())
    key = "lost_fraction_at_1" if live else f"{judged}_at_1"
    worst = merged.sort_values(key, ascending=False, kind="stable").head(top)
    columns = (
        Key.module, "nonzero_at_1", f"{judged}_at_1", f"{judged}_at_s", "amax_at_1",
        "lost_at_1", "lost_fraction_at_1",
    )  # fmt: skip
    return tuple(
        WorstModule(
            str(module),
            int(nonzero),
            float(at_1_),
            float(at_s),
            float(amax),
            int(lost),
            float(lost_fraction),
        )
        for module, nonzero, at_1_, at_s, amax, lost, lost_fraction in zip(
            *(worst[c] for c in columns), strict=True
        )
    )


@dataclass(frozen=True)
class ScanSummary:
    """What ``fpaudit scan`` says at the end: steps run and captured, the steps whose loss
    was not finite and the forward ops that first made inf/NaN, and one
    :class:`FormatSummary` per format asked for."""

    steps_run: int
    captured: int
    forward_problems: int
    first_nonfinite: tuple[str, ...]
    formats: tuple[FormatSummary, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps_run": self.steps_run,
            "captured": self.captured,
            "forward_problems": self.forward_problems,
            "first_nonfinite": list(self.first_nonfinite),
            "formats": [each.to_dict() for each in self.formats],
        }


def format_summary(
    report: ReportData, fmt: Format, headroom_bits: int, *, include_loss: bool = False
) -> FormatSummary:
    from fpaudit.rules import analysis
    from fpaudit.rules.drift import drift
    from fpaudit.rules.recommendation import recommend

    rec = recommend(report, fmt, headroom_bits, include_loss=include_loss)
    scope = analysis.default_scope(report, include_loss)
    return FormatSummary(
        recommendation=rec,
        at_1=analysis.module_table(report, fmt, 0, scope=scope),
        at_scale=analysis.module_table(report, fmt, rec.log2_scale or 0, scope=scope),
        drift=drift(report, fmt, headroom_bits, include_loss=include_loss),
    )


def scan_summary(
    report: ReportData, formats: list[Format], headroom_bits: int, *, include_loss: bool = False
) -> ScanSummary:
    """A scan's summary in each of ``formats``."""
    problems = ~report.steps[Steps.loss_finite]
    return ScanSummary(
        steps_run=report.info.steps_run or 0,
        captured=report.info.steps or 0,
        forward_problems=int(problems.sum()),
        first_nonfinite=tuple(sorted(set(report.steps.loc[problems, "first_nonfinite"]) - {""})),
        formats=tuple(
            format_summary(report, fmt, headroom_bits, include_loss=include_loss) for fmt in formats
        ),
    )


# -- run -------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunSummary:
    """What ``fpaudit run`` judges at the end: the recommendation and drift, both
    ``None`` when no step was captured, the findings of the loop's misuse rules, and the
    steps whose loss or gradients were inf or NaN that no loss scaler skipped."""

    recommendation: Recommendation | None
    drift: Drift | None
    findings: tuple[Finding, ...]
    nonfinite_steps: tuple[int, ...] = ()  # loss or gradients inf/NaN, no scaler skipped
    skips: SkipVerdict | None = None  # the skipped steps' origins and verdict (a scaler)

    def to_dict(self) -> dict[str, Any]:
        rec, drifted = self.recommendation, self.drift
        return {
            "recommendation": rec.to_dict() if rec is not None else None,
            "drift": drifted.to_dict() if drifted is not None else None,
            "findings": [finding.to_dict() for finding in self.findings],
            "nonfinite_steps": list(self.nonfinite_steps),
            "skips": self.skips.to_dict() if self.skips is not None else None,
        }


def run_summary(
    report: ReportData,
    fmt: Format,
    headroom_bits: int,
    *,
    window_steps: int | None = None,
    threshold_binades: int = DRIFT_BINADES,
) -> RunSummary:
    from fpaudit.rules.drift import drift
    from fpaudit.rules.recommendation import recommend

    rec = drifted = None
    if not report.records.empty:
        rec = recommend(report, fmt, headroom_bits)
        drifted = drift(
            report, fmt, headroom_bits, window_steps=window_steps,
            threshold_binades=threshold_binades,
        )  # fmt: skip
    from fpaudit.rules.analysis import nonfinite_steps

    broken = tuple(nonfinite_steps(report))
    skips = report_skip_verdict(report, fmt)
    return RunSummary(rec, drifted, tuple(report.info.findings), broken, skips)


# -- show, recommend -------------------------------------------------------------------
MARKED_UNDERFLOW = 0.01  # a module losing more than 1% of its judged values is marked


@dataclass(frozen=True)
class ModuleView:
    """``show``'s table: range loss of ``kind``'s values per module (or module and op) at
    ``log2_scale``, the one given or the recommended one (``scale_source``)."""

    table: pd.DataFrame
    format: Format
    log2_scale: int
    scale_source: str  # "given" or "recommended"
    kind: str
    by: str
    top: int | None
    left_out: LeftOut | None = None  # a live report: values held in another dtype

    def rows(self) -> list[dict[str, Any]]:
        """The table's rows, JSON-ready (what ``show --json`` prints)."""
        return json_rows(self.table)

    def marked(self) -> list[bool]:
        """Per row, whether it loses what the loss scale answers for: any of its judged
        values overflow, or more than ``MARKED_UNDERFLOW`` of them underflow (``show``
        prints such a row in red)."""
        table = self.table
        lost = (table["judged_overflow"] > 0) | (
            table["judged_underflow_fraction"] > MARKED_UNDERFLOW
        )
        lost |= table["lost_fraction"] > MARKED_UNDERFLOW  # live --shadow: the device lost them
        return [bool(flag) for flag in lost]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format.name,
            "log2_scale": self.log2_scale,
            "scale_source": self.scale_source,
            "kind": self.kind,
            "by": self.by,
            "top": self.top,
            "left_out": None if self.left_out is None else dataclasses.asdict(self.left_out),
            "rows": self.rows(),
        }


def module_view(
    report: ReportData,
    fmt: Format,
    log2_scale: int | None,
    *,
    kind: str = KIND_BACKWARD,
    by: str = "module",
    top: int | None = None,
) -> ModuleView:
    """Range loss at ``log2_scale`` (``None``: the recommended scale at the report's
    headroom), the ``top`` rows with the most underflow first when ``top`` is given."""
    from fpaudit.rules import analysis

    scale_source = "given"
    if log2_scale is None:
        log2_scale = recommended_log2(report, fmt)
        scale_source = "recommended"
    group = (Key.module,) if by == "module" else (Key.module, Key.node, Key.op)
    # the values recommend and gate count: in a live report, those held in its dtype
    scope = analysis.Scope(kinds=(kind,), include_loss=True, dtypes=analysis.live_dtypes(report))
    table = analysis.range_loss(report, fmt, log2_scale, scope=scope, by=group)
    if top is not None:
        table = table.sort_values("underflow_fraction", ascending=False, kind="stable").head(top)
    outside = analysis.left_out(report, scope)
    left = outside if outside.format_dtype is not None else None
    return ModuleView(table, fmt, log2_scale, scale_source, kind, by, top, left)


@dataclass(frozen=True)
class RecommendationView:
    """``recommend``'s answer: the recommendation, judged over the whole report or over
    its worst ``window``, and the drift of the per-window recommendations."""

    recommendation: Recommendation
    drift: Drift
    window: Window | None

    def to_dict(self) -> dict[str, Any]:
        window = self.window
        return {
            **self.recommendation.to_dict(),
            "window": [window.first_step, window.last_step] if window is not None else None,
            "drift": self.drift.to_dict(),
        }


def recommendation_view(
    report: ReportData,
    fmt: Format,
    headroom_bits: int,
    *,
    include_loss: bool = False,
    worst_window: bool = False,
    window_steps: int | None = None,
    threshold_binades: int = DRIFT_BINADES,
) -> RecommendationView:
    """The recommendation and its drift; with ``worst_window``, the recommendation of the
    window with the smallest scale (``window`` is ``None`` when no window has values)."""
    from fpaudit.rules.drift import drift, window_report
    from fpaudit.rules.recommendation import recommend

    drifted = drift(
        report, fmt, headroom_bits, window_steps=window_steps,
        threshold_binades=threshold_binades, include_loss=include_loss,
    )  # fmt: skip
    worst = drifted.worst if worst_window else None
    judged = report if worst is None else window_report(report, worst.first_step, worst.last_step)
    rec = recommend(judged, fmt, headroom_bits, include_loss=include_loss)
    return RecommendationView(rec, drifted, worst)


# -- origins, steps, blocks ------------------------------------------------------------
@dataclass(frozen=True)
class OriginsView:
    """``show --origins``: where inf/NaN was made live, and the op calls predicted to
    make it in ``format`` at ``log2_scale``."""

    live: Origins
    predicted: pd.DataFrame
    format: Format
    log2_scale: int

    @property
    def scale(self) -> float:
        return math.ldexp(1.0, self.log2_scale)

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.live.to_dict(),
            "predicted": {
                "format": self.format.name,
                "scale": self.scale,
                "origins": json_rows(self.predicted),
            },
        }


def origins_view(report: ReportData, fmt: Format, log2_scale: int | None) -> OriginsView:
    """The report's origins (it must have them) at ``log2_scale``, ``None``: the
    recommended scale at the report's headroom."""
    from fpaudit.rules import origins

    if report.origins is None:
        raise ValueError("the report has no origins")
    if log2_scale is None:
        log2_scale = recommended_log2(report, fmt)
    live = origins.live(report.origins)
    predicted = origins.predicted(report.origins, fmt, math.ldexp(1.0, log2_scale))
    return OriginsView(live, predicted, fmt, log2_scale)


@dataclass(frozen=True)
class StepsView:
    """``show --steps``: a run's training and scaler settings, its findings, its steps."""

    training: SkipStatistics | None
    scaler: ScalerInfo | None
    findings: tuple[Finding, ...]
    steps: pd.DataFrame

    def to_dict(self) -> dict[str, Any]:
        return {
            "training": self.training.to_dict() if self.training is not None else None,
            "scaler": self.scaler.to_dict() if self.scaler is not None else None,
            "findings": [finding.to_dict() for finding in self.findings],
            "steps": json_rows(self.steps),
        }


def steps_view(report: ReportData) -> StepsView:
    info = report.info
    return StepsView(
        training=info.training,
        scaler=info.scaler,
        findings=tuple(info.findings),
        steps=report.steps,
    )


def worst_blocks(report: ReportData, recipe: str, kind: str = KIND_BACKWARD) -> pd.DataFrame:
    """``recipe``'s block statistics per module, the most flushed first."""
    from fpaudit.rules.blockplan import block_table

    return block_table(report, recipe, kind=kind).sort_values(
        "flush_fraction", ascending=False, kind="stable"
    )
