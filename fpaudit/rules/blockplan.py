"""Block-scaled statistics as tables, a gate and a precision plan: pure functions
over a report's ``blocks`` table (no torch, no I/O).

Fractions are of the values that could be lost: ``nonzero`` counts the finite
nonzero elements (flushed + subnormal + normal + saturated + poisoned).
``flush_fraction`` is ``flushed / nonzero``; ``saturate_fraction`` is
``saturated / nonzero``. The pseudo-module ``<loss>`` (the loss and its seed)
is left out of gates and plans, as the other analyses leave it out by default.

A stochastic-rounding recipe (``nvfp4-sr``, ``Recipe.expected``) has expected counts:
flushed, subnormal, normal, saturated and blocks_flushed are floats, and fractions
are expected fractions. ``nonzero`` stays a whole number (each element's class
probabilities sum to 1, so the float64 sum is rounded back to the count). A
round-to-nearest recipe's counts are ints, as before.

The plan models the recipes as frameworks apply them: Transformer Engine and
torchao quantize only the operands of matrix multiplies (a Linear's input, weight
and output gradient), not norms, activations, embeddings or losses. So its
candidates are the modules that own a weight and run a matrix multiply in backward,
and it judges the operands of those backward GEMMs as the GEMM reads them (the
blocks table's ``operand`` rows, see :data:`fpaudit.report.records.KIND_OPERAND`); every
other module is not a candidate and stays as it is (bf16).

The plan's cost order is each recipe's ``cost`` (see :mod:`fpaudit.numerics.recipes`):
mxfp4 < mxfp4-rceil < nvfp4 < nvfp4-sr < mxfp8-e4m3 < ... < mxfp8-e5m2-rceil <
fp8-block-1x128 < fp8-block-128x128 < fp8-tensor-* < bf16, cheaper meaning
fewer bits per element and coarser scales. A candidate that no requested recipe
passes stays in bf16.

Known limitations: the plan judges backward operands (the output gradient and the
saved input and weight that backward multiplies by); the forward GEMM's operands are
the same input and weight, blocked along the other dimension, and are not judged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from fpaudit.errors import Named, OptionError, UsageError
from fpaudit.numerics.recipes import RECIPES, Recipe, as_recipe
from fpaudit.report.data import ReportData
from fpaudit.report.records import BLOCK_COUNT_COLUMNS, KIND_BACKWARD, KIND_OPERAND, LOSS_MODULE
from fpaudit.text import percent

KEEP_FORMAT = "bf16"  # what a module no recipe passes stays in
LIMITS = ("flush_fraction", "saturate_fraction")


def _blocks(report: ReportData, recipe: Recipe) -> pd.DataFrame:
    if report.blocks is None or recipe.name not in report.recipes:
        recorded = ", ".join(report.recipes) or "none"
        raise UsageError(
            f"the report has no block statistics for recipe {recipe.name!r} "
            f"(recorded: {recorded}); scan or run with ",
            Named("recipes", (recipe.name,)),
        )
    return report.blocks[report.blocks["recipe"] == recipe.name]


def block_table(
    report: ReportData,
    recipe: Recipe | str,
    by: tuple[str, ...] = ("module",),
    kind: str | None = KIND_BACKWARD,
) -> pd.DataFrame:
    """Counts and fractions of ``recipe`` summed over steps and ranks, one row per
    group of ``by`` (columns of the blocks table: module, op, kind...), in the
    report's module order, worst flush fraction first within equal modules.
    ``kind`` keeps only that kind's rows (``backward``, the default, as every table
    of a report; ``grad``; ``forward``; None: all, grouped by kind when ``by`` has
    it): a parameter gradient is recorded both as the backward op's output and as
    the ``grad`` it becomes, so a sum over both kinds counts it twice."""
    recipe = as_recipe(recipe)
    blocks = _blocks(report, recipe)
    if kind is not None:
        blocks = blocks[blocks["kind"] == kind]
    counts = list(BLOCK_COUNT_COLUMNS)
    table = blocks.groupby(list(by), sort=False, as_index=False)[counts].sum()
    nonzero_sum = table[["flushed", "subnormal", "normal", "saturated", "poisoned"]].sum(axis=1)
    table["nonzero"] = nonzero_sum.round().astype(np.int64)
    if not recipe.expected:  # exact counts: whole numbers (float64 in the report)
        table[counts] = table[counts].astype(np.int64)
    nonzero = table["nonzero"].to_numpy(dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        table["flush_fraction"] = np.where(nonzero > 0, table["flushed"] / nonzero, 0.0)
        table["saturate_fraction"] = np.where(nonzero > 0, table["saturated"] / nonzero, 0.0)
        table["subnormal_fraction"] = np.where(nonzero > 0, table["subnormal"] / nonzero, 0.0)
    if "module" in by:
        order = {name: i for i, name in enumerate(report.info.modules)}
        table["_order"] = table["module"].map(lambda m: order.get(m, len(order)))
        table = table.sort_values(["_order", "flush_fraction"], ascending=[True, False])
        table = table.drop(columns="_order")
    return table.reset_index(drop=True)


def scale_code_histogram(report: ReportData, recipe: Recipe | str) -> np.ndarray:
    """How many blocks got each scale code (256 counts), over the whole report."""
    blocks = _blocks(report, as_recipe(recipe))
    if not len(blocks):
        return np.zeros(256, dtype=np.int64)
    counts: np.ndarray = np.sum(np.stack(blocks["scale_codes"].to_numpy()), axis=0)
    return counts.astype(np.int64)


def flush_matrix(report: ReportData, recipes: list[Recipe | str]) -> pd.DataFrame:
    """Flush fraction per module (rows, report order) and recipe (columns)."""
    columns = {}
    for recipe in recipes:
        table = block_table(report, recipe)
        columns[as_recipe(recipe).name] = table.set_index("module")["flush_fraction"]
    return pd.DataFrame(columns)


@dataclass(frozen=True)
class BlockOffender:
    """A module (or ``"(all modules)"``) whose flush or saturation fraction under the
    recipe exceeds its limit; ``flushed``/``saturated`` are ints, except a
    stochastic-rounding recipe's expected counts."""

    module: str
    flush_fraction: float
    saturate_fraction: float
    flushed: float
    saturated: float
    nonzero: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BlockGateResult:
    passed: bool
    recipe: str
    max_flush: float
    max_saturate: float
    flush_fraction: float
    saturate_fraction: float
    flushed: float  # an int, except for a stochastic-rounding recipe's expected count
    saturated: float
    nonzero: int
    offenders: list[BlockOffender] = field(default_factory=list)
    measured: bool = True  # False: no nonzero value was measured (a failing gate)
    expected: bool = False  # counts and fractions are expected values (stochastic rounding)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(replace(self, offenders=[]))
        data["offenders"] = [offender.to_dict() for offender in self.offenders]
        return data


def _check_fraction(value: float, name: str) -> None:
    if not 0.0 <= value <= 1.0:  # also rejects NaN
        raise OptionError(name, f"must be a fraction between 0 and 1, got {value}")


def block_gate(
    report: ReportData,
    recipe: Recipe | str,
    max_flush: float,
    max_saturate: float = 0.0,
    *,
    per_module: bool = True,
) -> BlockGateResult:
    """Fail when a module's (or, without ``per_module``, the whole report's) flush or
    saturation fraction under ``recipe`` exceeds its limit, or when nothing nonzero
    was measured (a gate that saw nothing must not pass)."""
    recipe = as_recipe(recipe)
    _check_fraction(max_flush, "max_flush")
    _check_fraction(max_saturate, "max_saturate")
    table = block_table(report, recipe)
    table = table[table["module"] != LOSS_MODULE]
    flushed, saturated = _count(table["flushed"].sum()), _count(table["saturated"].sum())
    nonzero = int(table["nonzero"].sum())
    rows = table.itertuples() if per_module else []
    offenders = [
        _offender(str(r.module), r._asdict())
        for r in rows
        if r.flush_fraction > max_flush or r.saturate_fraction > max_saturate
    ]
    flush_fraction = flushed / nonzero if nonzero else 0.0
    saturate_fraction = saturated / nonzero if nonzero else 0.0
    if not per_module and (flush_fraction > max_flush or saturate_fraction > max_saturate):
        offenders.append(
            BlockOffender(
                "(all modules)", flush_fraction, saturate_fraction, flushed, saturated, nonzero
            )
        )
    return BlockGateResult(
        passed=nonzero > 0 and not offenders,
        recipe=recipe.name,
        max_flush=max_flush,
        max_saturate=max_saturate,
        flush_fraction=flush_fraction,
        saturate_fraction=saturate_fraction,
        flushed=flushed,
        saturated=saturated,
        nonzero=nonzero,
        offenders=offenders,
        measured=nonzero > 0,
        expected=recipe.expected,
    )


def _count(value: Any) -> float:
    """A summed count as Python: an int for exact counts, a float for expected ones."""
    number: float = value.item() if hasattr(value, "item") else value
    return number


def _offender(module: str, row: dict[str, Any]) -> BlockOffender:
    return BlockOffender(
        module=module,
        flush_fraction=float(row["flush_fraction"]),
        saturate_fraction=float(row["saturate_fraction"]),
        flushed=_count(row["flushed"]),
        saturated=_count(row["saturated"]),
        nonzero=int(row["nonzero"]),
    )


@dataclass(frozen=True)
class ModulePlan:
    module: str
    recipe: str  # the cheapest passing recipe, or KEEP_FORMAT
    # Under the chosen recipe; None for a module kept in bf16 (no recipe applies to it)
    flush_fraction: float | None
    saturate_fraction: float | None
    # What stopped the module from being one step cheaper: the statistic that ruled out
    # the recipe just below the chosen one in cost order ("flush 3.1% (mxfp4)", printed
    # as the table prints fractions, so a tiny one over a 0 limit does not read 0.00%);
    # for a module kept in bf16, the most expensive recipe tried (the one just below
    # bf16); "" when the cheapest recipe passes.
    limiting: str
    nonzero: int


@dataclass(frozen=True)
class SingleLimit:
    """Every kept candidate was ruled out for ``recipe`` by one limit alone: with it
    relaxed to ``needed``, ``recipe`` would pass them all;
    ``alternatives``: recipes not tried that avoid the limit by construction (the
    ``-rceil`` rules never saturate), for a scan with ``--recipe``."""

    limit: str  # "max_saturate" or "max_flush"
    recipe: str
    needed: float  # the largest fraction of ``limit`` among the kept candidates under recipe
    alternatives: list[str]


@dataclass(frozen=True)
class RecipePlan:
    recipes: list[str]  # cheapest first
    max_flush: float
    max_saturate: float
    modules: list[ModulePlan]  # the candidates: modules whose backward GEMM operands were seen
    # Modules with backward values but no GEMM operand: frameworks do not quantize them
    not_candidates: list[str] = field(default_factory=list)
    # per recipe tried, cheapest first: the one limit that alone keeps every kept candidate
    single_limits: list[SingleLimit] = field(default_factory=list)

    @property
    def keep(self) -> list[str]:
        """Candidates that must stay in bf16/fp32: no requested recipe passes them."""
        return [m.module for m in self.modules if m.recipe == KEEP_FORMAT]

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipes": self.recipes,
            "max_flush": self.max_flush,
            "max_saturate": self.max_saturate,
            "modules": [asdict(m) for m in self.modules],
            "keep_in_bf16": self.keep,
            "not_candidates": self.not_candidates,
            "single_limits": [asdict(s) for s in self.single_limits],
        }


def plan(
    report: ReportData, recipes: list[Recipe | str], max_flush: float, max_saturate: float = 0.0
) -> RecipePlan:
    """Per candidate module (one whose backward GEMM operands were recorded), the
    cheapest of ``recipes`` whose flush and saturation fractions on those operands stay
    within the limits, and the statistic that ruled out the next cheaper recipe (the one
    just below it in cost order; for a module kept in bf16, the most expensive recipe):
    what stopped the module from being one step cheaper. A recipe that fails both
    limits is named by its flush fraction. Other modules with backward values are listed
    in ``not_candidates``."""
    if not recipes:
        raise UsageError("plan needs at least one recipe")
    _check_fraction(max_flush, "max_flush")
    _check_fraction(max_saturate, "max_saturate")
    chosen = sorted(dict.fromkeys(as_recipe(r) for r in recipes), key=lambda r: r.cost)
    tables = {r.name: block_table(report, r, kind=KIND_OPERAND).set_index("module") for r in chosen}
    modules = [m for m in tables[chosen[0].name].index if m != LOSS_MODULE]
    backward = block_table(report, chosen[0])["module"]
    not_candidates = [m for m in backward if m != LOSS_MODULE and m not in set(modules)]
    planned = []
    for module in modules:
        limiting = ""  # the last recipe ruled out so far: the one just below the next
        decided: ModulePlan | None = None
        for recipe in chosen:
            row = tables[recipe.name].loc[module]
            flush, saturate = float(row["flush_fraction"]), float(row["saturate_fraction"])
            if flush <= max_flush and saturate <= max_saturate and int(row["nonzero"]) > 0:
                decided = ModulePlan(
                    module, recipe.name, flush, saturate, limiting, int(row["nonzero"])
                )
                break
            expected = "expected " if recipe.expected else ""
            if int(row["nonzero"]) == 0:
                limiting = f"nothing measured ({recipe.name})"
            elif flush > max_flush:
                limiting = f"{expected}flush {percent(flush)} ({recipe.name})"
            else:
                limiting = f"{expected}saturate {percent(saturate)} ({recipe.name})"
        if decided is None:
            nonzero = int(tables[chosen[0].name].loc[module]["nonzero"])
            decided = ModulePlan(module, KEEP_FORMAT, None, None, limiting, nonzero)
        planned.append(decided)
    kept = [m.module for m in planned if m.recipe == KEEP_FORMAT]
    single = _single_limits(chosen, tables, kept, max_flush, max_saturate)
    return RecipePlan(
        [r.name for r in chosen], max_flush, max_saturate, planned, not_candidates, single
    )


def _single_limits(
    chosen: list[Recipe],
    tables: dict[str, pd.DataFrame],
    kept: list[str],
    max_flush: float,
    max_saturate: float,
) -> list[SingleLimit]:
    """Per recipe tried, the one limit that alone rules it out for every kept
    candidate (none for a recipe that fails them for both, or not at all)."""
    found: list[SingleLimit] = []
    if not kept:
        return found
    for recipe in chosen:
        rows = tables[recipe.name].loc[kept]
        if (rows["nonzero"] <= 0).any():
            continue
        flush, saturate = rows["flush_fraction"], rows["saturate_fraction"]
        if (flush <= max_flush).all():  # saturation alone rules it out
            rceil = [
                r.name
                for r in RECIPES.values()
                if r.scale_rule == "mx-rceil"
                and recipe.scale_rule == "mx-floor"
                and (r.element, r.block) == (recipe.element, recipe.block)
                and r.name not in tables
            ]
            found.append(SingleLimit("max_saturate", recipe.name, float(saturate.max()), rceil))
        elif (saturate <= max_saturate).all():  # flushing alone
            found.append(SingleLimit("max_flush", recipe.name, float(flush.max()), []))
    return found
