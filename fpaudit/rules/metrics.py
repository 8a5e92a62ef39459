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
the steps of one export); the model's own ops are ``(root)``.

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
from fpaudit.report.records import KIND_BACKWARD, LOSS_MODULE
from fpaudit.report.store import Report
from fpaudit.rules import analysis, blockplan
from fpaudit.rules.drift import window_report
from fpaudit.rules.recommendation import recommend

ROOT_NAME = "(root)"
DEFAULT_TOP = defaults.METRICS_TOP


@dataclass(frozen=True)
class Metric:
    """One metric's name (``{format}``, ``{module}``, ``{recipe}`` filled in) and meaning."""

    name: str
    meaning: str


METRICS = (
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
    Metric("fpaudit/skipped_steps", "optimizer steps skipped for inf/NaN gradients so far"),
    Metric(
        "fpaudit/{format}/underflow/{module}",
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


def module_tag(module: str) -> str:
    return module if module else ROOT_NAME


def _judged_log2(scale: float) -> int:
    """The power of two a loss scale is judged at (the one at or below it)."""
    if not (scale > 0 and math.isfinite(scale)):
        return 0
    return math.frexp(scale)[1] - 1


def worst_modules(report: Report, fmt: str, top: int) -> list[str]:
    """The ``top`` modules of the whole report with the highest underflow fraction at S=1
    (ties: the model's order)."""
    if top <= 0:
        return []
    table = analysis.module_table(report, fmt, 0, scope=analysis.default_scope(report))
    table = table[table["nonzero"] > 0]
    order = np.argsort(-table["judged_underflow_fraction"].to_numpy(), kind="stable")
    return [str(m) for m in table["module"].to_numpy()[order][:top]]


def step_metrics(
    report: Report,
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
    report: Report,
    fmt: str = "fp16",
    *,
    top: int = DEFAULT_TOP,
    headroom_bits: int = DEFAULT_HEADROOM_BITS,
    modules: Sequence[str] | None = None,
) -> Iterator[tuple[StepMetrics, Report]]:
    """:func:`step_metrics`, each with the step's own report (its records alone), for a
    writer that also draws the step's histograms (:func:`bin_series`)."""
    name = as_format(fmt).name
    modules = list(modules) if modules is not None else worst_modules(report, name, top)
    steps = report.steps.drop_duplicates("step").sort_values("step")
    skipped = np.cumsum(steps["skipped"].to_numpy(dtype=bool))
    for (_, row), skipped_so_far in zip(steps.iterrows(), skipped, strict=True):
        if not bool(row["captured"]):
            continue
        step = int(row["step"])
        window = window_report(report, step, step)
        values = _window_metrics(window, name, modules, headroom_bits, float(row["loss_scale"]))
        values["fpaudit/skipped_steps"] = float(skipped_so_far)
        yield StepMetrics(step, values), window


def _window_metrics(
    window: Report, fmt: str, modules: list[str], headroom_bits: int, loss_scale: float
) -> dict[str, float]:
    scope = analysis.default_scope(window)
    k = _judged_log2(loss_scale)
    at_run = analysis.totals(window, fmt, k, scope=scope)
    recommendation = recommend(window, fmt, headroom_bits)
    values = {
        f"fpaudit/{fmt}/underflow": at_run.judged_underflow_fraction,
        f"fpaudit/{fmt}/underflow_at_recommended": float(recommendation.underflow_fraction),
        f"fpaudit/{fmt}/overflow": at_run.overflow_fraction,
        "fpaudit/loss_scale_log2": float(math.log2(loss_scale)) if loss_scale > 0 else 0.0,
    }
    if recommendation.log2_scale is not None:
        values[f"fpaudit/{fmt}/recommended_log2_scale"] = float(recommendation.log2_scale)
    if modules:
        table = analysis.module_table(window, fmt, k, scope=scope).set_index("module")
        for module in modules:
            if module in table.index and int(table.at[module, "nonzero"]) > 0:
                fraction = float(table.at[module, "judged_underflow_fraction"])
                values[f"fpaudit/{fmt}/underflow/{module_tag(module)}"] = fraction
    for recipe in window.recipes:
        blocks = blockplan.block_table(window, recipe, by=("module",))
        blocks = blocks[blocks["module"] != LOSS_MODULE]
        nonzero = float(blocks["nonzero"].sum())
        flushed = float(blocks["flushed"].sum())
        values[f"fpaudit/{recipe}/flush"] = flushed / nonzero if nonzero else 0.0
    return values


def bin_series(window: Report, module: str) -> tuple[np.ndarray, np.ndarray]:
    """One step's backward values of ``module`` as a binade histogram, in unscaled units
    (the report's own bins; a value that scales with the loss shifted down by its
    record's loss scale): the upper edge of each binade (``2**(b+1)``, lowest first) and
    its count of nonzero finite values."""
    records = window.records
    mine = records[(records["kind"] == KIND_BACKWARD) & (records["module"] == module)]
    columns = ["record_id", "loss_scale", "scales_with_loss"]
    rows = window.bins.merge(mine[columns], on="record_id")
    if rows.empty:
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    scale_log2 = np.frexp(rows["loss_scale"].to_numpy(dtype=np.float64))[1] - 1
    shift = np.where(rows["scales_with_loss"].to_numpy(dtype=bool), scale_log2, 0)
    binades = rows["binade"].to_numpy(dtype=np.int64) - shift
    unique, inverse = np.unique(binades, return_inverse=True)
    counts = np.bincount(inverse, weights=rows["count"].to_numpy(dtype=np.float64))
    return np.ldexp(1.0, unique + 1), counts.astype(np.int64)
