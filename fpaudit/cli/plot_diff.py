"""The figure behind ``fpaudit plot BASE NEW``: two reports against one format at one scale.

Two panels, top to bottom:

1. **Both histograms overlaid** against the format's bands, at the comparison's scale
   ``S`` (:func:`fpaudit.rules.comparison.compare`'s: NEW's recommended one unless given):
   x is ``log2|x * S|``, one bar per binade; y the *fraction* of each report's own nonzero
   values in that binade (log scale), so reports of different sizes overlay. Grey is
   BASE, blue NEW; the bands are those of ``fpaudit plot``.
2. **Change strip**: one bar per module both reports hold, in the comparison's order, the
   change of its underflow fraction in percentage points (red: it rose); modules in one
   report only are listed under the strip.

matplotlib is imported only when a figure is built, as in :mod:`fpaudit.cli.plot`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fpaudit.cli.plot import (
    _BAND_COLOURS,
    _PLAIN_TEXT,
    _SCALED_COLOUR,
    _UNSCALED_COLOUR,
    AXIS,
    DPI,
    WIDTH_INCHES,
    _edges,
    _literal,
    _require_matplotlib,
    _save,
    _x_limits,
    binade_counts,
    image_format,
)
from fpaudit.errors import Named, UsageError
from fpaudit.numerics.formats import Format, get_format
from fpaudit.rules import analysis
from fpaudit.rules.comparison import BOTH, Comparison
from fpaudit.text import module_label, percent

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from fpaudit.report.store import Report

_MAX_STRIP_MODULES = 48


def binade_fractions(report: Report, log2_scale: int) -> np.ndarray:
    """The fraction of ``report``'s nonzero in-scope backward values in each binade of
    ``|x * 2**log2_scale|`` (indexed as :data:`fpaudit.cli.plot.AXIS`)."""
    condensed = analysis.condense(report, analysis.default_scope(report), ("module",))
    counts = binade_counts(condensed, log2_scale).sum(axis=0).astype(float)
    total = counts.sum()
    fractions: np.ndarray = counts / total if total > 0 else counts
    return fractions


def build_comparison_figure(result: Comparison, base: Report, new: Report) -> Figure:
    """The figure of :func:`~fpaudit.rules.comparison.compare`'s ``result`` of ``base``
    and ``new``. Raises UsageError when matplotlib is missing."""
    _require_matplotlib()
    from matplotlib import rc_context
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with rc_context(_PLAIN_TEXT):
        compared = [row for row in result.rows if row.present == BOTH][:_MAX_STRIP_MODULES]
        strip_height = min(10.0, max(2.5, round((1.0 + 0.2 * len(compared)) * 4) / 4))
        heights = [4.5, strip_height]
        figure = Figure(figsize=(WIDTH_INCHES, sum(heights) + 0.5), dpi=DPI, layout="constrained")
        FigureCanvasAgg(figure)
        top, bottom = figure.subplots(2, 1, height_ratios=heights)
        fmt = get_format(result.format)
        _overlay_panel(top, result, fmt, base, new)
        _strip_panel(bottom, result)
        figure.suptitle(
            _literal(
                f"fpaudit diff: BASE {result.base_report} vs NEW {result.new_report}, "
                f"{fmt.name} at S = 2^{result.log2_scale} ({result.scale_source})"
            ),
            fontsize=11,
        )
    return figure


def _overlay_panel(ax: Axes, result: Comparison, fmt: Format, base: Report, new: Report) -> None:
    k = result.log2_scale
    fractions = [binade_fractions(report, k) for report in (base, new)]
    rtz, normal, overflow = _edges(fmt)
    low, high = _x_limits(AXIS, fractions, _edges(fmt))
    for label, start, stop in (
        ("rounds to zero", low - 1e3, rtz),
        ("subnormal", rtz, normal),
        ("normal", normal, overflow),
        ("overflow", overflow, high + 1e3),
    ):
        colour, alpha = _BAND_COLOURS[label]
        ax.axvspan(start, stop, color=colour, alpha=alpha, linewidth=0, label=label)
    index = (low <= AXIS) & (high > AXIS)
    edges = np.append(AXIS[index], AXIS[index][-1] + 1).astype(float)
    overall = result.overall
    for values, name, colour, under in (
        (fractions[0], "BASE", _UNSCALED_COLOUR, overall.base_underflow),
        (fractions[1], "NEW", _SCALED_COLOUR, overall.new_underflow),
    ):
        label = f"{name}: underflow {percent(under or 0.0)}"
        ax.stairs(values[index], edges, baseline=1e-9, fill=True, color=colour, alpha=0.35)
        ax.stairs(values[index], edges, baseline=1e-9, color=colour, linewidth=1.2, label=label)
    peak = max(1e-9, float(max(f.max() for f in fractions)))
    ax.set_yscale("log")
    ax.set_ylim(max(1e-7, peak * 1e-6), peak * 3)
    ax.set_xlim(low, high)
    ax.set_xlabel("log2 |x·S|  (binade: one bar holds [2^b, 2^(b+1)))")
    ax.set_ylabel("fraction of nonzero values")
    ax.grid(axis="x", alpha=0.25)
    ax.legend(loc="upper right", fontsize=7.5, framealpha=0.9)
    ax.set_title(
        f"Backward values of both reports against {fmt.name} at S = 2^{k}", fontsize=10, loc="left"
    )


def _strip_panel(ax: Axes, result: Comparison) -> None:
    compared = [row for row in result.rows if row.present == BOTH][:_MAX_STRIP_MODULES]
    names = [_literal(module_label(row.module)) for row in compared]
    changes = np.array([100 * (row.underflow_change or 0.0) for row in compared])
    colours = ["#d62728" if change > 0 else "#2ca02c" for change in changes]
    positions = np.arange(len(compared))
    ax.barh(positions, changes, color=colours)
    ax.set_yticks(positions, names, fontsize=7)
    ax.invert_yaxis()  # the comparison's first row on top
    ax.axvline(0.0, color="black", linewidth=0.8)
    ax.set_xlabel("change of the underflow fraction, NEW - BASE (percentage points)")
    alone = [row for row in result.rows if row.present != BOTH]
    if alone:
        listed = ", ".join(f"{module_label(row.module)} ({row.present} only)" for row in alone)
        ax.text(0.0, -0.25, _literal(f"in one report only: {listed}"), transform=ax.transAxes,
                fontsize=7, va="top")  # fmt: skip
    if not compared:
        ax.text(0.5, 0.5, "no module in both reports", transform=ax.transAxes, ha="center")
    ax.set_title("Per module: the change of underflow", fontsize=10, loc="left")


def plot_comparison(
    result: Comparison, base: Report, new: Report, path: str | os.PathLike[str]
) -> Path:
    """Draw :func:`build_comparison_figure` into ``path`` (``.png`` or ``.svg``), atomically."""
    target = Path(path)
    kind = image_format(target)
    if target.is_dir():
        raise UsageError(
            Named("output"), f" {target} is a directory; give a file name ending in .{kind}"
        )
    return _save(build_comparison_figure(result, base, new), target, kind)
