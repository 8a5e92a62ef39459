"""The figures behind ``fpaudit plot``: a report's backward values against a format's range.

One image (PNG or SVG), panels stacked top to bottom:

1. **Histogram of backward value magnitudes** on a log2 axis: x is
   ``log2|x * S|`` (each bar is one binade, ``[2**b, 2**(b+1))``), y the number
   of values (log scale). Grey is the values unscaled (``S = 1``, the
   gradients of the plain loss); blue is the same values at the chosen loss
   scale ``S = 2**k`` (the recommended one unless given):
   the mass that scales with the loss moves right by ``k`` binades, values
   computed from forward values alone stay where they are. The shaded bands are
   the format's: *rounds to zero* (``|x * S| <= round_to_zero_edge``),
   *subnormal* (nonzero but below the smallest normal: flush-to-zero hardware
   zeroes these too), *normal*, and *overflow* (``>= overflow_edge``). Read it
   as "how much of the blue mass sits in the red bands". The box in the top
   left gives the exact fractions (and counts) of nonzero values lost at
   ``S = 1`` and at ``S = 2**k``, straight from :func:`fpaudit.rules.analysis.totals`;
   *flushed* includes *rounds to zero*.
2. **Heatmap, modules x binades**: one row per module in network order, one
   column per binade of the *unscaled* values (``S = 1``), colour
   ``log10(count + 1)`` (white: no values). Solid vertical lines are the
   format's edges at ``S = 1``; dashed ones are where those edges fall in
   unscaled units at ``S = 2**k`` (``k`` binades to the left). A module whose
   mass reaches left of the dashed red line still loses values at the chosen
   scale; one reaching right of the dashed purple line overflows.
3. **Loss-scale trajectory** (only for reports of more than one step): the
   scale in force at each step and after the scaler's update, on a log2 axis;
   red crosses are skipped optimizer steps (inf/NaN gradients), open circles
   the steps whose backward values were recorded, the dotted line the scale
   of panel 1.

matplotlib is optional (``pip install 'fpaudit[plot]'``) and imported only
when a figure is built, through its object API on the Agg canvas: no pyplot,
no global state, no display needed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from fpaudit.errors import Named, OptionError, UsageError
from fpaudit.numerics import layout, limits
from fpaudit.numerics.formats import Format, as_format
from fpaudit.numerics.recipes import get_recipe
from fpaudit.report.outputs import write_atomically
from fpaudit.report.store import Report
from fpaudit.rules import analysis
from fpaudit.text import count, module_label, percent

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "AXIS",
    "BAND_LABELS",
    "DPI",
    "FRACTIONS_GID",
    "MISSING_MATPLOTLIB",
    "WIDTH_INCHES",
    "binade_counts",
    "build_figure",
    "image_format",
    "plot_report",
]

WIDTH_INCHES = 11.0
DPI = 120  # for PNG; SVG is vector (and records the same size in inches)
MISSING_MATPLOTLIB = "fpaudit plot needs matplotlib: pip install 'fpaudit[plot]'"
IMAGE_FORMATS = {".png": "png", ".svg": "svg"}
BAND_LABELS = ("rounds to zero", "subnormal", "normal", "overflow")
_BAND_COLOURS = {
    "rounds to zero": ("#d62728", 0.16),
    "subnormal": ("#ff7f0e", 0.16),
    "normal": ("#2ca02c", 0.05),
    "overflow": ("#9467bd", 0.18),
}
_EDGE_COLOURS = ("#d62728", "#ff7f0e", "#9467bd")  # round-to-zero, smallest normal, overflow
_UNSCALED_COLOUR = "#7f7f7f"
_SCALED_COLOUR = "#1f77b4"
_REACH = 32  # a format edge this many binades beyond the mass still widens the x axis
_MAX_MODULE_LABELS = 48
FRACTIONS_GID = "fpaudit-fractions"  # the gid (SVG id) of the fractions text


# -- data: pure numpy -----------------------------------------------------------------------


# Every binade a value can reach at any fp32 loss scale: one x axis for every scale.
AXIS_LOW = min(analysis.UNSCALED_MIN + limits.LOG2_SCALE_MIN, layout.BINADE_MIN)
AXIS_HIGH = max(analysis.UNSCALED_MAX + limits.LOG2_SCALE_MAX, layout.BINADE_MAX)
AXIS = np.arange(AXIS_LOW, AXIS_HIGH + 1)


def binade_counts(condensed: analysis.Condensed, log2_scale: int) -> np.ndarray:
    """Counts per group and binade of ``|x * 2**log2_scale|``: ``counts[group, b - AXIS_LOW]``.

    Values that scale with the loss move from unscaled binade ``b`` to ``b + log2_scale``;
    the others stay in their recorded binade.
    """
    if not limits.LOG2_SCALE_MIN <= log2_scale <= limits.LOG2_SCALE_MAX:
        raise ValueError(f"log2_scale {log2_scale} is outside the range of an fp32 scale")
    counts = np.zeros((condensed.scaled.shape[0], len(AXIS)), dtype=np.int64)
    start = analysis.UNSCALED_MIN + log2_scale - AXIS_LOW
    counts[:, start : start + analysis.N_UNSCALED] += condensed.scaled.sum(axis=2)
    start = layout.BINADE_MIN - AXIS_LOW
    counts[:, start : start + layout.N_BINADES] += condensed.fixed.sum(axis=2)
    return counts


def _edges(fmt: Format) -> tuple[float, float, float]:
    """log2 of the round-to-zero edge, the smallest normal and the overflow edge."""
    return (
        math.log2(fmt.round_to_zero_edge),
        float(fmt.min_normal_exp),
        math.log2(fmt.overflow_edge),
    )


def _x_limits(
    binades: np.ndarray, masses: Sequence[np.ndarray], edges: Sequence[float]
) -> tuple[int, int]:
    """An x range (binade edges) holding all the mass, and each edge within reach of it."""
    occupied = np.zeros(len(binades), dtype=bool)
    for mass in masses:
        occupied |= mass > 0
    if occupied.any():
        low = int(binades[occupied][0])
        high = int(binades[occupied][-1]) + 1
        for edge in edges:
            if low - _REACH <= edge <= high + _REACH:
                low, high = min(low, math.floor(edge)), max(high, math.ceil(edge))
    else:
        low, high = math.floor(min(edges)), math.ceil(max(edges))
    return low - 2, high + 2


@dataclass(frozen=True)
class _Panel:
    """What the figure shows, computed before anything is drawn."""

    fmt: Format
    log2_scale: int
    recommended: bool
    binades: np.ndarray
    at_1: np.ndarray
    at_scale: np.ndarray
    totals_at_1: analysis.Totals
    totals_at_scale: analysis.Totals
    modules: list[str]
    per_module: np.ndarray  # [module, binade] at S = 1


def _panel_data(report: Report, fmt: Format, log2_scale: int, recommended: bool) -> _Panel:
    scope = analysis.default_scope(report)
    by_module = analysis.condense(report, scope, ("module",))
    per_module = binade_counts(by_module, 0)
    return _Panel(
        fmt=fmt,
        log2_scale=log2_scale,
        recommended=recommended,
        binades=AXIS,
        at_1=per_module.sum(axis=0),
        at_scale=binade_counts(by_module, log2_scale).sum(axis=0),
        totals_at_1=analysis.totals(report, fmt, 0, scope=scope),
        totals_at_scale=analysis.totals(report, fmt, log2_scale, scope=scope),
        modules=[str(m) for m in by_module.groups["module"]] if len(by_module.groups) else [],
        per_module=per_module,
    )


# -- drawing ---------------------------------------------------------------------------------


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError:
        raise UsageError(MISSING_MATPLOTLIB) from None


def _scale_name(log2_scale: int) -> str:
    return "S = 1" if log2_scale == 0 else f"S = 2^{log2_scale}"


def _resolve_scale(
    report: Report, fmt: Format, log2_scale: int | None, headroom_bits: int
) -> tuple[int, bool]:
    if log2_scale is not None:
        if not limits.LOG2_SCALE_MIN <= log2_scale <= limits.LOG2_SCALE_MAX:
            raise OptionError(
                "scale",
                f"2^{log2_scale} is outside the range of an fp32 scale "
                f"(2^{limits.LOG2_SCALE_MIN} to 2^{limits.LOG2_SCALE_MAX})",
            )
        return log2_scale, False
    from fpaudit.rules.recommendation import recommend

    recommended = recommend(report, fmt, headroom_bits).log2_scale
    return (0, False) if recommended is None else (recommended, True)


def _fraction_lines(panel_totals: Sequence[analysis.Totals], names: Sequence[str]) -> list[str]:
    """The fractions box: one column per scale, one row per kind of loss (monospaced)."""
    rows: list[list[str]] = [["lost to the format", *names]]
    for label, cells in (
        ("rounds to zero (underflow)", [(t.underflow_fraction, t.underflow) for t in panel_totals]),
        ("below normal (FTZ flushes)", [(t.flushed_fraction, t.flushed) for t in panel_totals]),
        ("overflow", [(t.overflow_fraction, t.overflow) for t in panel_totals]),
    ):
        rows.append([label] + [f"{percent(fraction)} ({count(n)})" for fraction, n in cells])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["   ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]  # fmt: skip
    first = panel_totals[0]
    lines.append(
        f"of {count(first.nonzero)} nonzero finite values "
        f"({count(first.zeros)} zeros, {count(first.nonfinite)} inf/NaN not counted)"
    )
    return lines


def _histogram_panel(ax: Axes, panel: _Panel) -> None:
    fmt, k = panel.fmt, panel.log2_scale
    rtz, normal, overflow = _edges(fmt)
    low, high = _x_limits(panel.binades, [panel.at_1, panel.at_scale], _edges(fmt))
    bands = (
        ("rounds to zero", low - 1e3, rtz, f"|x·S| ≤ 2^{rtz:g}"),
        ("subnormal", rtz, normal, f"< 2^{normal:g}: flush-to-zero hardware zeroes these"),
        ("normal", normal, overflow, ""),
        ("overflow", overflow, high + 1e3, f"≥ {fmt.overflow_edge:g} (2^{overflow:.4g})"),
    )
    for label, start, stop, detail in bands:
        colour, alpha = _BAND_COLOURS[label]
        text = f"{label}: {detail}" if detail else label
        ax.axvspan(start, stop, color=colour, alpha=alpha, linewidth=0, label=text)
        visible = (max(start, low), min(stop, high))
        if visible[1] - visible[0] >= len(label) * (high - low) / 120:  # room for the label
            ax.text(
                (visible[0] + visible[1]) / 2,
                0.02,
                label,
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="bottom",
                fontsize=8,
                color=colour,
                bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none", "pad": 1},
            )
    index = (panel.binades >= low) & (panel.binades < high)
    edges = np.append(panel.binades[index], panel.binades[index][-1] + 1).astype(float)
    suffix = " (recommended)" if panel.recommended else ""
    series = [(panel.at_1, "S = 1 (unscaled)", _UNSCALED_COLOUR)]
    if k != 0:
        series.append((panel.at_scale, f"{_scale_name(k)}{suffix}", _SCALED_COLOUR))
    peak = max(1, int(panel.at_1.max()), int(panel.at_scale.max()))
    for counts, label, colour in series:
        values = counts[index].astype(float)
        ax.stairs(
            values, edges, baseline=0.5, fill=True, color=colour, alpha=0.45, label=f"_{label}"
        )
        ax.stairs(values, edges, baseline=0.5, color=colour, linewidth=1.0, label=label)
    ax.set_yscale("log")
    decades = math.log10(peak) + 0.3
    ax.set_ylim(0.5, peak * 10 ** max(2.0, 0.75 * decades))  # room for the boxes at the top
    ax.set_xlim(low, high)
    ax.set_xlabel("log2 |x·S|  (binade: one bar holds [2^b, 2^(b+1)))")
    ax.set_ylabel("values")
    ax.grid(axis="x", alpha=0.25)
    ax.legend(loc="upper right", fontsize=7.5, framealpha=0.9)
    names = ["S = 1"] + ([f"{_scale_name(k)}{suffix}"] if k != 0 else [])
    totals = [panel.totals_at_1] + ([panel.totals_at_scale] if k != 0 else [])
    box = ax.text(
        0.01,
        0.97,
        "\n".join(_fraction_lines(totals, names)),
        transform=ax.transAxes,
        ha="left",
        va="top",
        family="monospace",
        fontsize=7.5,
        bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.9, "edgecolor": "#bbbbbb"},
    )
    box.set_gid(FRACTIONS_GID)
    if panel.totals_at_1.nonzero == 0:
        ax.text(0.5, 0.5, "no nonzero backward values in scope", transform=ax.transAxes,
                ha="center", va="center", fontsize=11)  # fmt: skip
    ax.set_title(
        f"Backward values against {fmt.name}: histogram by binade at S = 1 and "
        f"{_scale_name(k)}{suffix}",
        fontsize=10,
        loc="left",
    )


def _heatmap_panel(ax: Axes, panel: _Panel, figure: Figure, height: float) -> None:
    fmt, k = panel.fmt, panel.log2_scale
    edges_at_1 = _edges(fmt)
    edges_at_k = tuple(edge - k for edge in edges_at_1)
    low, high = _x_limits(panel.binades, list(panel.per_module), edges_at_1 + edges_at_k)
    ax.set_title(
        "Per module, values at S = 1 by binade; format edges at S = 1 (solid) "
        f"and where they fall at {_scale_name(k)} (dashed)",
        fontsize=10,
        loc="left",
    )
    if not panel.modules:
        ax.text(0.5, 0.5, "no modules with backward values in scope", transform=ax.transAxes,
                ha="center", va="center", fontsize=11)  # fmt: skip
        ax.set_xlim(low, high)
        ax.set_yticks([])
        return
    import matplotlib

    index = (panel.binades >= low) & (panel.binades < high)
    counts = panel.per_module[:, index]
    shown = np.ma.masked_equal(np.log10(counts + 1.0), 0.0)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    n = len(panel.modules)
    image = ax.imshow(
        shown,
        aspect="auto",
        interpolation="nearest",
        cmap=cmap,
        extent=(low, high, n - 0.5, -0.5),
        vmin=0.0,
    )
    every = max(1, math.ceil(n / _MAX_MODULE_LABELS))
    ticks = list(range(0, n, every))
    ax.set_yticks(ticks, [_literal(module_label(panel.modules[i])) for i in ticks], fontsize=7)
    names = ("round-to-zero edge", "smallest normal", "overflow edge")
    for edge, edge_k, colour, name in zip(
        edges_at_1, edges_at_k, _EDGE_COLOURS, names, strict=True
    ):
        ax.axvline(edge, color=colour, linewidth=1.4, label=f"{name}, S = 1")
        if k != 0:  # legend: one column per edge
            ax.axvline(edge_k, color=colour, linewidth=1.4, linestyle="--",
                       label=f"{name}, {_scale_name(k)}")  # fmt: skip
    ax.set_xlim(low, high)
    ax.set_xlabel("log2 |x|  at S = 1 (unscaled binade)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45 / height), fontsize=7,
              ncols=3, frameon=False)  # fmt: skip
    figure.colorbar(image, ax=ax, label="log10(count + 1)", pad=0.01, fraction=0.03)


def _steps_panel(ax: Axes, report: Report, panel: _Panel) -> None:
    from matplotlib.ticker import MaxNLocator

    steps = report.steps
    x = steps["step"].to_numpy()
    scale = steps["loss_scale"].to_numpy(dtype=float)
    after = steps["scale_after"].to_numpy(dtype=float)
    ax.plot(x, scale, drawstyle="steps-post", color=_SCALED_COLOUR, label="loss scale in force")
    ax.plot(x, after, drawstyle="steps-post", color="#ff7f0e", linestyle="--",
            linewidth=1.0, label="after the scaler's update")  # fmt: skip
    captured = steps["captured"].to_numpy(dtype=bool)
    if captured.any():
        ax.plot(x[captured], scale[captured], linestyle="none", marker="o", markersize=4,
                markerfacecolor="none", color="#2ca02c", label="captured (recorded)")  # fmt: skip
    skipped = steps["skipped"].to_numpy(dtype=bool)
    if skipped.any():
        ax.plot(x[skipped], scale[skipped], linestyle="none", marker="x", markersize=7,
                color="#d62728", label=f"skipped ({int(skipped.sum())})")  # fmt: skip
    ax.axhline(math.ldexp(1.0, panel.log2_scale), color="black", linestyle=":", linewidth=1,
               label=f"{_scale_name(panel.log2_scale)} (panel 1)")  # fmt: skip
    ax.set_yscale("log", base=2)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.grid(alpha=0.25)
    ax.legend(loc="best", fontsize=7.5, framealpha=0.9)
    ax.set_title("Loss scale over the run", fontsize=10, loc="left")


def _source(report: Report) -> str:
    info = report.info
    source = info.source
    captured_or_all = info.steps if info.steps is not None else len(report.steps)
    steps = info.steps_run if info.steps_run is not None else captured_or_all
    captured = info.steps if info.steps is not None else steps
    parts = [str(Path(str(source)).name)] if source else []
    parts.append(f"{steps} step(s)" + (f", {captured} captured" if captured != steps else ""))
    dtype = analysis.live_dtypes(report)
    if dtype:
        parts.append(f"live {dtype[0]} values")
    if not report.complete:
        parts.append("incomplete run")
    return ", ".join(parts)


def build_figure(
    report: Report,
    fmt: Format | str,
    log2_scale: int | None = None,
    *,
    headroom_bits: int = limits.DEFAULT_HEADROOM_BITS,
) -> Figure:
    """The figure of ``report`` against ``fmt`` at ``2**log2_scale`` (None: the recommended).

    Raises UsageError when matplotlib is missing. Nothing is drawn on screen.
    Module names and paths are data: their ``$`` are escaped (:func:`_literal`), so a
    name such as ``$\\nocommand$`` is drawn as written, while matplotlib's own tick
    labels (a log axis' ``10^5``) are still rendered as mathtext. Nothing goes to TeX.
    """
    _require_matplotlib()
    from matplotlib import rc_context

    with rc_context(_PLAIN_TEXT):
        return _build_figure(report, fmt, log2_scale, headroom_bits)


# Every Text reads these when it is made (tick labels: when drawn), whatever the user's
# matplotlibrc says: mathtext on, so that the tick formatters' ``$\mathdefault{10^{5}}$``
# renders and an escaped ``\$`` draws a ``$``; TeX off. User strings go through _literal.
_PLAIN_TEXT: dict[Any, Any] = {"text.parse_math": True, "text.usetex": False}


def _literal(text: str) -> str:
    """``text`` as matplotlib draws it literally: every ``$`` escaped as ``\\$``, so no
    pair of them starts mathtext; matplotlib turns each ``\\$`` back into ``$`` (its
    ``Text._preprocess_math``), which undoes this replacement exactly."""
    return text.replace("$", r"\$")


def _build_figure(
    report: Report, fmt: Format | str, log2_scale: int | None, headroom_bits: int
) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fmt = as_format(fmt)
    k, recommended = _resolve_scale(report, fmt, log2_scale, headroom_bits)
    panel = _panel_data(report, fmt, k, recommended)
    with_steps = len(report.steps) > 1
    # Heights in quarter inches: exact in binary, so the PNG is exactly figsize * DPI pixels.
    heat_height = min(10.0, max(2.5, round((1.3 + 0.16 * len(panel.modules)) * 4) / 4))
    heights = [4.5, heat_height] + ([2.5] if with_steps else [])
    figure = Figure(figsize=(WIDTH_INCHES, sum(heights) + 0.5), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(heights), 1, height_ratios=heights, squeeze=False)[:, 0]
    _histogram_panel(axes[0], panel)
    _heatmap_panel(axes[1], panel, figure, heat_height)
    if with_steps:
        _steps_panel(axes[2], report, panel)
    how = f"recommended with {headroom_bits} bits of headroom" if recommended else "as given"
    figure.suptitle(
        f"fpaudit: {fmt.name} backward range at {_scale_name(k)} ({how}) — "
        + _literal(_source(report)),
        fontsize=11,
    )
    return figure


# -- writing ---------------------------------------------------------------------------------


def image_format(path: str | os.PathLike[str]) -> str:
    """``png`` or ``svg``, from the suffix of ``path``; anything else is a UsageError."""
    kind = IMAGE_FORMATS.get(Path(path).suffix.lower())
    if kind is None:
        raise UsageError(Named("output"), f" must end in .png or .svg, got {os.fspath(path)}")
    return kind


def plot_report(
    report: Report,
    path: str | os.PathLike[str],
    fmt: Format | str,
    log2_scale: int | None = None,
    *,
    headroom_bits: int = limits.DEFAULT_HEADROOM_BITS,
) -> Path:
    """Draw :func:`build_figure` into ``path`` (``.png`` or ``.svg``), atomically; returns it.

    ``log2_scale`` None means the recommended scale for ``fmt`` (1 if there is none).
    The file is written beside the target and renamed over it, so a reader never
    sees half an image.
    """
    target = Path(path)
    kind = image_format(target)
    if target.is_dir():
        raise UsageError(
            Named("output"), f" {target} is a directory; give a file name ending in .{kind}"
        )
    figure = build_figure(report, fmt, log2_scale, headroom_bits=headroom_bits)
    return _save(figure, target, kind)


def _save(figure: Figure, target: Path, kind: str) -> Path:
    """Write ``figure`` to ``target`` atomically (``outputs.write_atomically``)."""
    from matplotlib import rc_context

    # SVG: keep text as text (searchable, smaller) and make the file reproducible.
    metadata = {"Date": None} if kind == "svg" else {}

    def draw(handle: BinaryIO) -> None:
        with rc_context({"svg.fonttype": "none", "svg.hashsalt": "fpaudit", **_PLAIN_TEXT}):
            figure.savefig(handle, format=kind, dpi=DPI, metadata=metadata)

    return write_atomically(target, draw, option="output")


# -- block-scaled recipes (--recipe) ------------------------------------------------------------


def build_block_figure(report: Report, recipes: Sequence[str]) -> Figure:
    """Block statistics of ``recipes`` (scanned with ``--recipe``), two panels:

    1. **Scale codes**: per recipe, how many blocks got each scale code (log scale):
       E8M0 codes as ``log2`` of the scale (``code - 127``); for ``nvfp4`` the E4M3 bit
       pattern; for fp32 scales the biased exponent less 127. Codes piled at the
       lowest value are blocks whose scale was clamped (or all-zero blocks).
    2. **Flush heatmap**: modules (network order) x recipes, colour the fraction of
       nonzero values flushed to zero, with the percentage written in each cell.
    """
    _require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from fpaudit.rules.blockplan import flush_matrix, scale_code_histogram

    names = list(dict.fromkeys(recipes))
    matrix = flush_matrix(report, list(names))
    heat_height = min(12.0, max(2.5, round((1.0 + 0.22 * len(matrix)) * 4) / 4))
    heights = [3.5, heat_height]
    figure = Figure(figsize=(WIDTH_INCHES, sum(heights) + 0.5), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    codes_ax, heat_ax = figure.subplots(2, 1, height_ratios=heights)
    for name in names:
        counts = scale_code_histogram(report, name)
        used = np.nonzero(counts)[0]
        if not len(used):
            continue
        codes = np.arange(used[0], used[-1] + 1)
        offset = get_recipe(name).scale_code_bias
        codes_ax.step(codes - offset, counts[codes], where="mid", label=_literal(name))
    codes_ax.set_yscale("log")
    codes_ax.set_xlabel("scale code (E8M0: log2 of the block scale; nvfp4: E4M3 bits)")
    codes_ax.set_ylabel("blocks")
    codes_ax.legend(fontsize=8)
    codes_ax.set_title("Scale codes of every block, all steps", fontsize=10, loc="left")
    values = matrix.to_numpy(dtype=np.float64)
    image = heat_ax.imshow(values, aspect="auto", cmap="Reds", vmin=0.0)
    heat_ax.set_xticks(range(len(names)), [_literal(n) for n in names], fontsize=8)
    heat_ax.set_yticks(
        range(len(matrix)), [_literal(module_label(m)) for m in matrix.index], fontsize=7
    )
    for row in range(values.shape[0]):
        for column in range(values.shape[1]):
            heat_ax.text(column, row, percent(values[row, column]), ha="center", va="center",
                         fontsize=6)  # fmt: skip
    figure.colorbar(image, ax=heat_ax, label="flushed fraction of nonzero values")
    heat_ax.set_title("Flushed (nonzero -> 0) per module and recipe", fontsize=10, loc="left")
    figure.suptitle("fpaudit: block-scaled recipes — " + _literal(_source(report)), fontsize=11)
    return figure


def plot_blocks(report: Report, path: str | os.PathLike[str], recipes: Sequence[str]) -> Path:
    """Draw :func:`build_block_figure` into ``path`` (``.png`` or ``.svg``), atomically."""
    target = Path(path)
    kind = image_format(target)
    if target.is_dir():
        raise UsageError(
            Named("output"), f" {target} is a directory; give a file name ending in .{kind}"
        )
    return _save(build_block_figure(report, recipes), target, kind)
