"""What fpaudit prints about block-scaled recipes: `recipes`, `show`/`gate --recipe`
and `plan`. Results go to stdout, messages to stderr."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rich.table import Table

from fpaudit.cli.render import (
    change_text,
    comparison_grid,
    fraction_text,
    json_records,
    only_in,
    stdout,
    table_power,
)
from fpaudit.numerics.recipes import Recipe, as_recipe
from fpaudit.text import count, expected_count, module_label, percent

if TYPE_CHECKING:
    import pandas as pd

    from fpaudit.rules.blockplan import BlockGateResult, RecipePlan
    from fpaudit.rules.comparison import BlockComparison


# -- block-scaled recipes (--recipe) -----------------------------------------
def recipes(items: Iterable[Recipe]) -> None:
    """The recipes, cheapest first, one row each."""
    items = list(items)
    rows = [r.summary for r in items]
    table = Table(
        title="Block-scaled recipes (--recipe), cheapest first; element thresholds after "
        "the block scale",
        title_justify="left",
    )
    headers = ("recipe", "element", "block", "rule", "scale", "round", "to 0 ≤", "normal", "max")
    for header in headers:
        table.add_column(header, no_wrap=True, justify="left" if header == "recipe" else "right")
    for row, recipe in zip(rows, items, strict=True):
        below = row.element_may_flush_below
        flush_at = row.element_flush_at
        table.add_row(
            row.recipe,
            row.element.split("_", 1)[-1],
            row.block,
            row.scale_rule,
            row.scale_format,
            "SR" if recipe.expected else "RN",
            f"< {table_power(below)}" if below is not None else table_power(flush_at or 0.0),
            table_power(row.element_smallest_normal),
            f"{row.element_max:g}",
        )
    console = stdout()
    console.print(table)
    console.print(
        "mx-floor: OCP E8M0 2^(floor(log2 amax) - emax), the block max may saturate; mx-rceil: "
        "2^ceil(log2(amax/max)); nvfp4: E4M3 per 16 under an fp32 per-tensor scale; pow2-floor: "
        "(max/amax) rounded down to a power of two. Add :col for columnwise blocks. RN: "
        "round to nearest; SR: stochastic rounding, whose counts are expected values."
    )


BLOCK_JSON_KEYS = (
    "nonzero",
    "flushed",
    "subnormal",
    "saturated",
    "poisoned",
    "blocks",
    "blocks_flushed",
    "scales_out_of_range",
    "flush_fraction",
    "saturate_fraction",
    "subnormal_fraction",
)


def block_rows(table: pd.DataFrame) -> list[dict[str, Any]]:
    keys = [c for c in ("module", "kind", "node", "op") if c in table.columns]
    return json_records(table[[*keys, *BLOCK_JSON_KEYS]])


EXPECTED_NOTE = "stochastic rounding: expected counts over its random draws"


def block_table(
    table: pd.DataFrame, recipe: str, by: str, top: int | None = None, kind: str | None = None
) -> None:
    expected = as_recipe(recipe).expected
    what = "expected flushed" if expected else "flushed"
    values = f"{kind} values" if kind is not None else "values"
    grid = Table(
        title=f"{recipe}: {what} (nonzero -> 0), subnormal and saturated {values} per {by}, "
        "all steps" + (f" ({EXPECTED_NOTE})" if expected else ""),
        title_justify="left",
    )
    keys = ["module"] + (["kind", "op"] if by == "op" else [])
    for key in keys:
        grid.add_column(key, no_wrap=True)
    for header in (
        "nonzero",
        "flushed",
        "subnormal",
        "saturated",
        "blocks",
        "w/ flush",
        "scale out",
    ):
        grid.add_column(header, justify="right", no_wrap=True)
    rows = table if top is None else table.head(top)
    for row in rows.itertuples():
        cells = [module_label(str(row.module))]
        if by == "op":
            cells += [str(row.kind), str(row.op)]
        cells += [
            count(row.nonzero),
            percent(float(row.flush_fraction)),
            percent(float(row.subnormal_fraction)),
            percent(float(row.saturate_fraction)),
            count(row.blocks),
            expected_count(row.blocks_flushed),
            count(row.scales_out_of_range),
        ]
        grid.add_row(*cells)
    stdout().print(grid)


def block_gate(result: BlockGateResult) -> None:
    console = stdout()
    verdict = "PASS" if result.passed else "FAIL"
    if not result.measured:
        console.print(
            f"FAIL: {result.recipe}: no nonzero value was measured, so nothing was judged."
        )
        return
    expected = "expected " if result.expected else ""
    console.print(
        f"{verdict}: {result.recipe}: {expected}flushed {percent(result.flush_fraction)} of "
        f"{count(result.nonzero)} nonzero values (limit {percent(result.max_flush)}), "
        f"{expected}saturated {percent(result.saturate_fraction)} "
        f"(limit {percent(result.max_saturate)})."
        + (f" ({EXPECTED_NOTE})" if result.expected else "")
    )
    for offender in result.offenders:
        console.print(
            f"  {module_label(offender.module)}: {expected}flushed "
            f"{percent(offender.flush_fraction)} ({expected_count(offender.flushed)} of "
            f"{count(offender.nonzero)}), {expected}saturated "
            f"{percent(offender.saturate_fraction)}"
        )


def plan_names(result: RecipePlan) -> None:
    """``plan --names``: the modules to keep in bf16, one a line."""
    for name in result.keep:
        sys.stdout.write(f"{module_label(name)}\n")


def plan(result: RecipePlan) -> None:
    """The cheapest passing recipe per GEMM module, and what stays in bf16."""
    console = stdout()
    if not result.modules:
        console.print(
            "No candidate: no module that owns a weight ran a matrix multiply in backward "
            "(or the report predates GEMM operand statistics: scan again). Frameworks "
            "quantize only Linear/GEMM operands, so every module stays in bf16."
        )
    else:
        grid = Table(
            title=f"Cheapest passing recipe per GEMM module, judged on its backward GEMM "
            f"operands (flush ≤ {percent(result.max_flush)}, saturate ≤ "
            f"{percent(result.max_saturate)}; tried {', '.join(result.recipes)})",
            title_justify="left",
        )
        for header in ("module", "recipe", "flushed", "saturated", "limited by"):
            grid.add_column(header, no_wrap=header != "limited by")
        for m in result.modules:
            grid.add_row(
                module_label(m.module),
                m.recipe,
                "-" if m.flush_fraction is None else percent(m.flush_fraction),
                "-" if m.saturate_fraction is None else percent(m.saturate_fraction),
                m.limiting or "-",
            )
        console.print(grid)
        keep = result.keep
        console.print(
            f"{len(keep)} of {len(result.modules)} GEMM modules must stay in bf16"
            + (f": {', '.join(module_label(k) for k in keep)}" if keep else ".")
        )
    for single in result.single_limits:
        flag = "--max-saturate" if single.limit == "max_saturate" else "--max-flush"
        what = "saturates" if single.limit == "max_saturate" else "flushes"
        limit = result.max_saturate if single.limit == "max_saturate" else result.max_flush
        line = (
            f"{single.recipe} is ruled out for every kept module by {flag} {limit:g} alone: it "
            f"{what} up to {percent(single.needed)} of a module's operands "
            f"({flag} {single.needed:.3g} would pass it)"
        )
        if single.alternatives:
            flags = " ".join(f"--recipe {name}" for name in single.alternatives)
            line += f"; the round-up scale rule never saturates: scan with {flags}"
        console.print(line + ".")
    if result.not_candidates:
        console.print(
            f"Not candidates (no GEMM with a weight; frameworks keep them in bf16): "
            f"{', '.join(module_label(m) for m in result.not_candidates)}."
        )
    expected = [name for name in result.recipes if as_recipe(name).expected]
    if expected:
        console.print(f"{', '.join(expected)}: {EXPECTED_NOTE}; fractions are expected ones.")


# -- diff --recipe -----------------------------------------------------------
def block_comparison(result: BlockComparison) -> None:
    """diff --recipe: the whole model's change, one note per difference, the table."""
    console = stdout()
    overall = result.overall
    console.print(
        f"{result.recipe}: flushed {fraction_text(overall.base_flush)} -> "
        f"{fraction_text(overall.new_flush)} ({change_text(overall.flush_change)}), saturated "
        f"{fraction_text(overall.base_saturate)} -> {fraction_text(overall.new_saturate)}; "
        f"steps: BASE {result.base_steps}, NEW {result.new_steps}."
    )
    for note in result.notes:
        console.print(f"note: {note}")
    columns = ("BASE flush", "NEW flush", "change", "BASE sat", "NEW sat", "BASE values",
               "NEW values")  # fmt: skip
    title = f"BASE {result.base_report} vs NEW {result.new_report}, {result.recipe} per module"
    grid = comparison_grid(title, [("module", None)], columns)
    for row in result.rows:
        cells = [
            fraction_text(row.base_flush),
            fraction_text(row.new_flush),
            only_in(row.present) or change_text(row.flush_change),
            fraction_text(row.base_saturate),
            fraction_text(row.new_saturate),
            "-" if row.base_nonzero is None else count(row.base_nonzero),
            "-" if row.new_nonzero is None else count(row.new_nonzero),
        ]
        worse = (row.flush_change or 0.0) > 0 or (row.saturate_change or 0.0) > 0
        grid.add_row(module_label(row.module), *cells, style="red" if worse else None)
    console.print(grid)
