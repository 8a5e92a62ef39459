"""Dashboard metrics: a flat mapping of names to numbers per captured step.

Where users watch training (TensorBoard, Weights & Biases, MLflow, a trainer's logger),
fpaudit's numbers go in under the names declared once here (:data:`METRICS`); every
integration and ``fpaudit export --tensorboard`` logs these names, and
``docs/commands/export.md`` lists them (a test checks the table against this tuple).

Each value is computed by the same functions ``show``, ``recommend`` and ``gate`` use,
on the step's own records (:func:`fpaudit.rules.drift.window_report`): fractions are of
the nonzero backward values inside the model (not the ``<loss>`` pseudo-module), judged
in the format at the loss scale the step ran at (1 without a scaler; a scale that is not
a power of two is judged at the power of two below it), or at the scale recommended
from that step alone. Per-module series are the ``top`` modules with the highest
underflow fraction over the whole report given (so their names stay the same across
the steps of one export); the model's own ops are ``_root_``.

Known limitations: a step's recommendation is that step's alone (``recommend`` over
the whole run sizes S on the run's largest value, which can be smaller).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fpaudit import defaults
from fpaudit.numerics.formats import as_format
from fpaudit.numerics.limits import DEFAULT_HEADROOM_BITS
from fpaudit.report.data import ReportData
from fpaudit.report.records import KIND_BACKWARD, LOSS_MODULE
from fpaudit.report.runinfo import AMP_NAMES
from fpaudit.report.tables import Bins, Key, Records, Steps
from fpaudit.rules import analysis, blockplan
from fpaudit.rules.drift import window_report
from fpaudit.rules.recommendation import choose_scale
from fpaudit.rules.skips import ORIGINS, origins_of_steps

# A metric name in MLflow holds only letters, digits and ``_-. :/``, and MLflow's file
# store keeps each metric in a file named by it: no name is the folder of another (so the
# per-module series are not under ``.../underflow/``), and the model's own ops are
# ``_root_`` (a module attribute is never named so in practice; "(root)" elsewhere)
ROOT_NAME = "_root_"
SKIPPED_STEPS = "fpaudit/skipped_steps"
DEFAULT_TOP = defaults.METRICS_TOP


@dataclass(frozen=True)
class Metric:
    """One metric's name (``{format}``, ``{module}``, ``{recipe}`` filled in) and meaning."""

    name: str
    meaning: str


METRICS = (
    Metric(
        "fpaudit/{format}/lost",
        "live `--amp ... --shadow` reports only: fraction of the fp32 re-run's nonzero "
        "backward values that the device held as zero (what it really lost)",
    ),
    Metric(
        "fpaudit/{format}/underflow",
        "fraction of nonzero backward values that underflow in the format at the step's loss scale",
    ),
    Metric(
        "fpaudit/{format}/underflow_at_recommended",
        "the same fraction at the scale recommended from the step's values",
    ),
    Metric(
        "fpaudit/{format}/overflow",
        "fraction of nonzero backward values that overflow (inf) at the step's loss scale",
    ),
    Metric(
        "fpaudit/{format}/recommended_log2_scale",
        "log2 of the static loss scale recommended from the step's values (absent: none)",
    ),
    Metric("fpaudit/loss_scale_log2", "log2 of the loss scale the step ran at (0: no scaler)"),
    Metric(SKIPPED_STEPS, "optimizer steps skipped for inf/NaN gradients so far"),
    Metric(
        "fpaudit/skips_{origin}",
        "reports of `fpaudit run` with a GradScaler: of those, the skips by origin so far "
        "(`calibration`, `forward`: the loss was inf/NaN, `backward`: only the gradients)",
    ),
    Metric(
        "fpaudit/{format}/module_underflow/{module}",
        "per module, for the `top` modules losing the most: its underflow fraction at the "
        "step's loss scale",
    ),
    Metric(
        "fpaudit/{recipe}/flush",
        "per audited block-scaled recipe: fraction of nonzero backward values flushed to zero",
    ),
)


@dataclass(frozen=True)
class StepMetrics:
    """The metrics of one captured step."""

    step: int
    values: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "values": dict(self.values)}


@dataclass(frozen=True)
class StepView:
    """What a dashboard draws from one captured step: its metrics, the step's own records
    as a report (for :func:`bin_series`) and the modules with a series of their own."""

    metrics: StepMetrics
    window: ReportData
    modules: tuple[str, ...]


def step_view(
    step: ReportData,
    fmt: str | None,
    top: int,
    chosen: dict[tuple[str, int], list[str]],
    skipped_steps: int,
) -> StepView | None:
    """The view of a run's last closed step (``step``: its records alone), as the run goes:
    ``fmt`` None is the format of the dtype the step held its backward values in (bf16
    under bf16 autocast), else fp16; the per-module series are the ``top`` modules the
    first step found losing the most, kept in ``chosen`` for the run so their names stay
    (modules with values only in later steps join them while fewer than ``top`` have a
    series); ``skipped_steps``: the run's so far. None for a step with no captured row."""
    if fmt is None:
        fmt = AMP_NAMES.get(analysis.held_dtype(step) or "", "fp16")
    modules = chosen.setdefault((fmt, top), [])
    if len(modules) < top:
        modules += [m for m in worst_modules(step, fmt, top) if m not in modules]
        del modules[top:]
    found = step_metrics(step, fmt, modules=modules)
    if not found:
        return None
    values = {**found[-1].values, SKIPPED_STEPS: float(skipped_steps)}
    return StepView(StepMetrics(found[-1].step, values), step, tuple(modules))


def module_tag(module: str) -> str:
    return module if module else ROOT_NAME


def _judged_log2(scale: float) -> int:
    """The power of two a loss scale is judged at (the one at or below it)."""
    if not (scale > 0 and math.isfinite(scale)):
        return 0
    return math.frexp(scale)[1] - 1


def worst_modules(report: ReportData, fmt: str, top: int) -> list[str]:
    """The ``top`` modules of the whole report with the highest underflow fraction at S=1
    (ties: the model's order)."""
    if top <= 0:
        return []
    table = analysis.module_table(report, fmt, 0, scope=analysis.default_scope(report))
    table = table[table["nonzero"] > 0]
    order = np.argsort(-table["judged_underflow_fraction"].to_numpy(), kind="stable")
    return [str(m) for m in table[Key.module].to_numpy()[order][:top]]


def step_metrics(
    report: ReportData,
    fmt: str = "fp16",
    *,
    top: int = DEFAULT_TOP,
    headroom_bits: int = DEFAULT_HEADROOM_BITS,
    modules: Sequence[str] | None = None,
) -> list[StepMetrics]:
    """The metrics of every captured step of ``report``, in step order; per-module
    series for ``modules`` (default: the ``top`` modules of the report losing the most)."""
    found = each_step(report, fmt, top=top, headroom_bits=headroom_bits, modules=modules)
    return [metrics for metrics, _ in found]


def each_step(
    report: ReportData,
    fmt: str = "fp16",
    *,
    top: int = DEFAULT_TOP,
    headroom_bits: int = DEFAULT_HEADROOM_BITS,
    modules: Sequence[str] | None = None,
) -> Iterator[tuple[StepMetrics, ReportData]]:
    """:func:`step_metrics`, each with the step's own report (its records alone), for a
    writer that also draws the step's histograms (:func:`bin_series`)."""
    name = as_format(fmt).name
    modules = list(modules) if modules is not None else worst_modules(report, name, top)
    skipped = dict(skipped_series(report))
    by_origin = dict(skip_origin_series(report))
    for _, row in _steps(report).iterrows():
        if not bool(row[Steps.captured]):
            continue
        step = int(row[Steps.step])
        window = window_report(report, step, step)
        values = _window_metrics(window, name, modules, headroom_bits, float(row[Steps.loss_scale]))
        values[SKIPPED_STEPS] = skipped[step]
        values.update(by_origin.get(step, {}))
        yield StepMetrics(step, values), window


def _steps(report: ReportData) -> Any:
    return report.steps.drop_duplicates(Steps.step).sort_values(Steps.step)


def skipped_series(report: ReportData) -> list[tuple[int, float]]:
    """``fpaudit/skipped_steps`` at each captured step of ``report``: (step, optimizer
    steps skipped for inf/NaN gradients up to and including it)."""
    steps = _steps(report)
    skipped = np.cumsum(steps[Steps.skipped].to_numpy(dtype=bool))
    captured = steps[Steps.captured].to_numpy(dtype=bool)
    numbers = steps[Steps.step].to_numpy(dtype=np.int64)
    return [(int(n), float(k)) for n, k, c in zip(numbers, skipped, captured, strict=True) if c]


def skip_origin_series(report: ReportData) -> list[tuple[int, dict[str, float]]]:
    """``fpaudit/skips_{origin}`` at each captured step of a report with a loss scaler
    (none without one): the skips of each origin up to and including the step."""
    if report.info.scaler is None:
        return []
    steps = _steps(report)
    origins = np.array(
        origins_of_steps(
            steps["skipped"].to_numpy(dtype=bool), steps["loss_finite"].to_numpy(dtype=bool)
        )
    )
    counts = {origin: np.cumsum(origins == origin) for origin in ORIGINS}
    captured = steps["captured"].to_numpy(dtype=bool)
    numbers = steps["step"].to_numpy(dtype=np.int64)
    return [
        (int(numbers[i]), {skip_metric(o): float(counts[o][i]) for o in ORIGINS})
        for i in np.flatnonzero(captured)
    ]


def skip_metric(origin: str) -> str:
    """The metric of the skips of ``origin`` so far (beside, not under, skipped_steps)."""
    return f"fpaudit/skips_{origin}"


def _window_metrics(
    window: ReportData, fmt: str, modules: list[str], headroom_bits: int, loss_scale: float
) -> dict[str, float]:
    scope = analysis.default_scope(window)
    k = _judged_log2(loss_scale)
    at_run = analysis.totals(window, fmt, k, scope=scope)
    # recommend()'s scale and its underflow, without the tables a dashboard does not show
    chosen = choose_scale(window, as_format(fmt), headroom_bits, scope).log2_scale
    at_chosen = at_run if chosen == k else analysis.totals(window, fmt, chosen or 0, scope=scope)
    lost = {f"fpaudit/{fmt}/lost": at_run.lost_fraction} if at_run.shadow_nonzero else {}
    values = {
        **lost,  # a live --shadow step leads with what the device really lost
        f"fpaudit/{fmt}/underflow": at_run.judged_underflow_fraction,
        f"fpaudit/{fmt}/underflow_at_recommended": at_chosen.judged_underflow_fraction,
        f"fpaudit/{fmt}/overflow": at_run.overflow_fraction,
        "fpaudit/loss_scale_log2": float(math.log2(loss_scale)) if loss_scale > 0 else 0.0,
    }
    if chosen is not None:
        values[f"fpaudit/{fmt}/recommended_log2_scale"] = float(chosen)
    if modules:
        table = analysis.module_table(window, fmt, k, scope=scope).set_index(Key.module)
        for module in modules:
            if module in table.index and int(table.at[module, "nonzero"]) > 0:
                fraction = float(table.at[module, "judged_underflow_fraction"])
                values[f"fpaudit/{fmt}/module_underflow/{module_tag(module)}"] = fraction
    for recipe in window.recipes:
        blocks = blockplan.block_table(window, recipe, by=(Key.module,))
        blocks = blocks[blocks[Key.module] != LOSS_MODULE]
        nonzero = float(blocks["nonzero"].sum())
        flushed = float(blocks["flushed"].sum())
        values[f"fpaudit/{recipe}/flush"] = flushed / nonzero if nonzero else 0.0
    return values


def bin_series(window: ReportData, module: str) -> tuple[np.ndarray, np.ndarray]:
    """One step's backward values of ``module`` as a binade histogram, in unscaled units
    (the report's own bins; a value that scales with the loss shifted down by its
    record's loss scale): the upper edge of each binade (``2**(b+1)``, lowest first) from
    the smallest nonzero one to the largest, empty binades between them included, and
    its count of nonzero finite values."""
    return bin_series_of(window, [module])[module]


def bin_series_of(
    window: ReportData, modules: Sequence[str]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """:func:`bin_series` of each of ``modules``, from one join of the bins with the
    records (a dashboard draws several modules a step)."""
    records = window.records
    mine = records[
        (records[Records.kind] == KIND_BACKWARD) & records[Records.module].isin(list(modules))
    ]
    columns = [Records.record_id, Records.module, Records.loss_scale, Records.scales_with_loss]
    rows = window.bins.merge(mine[columns], on=Bins.record_id)
    scale_log2 = np.frexp(rows[Records.loss_scale].to_numpy(dtype=np.float64))[1] - 1
    shift = np.where(rows[Records.scales_with_loss].to_numpy(dtype=bool), scale_log2, 0)
    binades = rows[Bins.binade].to_numpy(dtype=np.int64) - shift
    counts = rows[Bins.count].to_numpy(dtype=np.float64)
    names = rows[Records.module].to_numpy()
    found: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for module in modules:
        here = names == module
        if not here.any():
            found[module] = (np.zeros(0), np.zeros(0, dtype=np.int64))
            continue
        # every binade from the smallest to the largest nonzero one, empty ones included:
        # a histogram reader draws bucket i from limit i-1 to limit i, so a bucket after a
        # gap would be drawn across the gap
        low = int(binades[here].min())
        span = int(binades[here].max()) - low + 1
        summed = np.bincount(binades[here] - low, weights=counts[here], minlength=span)
        found[module] = (np.ldexp(1.0, np.arange(low, low + span) + 1), summed.astype(np.int64))
    return found
