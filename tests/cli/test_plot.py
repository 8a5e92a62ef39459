"""fpaudit.cli.plot: the figures are drawn from the exact counts, and the files are real images."""

from __future__ import annotations

import math
import re
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib")

from matplotlib.figure import Figure

from fpaudit.cli.plot import (
    AXIS_LOW,
    BAND_LABELS,
    DPI,
    FRACTIONS_GID,
    MISSING_MATPLOTLIB,
    binade_counts,
    build_figure,
    image_format,
    plot_report,
)
from fpaudit.errors import UsageError
from fpaudit.numerics.formats import FORMATS
from fpaudit.report.store import Report
from fpaudit.rules import analysis
from fpaudit.rules.recommendation import recommend

from ..conftest import ROOT, SAMPLES
from ..reports import report_from

FP16 = FORMATS["fp16"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SAMPLE_MODELS = ["convnet.py", "mlp.py", "quadratic.py", "transformer.py"]


def _values(pairs: list[tuple[float, int]], zeros: int = 0) -> torch.Tensor:
    """A tensor holding ``count`` copies of each ``value`` (alternating signs) and some zeros."""
    parts = [torch.full((n,), v) * torch.tensor([(-1) ** i for i in range(n)]) for v, n in pairs]
    return torch.cat([*parts, torch.zeros(zeros)]).float()


def _report(steps: int = 1) -> Report:
    """Module 'a' scales with the loss; the root module's one value does not.

    In fp16 at S = 1: 2^-27 and 2^-30 round to zero, 2^-20 is subnormal, 1024 is normal.
    At S = 2^8: 2^-27 -> 2^-19 subnormal, 2^-20 -> 2^-12 normal, 1024 -> 2^18 overflows;
    the root's 2^-30 does not move and still rounds to zero.
    """
    a = _values([(2.0**-27, 4), (2.0**-20, 3), (0.25, 5), (1024.0, 2)], zeros=6)
    return report_from({"": _values([(2.0**-30, 1)]), "a": a}, steps=steps, fixed=frozenset({""}))


def _stairs(ax: Any) -> dict[str, dict[int, int]]:
    """The labelled histogram series of panel 1: label -> {binade: count} (nonzero only)."""
    series = {}
    for patch in ax.patches:
        if patch.get_label().startswith("S = "):
            values, edges, _ = patch.get_data()
            series[patch.get_label()] = {
                int(edge): int(v) for edge, v in zip(edges[:-1], values, strict=True) if v > 0
            }
    return series


def _fractions(fig: Figure) -> dict[str, list[tuple[float, int]]]:
    """The fractions box, parsed: row label -> [(fraction, count) per scale column]."""
    (box,) = [t for t in fig.axes[0].texts if t.get_gid() == FRACTIONS_GID]
    rows = {}
    for line in box.get_text().splitlines()[1:4]:
        label = line.split("  ")[0]
        cells = re.findall(r"([0-9.e+-]+)% \(([\d,]+)\)", line)
        rows[label] = [(float(p) / 100, int(c.replace(",", ""))) for p, c in cells]
    return rows


def _assert_matches_totals(
    cells: list[tuple[float, int]], totals: list[analysis.Totals], key: str
) -> None:
    assert len(cells) == len(totals)
    for (fraction, count), expected in zip(cells, totals, strict=True):
        assert count == getattr(expected, key)
        # printed to 3 significant digits
        assert fraction == pytest.approx(getattr(expected, f"{key}_fraction"), rel=5e-3, abs=0)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    length, chunk = struct.unpack(">I4s", data[8:16])
    assert chunk == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _assert_real_png(path: Path, fig: Figure) -> None:
    import matplotlib.image

    width_in, height_in = fig.get_size_inches()
    assert _png_size(path) == (round(width_in * DPI), round(height_in * DPI))
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[:2] == (round(height_in * DPI), round(width_in * DPI))
    rgb = pixels[..., :3]
    assert rgb.std() > 0.05  # not blank
    colours = np.unique((rgb * 255).round().astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 100


# -- what is drawn ---------------------------------------------------------------------------


def test_binade_counts_move_the_scaled_mass_and_keep_the_fixed_one() -> None:
    report = _report()
    condensed = analysis.condense(report, analysis.default_scope(report), ("module",))
    assert list(condensed.groups["module"]) == ["", "a"]
    for k in (0, 8, -3):
        counts = binade_counts(condensed, k)

        def at(group: int, binade: int, c: np.ndarray = counts) -> int:
            return int(c[group, binade - AXIS_LOW])

        assert at(0, -30) == 1  # fixed: never moves
        assert (at(1, -27 + k), at(1, -20 + k), at(1, -2 + k), at(1, 10 + k)) == (4, 3, 5, 2)
        assert counts.sum() == analysis.totals(report, FP16, k).nonzero == 15


def test_the_fractions_printed_are_the_exact_counts_of_analysis() -> None:
    report = _report()
    fig = build_figure(report, FP16, 8)
    totals = [
        analysis.totals(report, FP16, k, scope=analysis.default_scope(report)) for k in (0, 8)
    ]
    # hand-counted (see _report): S = 1 then S = 2^8
    assert [t.underflow for t in totals] == [5, 1]
    assert [t.flushed for t in totals] == [8, 5]
    assert [t.overflow for t in totals] == [0, 2]
    rows = _fractions(fig)
    _assert_matches_totals(rows["rounds to zero (underflow)"], totals, "underflow")
    _assert_matches_totals(rows["below normal (FTZ flushes)"], totals, "flushed")
    _assert_matches_totals(rows["overflow"], totals, "overflow")
    (box,) = [t for t in fig.axes[0].texts if t.get_gid() == FRACTIONS_GID]
    assert "S = 2^8" in box.get_text().splitlines()[0]
    assert "of 15 nonzero finite values (6 zeros, 0 inf/NaN not counted)" in box.get_text()


def test_the_histogram_shows_the_values_at_1_and_shifted_by_k() -> None:
    fig = build_figure(_report(), FP16, 8)
    ax = fig.axes[0]
    series = _stairs(ax)
    assert series == {
        "S = 1 (unscaled)": {-30: 1, -27: 4, -20: 3, -2: 5, 10: 2},
        "S = 2^8": {-30: 1, -19: 4, -12: 3, 6: 5, 18: 2},  # the fixed 2^-30 stays
    }
    assert ax.get_yscale() == "log"
    low, high = ax.get_xlim()
    assert low < -30 and high > 19  # all the mass, and the format's edges
    assert low < -25 and high > math.log2(FP16.overflow_edge)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    for band in BAND_LABELS:
        assert any(text.startswith(band) for text in legend), (band, legend)
    assert "rounds to zero: |x·S| ≤ 2^-25" in legend
    assert any("65520" in text for text in legend)  # the overflow edge


def test_the_recommended_scale_is_the_default() -> None:
    # a ladder, one value a binade from 1 down to 2^-39: each binade of S up to the
    # headroom's ceiling (1 * 2^11 <= 4094 < 2^12) saves one more value, so S = 2^11
    report = report_from({"a": torch.tensor([2.0**-j for j in range(40)])})
    k = recommend(report, FP16).log2_scale
    assert k == 11
    fig = build_figure(report, FP16)
    assert f"S = 2^{k} (recommended)" in _stairs(fig.axes[0])
    assert "recommended with 4 bits of headroom" in fig.get_suptitle()
    rows = _fractions(fig)
    _assert_matches_totals(
        rows["overflow"],
        [analysis.totals(report, FP16, 0), analysis.totals(report, FP16, k)],
        "overflow",
    )
    # more headroom: a smaller scale
    fewer = build_figure(report, FP16, headroom_bits=6)
    assert f"S = 2^{k - 2} (recommended)" in _stairs(fewer.axes[0])


def test_the_heatmap_has_one_row_per_module_in_network_order_and_the_edges() -> None:
    fig = build_figure(_report(), FP16, 8)
    ax = fig.axes[1]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["(root)", "a"]
    (image,) = ax.get_images()
    data = image.get_array()
    low, high = ax.get_xlim()
    assert data.shape == (2, high - low)
    counts = np.rint(10 ** data.filled(0.0) - 1).astype(int)

    def column(binade: int) -> int:
        return int(binade - low)

    assert counts[0, column(-30)] == 1
    assert [counts[1, column(b)] for b in (-27, -20, -2, 10)] == [4, 3, 5, 2]
    assert counts.sum() == 15
    assert data.mask[0, column(-27)]  # no values: masked (drawn white)
    edges = [-25.0, -14.0, math.log2(FP16.overflow_edge)]
    solid = sorted(line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == "-")
    dashed = sorted(line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == "--")
    assert solid == pytest.approx(edges)
    assert dashed == pytest.approx([e - 8 for e in edges])  # edges move left by k


def test_the_steps_panel_only_for_reports_of_several_steps() -> None:
    one = build_figure(_report(steps=1), FP16, 8)
    titles = [ax.get_title(loc="left") for ax in one.axes]
    assert len(one.axes) == 3  # histogram, heatmap, the heatmap's colour bar
    assert "Loss scale over the run" not in titles

    report = _report(steps=4)
    report.steps["loss_scale"] = [2.0**16, 2.0**16, 2.0**15, 2.0**15]
    report.steps["scale_after"] = [2.0**16, 2.0**15, 2.0**15, 2.0**16]
    report.steps["skipped"] = [False, True, False, False]
    report.steps["captured"] = [True, True, False, True]
    fig = build_figure(report, FP16, 8)
    assert len(fig.axes) == 4
    ax = fig.axes[2]
    assert ax.get_title(loc="left") == "Loss scale over the run"
    assert ax.get_yscale() == "log"
    lines = {line.get_label(): line for line in ax.lines}
    assert list(lines["loss scale in force"].get_ydata()) == [2.0**16, 2.0**16, 2.0**15, 2.0**15]
    assert list(lines["after the scaler's update"].get_ydata())[1] == 2.0**15
    skipped = lines["skipped (1)"]
    assert list(skipped.get_xdata()) == [1] and skipped.get_marker() == "x"
    assert list(lines["captured (recorded)"].get_xdata()) == [0, 1, 3]
    assert list(lines["S = 2^8 (panel 1)"].get_ydata()) == [2.0**8, 2.0**8]


def test_a_report_without_values_still_plots(tmp_path: Path) -> None:
    report = report_from({"a": torch.zeros(10)})
    assert recommend(report, FP16).log2_scale is None
    fig = build_figure(report, FP16)  # no recommendation: S = 1
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "no nonzero backward values in scope" in texts
    assert "S = 1 (as given)" in fig.get_suptitle()
    _assert_real_png(plot_report(report, tmp_path / "empty.png", FP16), fig)


# -- the files -------------------------------------------------------------------------------


def test_png_is_a_real_image_of_the_figure_size(tmp_path: Path) -> None:
    report = _report(steps=2)
    path = plot_report(report, tmp_path / "sub" / "plot.png", "fp16", 8)
    assert path == tmp_path / "sub" / "plot.png"
    _assert_real_png(path, build_figure(report, FP16, 8))
    assert _png_size(path)[0] == 11 * DPI
    assert sorted(p.name for p in path.parent.iterdir()) == ["plot.png"]  # no temporary left


def test_svg_is_parseable_with_text_kept_as_text(tmp_path: Path) -> None:
    report = _report(steps=2)
    path = plot_report(report, tmp_path / "plot.svg", FP16, 8)
    root = ET.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert root.get("width", "").endswith("pt") and root.get("height", "").endswith("pt")
    assert float(root.get("width", "0")[:-2]) == pytest.approx(11 * 72)
    drawn = [e for e in root.iter() if e.tag.rsplit("}", 1)[-1] in ("path", "use")]
    assert len(drawn) > 100
    assert [e for e in root.iter() if e.tag.endswith("}image")]  # the heatmap
    text = " ".join("".join(e.itertext()) for e in root.iter() if e.tag.endswith("}text"))
    for band in BAND_LABELS:
        assert band in text
    assert "rounds to zero (underflow)" in text and "Loss scale over the run" in text
    assert "(root)" in text
    # reproducible: no date, fixed ids
    assert path.read_bytes() == plot_report(report, tmp_path / "again.svg", FP16, 8).read_bytes()


def test_an_existing_image_is_replaced_and_a_failed_write_leaves_it_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "plot.png"
    target.write_bytes(b"old")
    plot_report(_report(), target, FP16, 8)
    assert target.read_bytes()[:8] == PNG_SIGNATURE

    def broken(self: Figure, fname: Any, **kwargs: Any) -> None:
        fname.write(b"half an image")
        raise RuntimeError("disk on fire")

    before = target.read_bytes()
    monkeypatch.setattr(Figure, "savefig", broken)
    with pytest.raises(RuntimeError, match="disk on fire"):
        plot_report(_report(), target, FP16, 8)
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]


# -- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["plot.pdf", "plot", "plot.png.txt", "plot.jpg"])
def test_a_suffix_other_than_png_or_svg_is_a_usage_error(tmp_path: Path, name: str) -> None:
    with pytest.raises(UsageError) as error:
        plot_report(_report(), tmp_path / name, FP16)
    assert str(error.value) == f"output must end in .png or .svg, got {tmp_path / name}"
    assert "\n" not in str(error.value)
    assert list(tmp_path.iterdir()) == []


def test_suffixes_are_case_insensitive() -> None:
    assert image_format("a/B.PNG") == "png" and image_format("x.Svg") == "svg"


def test_a_directory_or_unwritable_target_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "dir.png").mkdir()
    with pytest.raises(UsageError, match="is a directory"):
        plot_report(_report(), tmp_path / "dir.png", FP16)
    (tmp_path / "file").write_text("")
    with pytest.raises(
        UsageError, match=r"^output: cannot create folder .*file: a file is in the way"
    ):
        plot_report(_report(), tmp_path / "file" / "plot.png", FP16)


def test_a_scale_outside_fp32_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="outside the range of an fp32 scale"):
        build_figure(_report(), FP16, 128)


def test_missing_matplotlib_is_a_usage_error_with_the_install_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(UsageError) as error:
        plot_report(_report(), tmp_path / "plot.png", FP16)
    assert str(error.value) == MISSING_MATPLOTLIB
    assert MISSING_MATPLOTLIB == "fpaudit plot needs matplotlib: pip install 'fpaudit[plot]'"
    with pytest.raises(UsageError, match=re.escape("pip install 'fpaudit[plot]'")):
        build_figure(_report(), FP16)
    assert list(tmp_path.iterdir()) == []


def test_importing_the_module_does_not_import_matplotlib() -> None:
    code = "import sys, fpaudit.cli.plot; assert 'matplotlib' not in sys.modules, 'imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# -- the sample models and the README image --------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", SAMPLE_MODELS)
def test_every_sample_model_plots(tmp_path: Path, name: str) -> None:
    from fpaudit.run.scan import ScanOptions, scan

    steps = 1 if name == "transformer.py" else 2  # the transformer takes seconds a step
    report = scan(SAMPLES / name, ScanOptions(steps=steps))
    fig = build_figure(report, FP16)
    k = recommend(report, FP16).log2_scale
    assert k is not None
    scope = analysis.default_scope(report)
    totals = [analysis.totals(report, FP16, s, scope=scope) for s in ((0, k) if k else (0,))]
    rows = _fractions(fig)
    for label, key in [
        ("rounds to zero (underflow)", "underflow"),
        ("below normal (FTZ flushes)", "flushed"),
        ("overflow", "overflow"),
    ]:
        _assert_matches_totals(rows[label], totals, key)
    # panel 1's series hold every nonzero value, at both scales
    for counts in _stairs(fig.axes[0]).values():
        assert sum(counts.values()) == totals[0].nonzero
    modules = [t.get_text() for t in fig.axes[1].get_yticklabels()]
    in_order = [m or "(root)" for m in report.meta["modules"] if (m or "(root)") in modules]
    assert modules == in_order and modules  # quadratic.py: all in the root module
    assert len(fig.axes) == (4 if steps > 1 else 3)
    _assert_real_png(plot_report(report, tmp_path / f"{name}.png", FP16), fig)


def test_the_readme_image_is_a_small_png() -> None:
    image = ROOT / "docs" / "images" / "transformer-fp16.png"
    width, height = _png_size(image)
    assert width == 11 * DPI and height > 1000
    assert image.stat().st_size < 250_000
    assert (ROOT / "docs" / "images" / "make_example.py").is_file()


def test_the_plot_command(cli, tmp_path: Path) -> None:
    from ..conftest import one_error_line

    report_from({"a": torch.tensor([2.0**-30, 1.0, 3.0])}, steps=2).write(tmp_path / "r")
    done = cli("plot", tmp_path / "r", "-o", tmp_path / "r.svg", "--scale", "2^4")
    assert done.code == 0, done.stderr
    assert done.stdout.strip() == f"Wrote {tmp_path / 'r.svg'}"
    assert ET.parse(tmp_path / "r.svg").getroot().tag.endswith("svg")
    assert "plot needs --output FILE.png" in one_error_line(cli("plot", tmp_path / "r"))
    assert "--output must end in .png or .svg" in one_error_line(
        cli("plot", tmp_path / "r", "-o", tmp_path / "r.jpg")
    )
    assert not (tmp_path / "r.jpg").exists()


def _markup_report() -> Report:
    """A one-step audit, block statistics included, of a module named like mathtext."""
    import fpaudit

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleDict(
                {"$\\nocommand$": torch.nn.Linear(64, 64), "b": torch.nn.Linear(64, 64)}
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers.values():
                x = layer(x)
            return x

    torch.manual_seed(0)
    model = Model()
    with fpaudit.audit(model, recipes=["mxfp8-e4m3", "mxfp4"]) as audit:
        loss = model(torch.randn(8, 64)).sum()
        loss.backward()
        audit.step(loss=loss)
    return audit.report


@pytest.mark.parametrize("figure", ["fp16", "blocks"])
def test_log_axis_tick_labels_render_and_module_names_stay_literal(
    tmp_path: Path, figure: str
) -> None:
    # The log axes' tick formatters write mathtext ("$\mathdefault{10^{5}}$"): it must be
    # rendered, not printed raw, while a module named "$\nocommand$" is drawn as written.
    from matplotlib.cbook import is_math_text

    from fpaudit.cli.plot import build_block_figure, plot_blocks

    report = _markup_report()
    recipes = ["mxfp8-e4m3", "mxfp4"]
    built = build_figure(report, FP16) if figure == "fp16" else build_block_figure(report, recipes)
    built.canvas.draw()
    log_axes = [ax for ax in built.axes if ax.get_yscale() == "log"]
    assert log_axes  # the histogram / the scale-code histogram
    for ax in log_axes:
        labels = [label for label in ax.get_yticklabels() if label.get_text()]
        assert any("mathdefault" in label.get_text() for label in labels)  # mathtext source
        for label in labels:  # ... parsed when drawn: neither "$" nor "mathdefault" shows
            assert is_math_text(label.get_text()) and label.get_parse_math(), label
    # what the file shows (SVG keeps text as text; comments, which hold the mathtext
    # source, are not drawn): no "mathdefault" anywhere, "$" only in the module's name
    path = tmp_path / "plot.svg"
    if figure == "fp16":
        plot_report(report, path, FP16)
    else:
        plot_blocks(report, path, recipes)
    root = ET.parse(path).getroot()
    texts = ["".join(e.itertext()).strip() for e in root.iter() if e.tag.endswith("}text")]
    assert not [t for t in texts if "mathdefault" in t]
    assert [t for t in texts if "$" in t] == ["layers.$\\nocommand$"]


def test_plot_base_new_overlays_fractions_and_draws_each_module_s_change(
    cli, tmp_path: Path
) -> None:
    from fpaudit.cli.plot import AXIS
    from fpaudit.cli.plot_diff import binade_fractions, build_comparison_figure
    from fpaudit.rules.comparison import compare

    # NEW a: 4 of 8 values at 2**-30 (under fp16's edge 2**-25 at S = 1), BASE a: none
    # -> a change of +0.5, a bar of 50 percentage points; b is the same in both: 0.
    base = report_from({"a": torch.ones(8), "b": torch.ones(4)})
    new = report_from({"a": torch.tensor([2.0**-30] * 4 + [1.0] * 4), "b": torch.ones(4)})
    fractions = binade_fractions(new, 0)
    # 12 nonzero values: 4 in binade -30, 8 in binade 0
    assert fractions[AXIS == -30][0] == 4 / 12 and fractions[AXIS == 0][0] == 8 / 12
    result = compare(base, new, "fp16", log2_scale=0)
    figure = build_comparison_figure(result, base, new)
    strip = figure.axes[1]
    widths = [patch.get_width() for patch in strip.patches]
    assert widths == [50.0, 0.0]
    assert [label.get_text() for label in strip.get_yticklabels()] == ["a", "b"]
    base.write(tmp_path / "base")
    new.write(tmp_path / "new")
    done = cli("plot", tmp_path / "base", tmp_path / "new", "-o", tmp_path / "diff.png")
    assert done.code == 0, done.stderr
    assert (tmp_path / "diff.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    same = cli("plot", tmp_path / "new", tmp_path / "new", "-o", tmp_path / "same.png")
    assert "same report" in same.stderr and same.code == 2
