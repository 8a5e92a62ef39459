"""How a command shows its result: one interface, a formatter per output.

A :class:`Formatter` writes one kind of result: :class:`Terminal` draws it (a function
of :mod:`fpaudit.cli.render` or of the command's ``render_CMD`` module), :class:`Json`
prints its JSON shape on stdout (its ``to_dict()`` unless the result declares
another), :class:`JUnit` and :class:`GitHubAnnotations` (:mod:`fpaudit.cli.ci`) write
the gate's verdict for CI. Each result's pair of terminal and JSON writers is declared
once below (:class:`Outputs`); a command picks its formatter once
(``GATE.chosen(options.json)``) and hands it the result, never branching on ``--json``
itself.

Unlike pip-audit's ``VulnerabilityFormat.format(result) -> str``, a formatter writes
rather than returns text: the terminal's tables are drawn by rich on the console, whose
width and colours only the console knows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TextIO, TypeVar

from fpaudit.cli import (
    render,
    render_blocks,
    render_fp16plan,
    render_run,
    render_show,
    render_simulate,
)

if TYPE_CHECKING:
    import pandas as pd

    from fpaudit.numerics.formats import Format
    from fpaudit.numerics.recipes import Recipe
    from fpaudit.report.store import Report
    from fpaudit.rules.blockplan import BlockGateResult, RecipePlan
    from fpaudit.rules.comparison import BlockComparison, Comparison
    from fpaudit.rules.delayed import Replay as DelayedReplay
    from fpaudit.rules.delayed import Sweep as DelayedSweep
    from fpaudit.rules.gating import GateResult
    from fpaudit.rules.simulation import Simulation
    from fpaudit.rules.skips import SkipVerdict
    from fpaudit.rules.summary import ModuleView, OriginsView, RecommendationView, StepsView
    from fpaudit.run.fp16plan import Fp16Plan
    from fpaudit.run.verify import Verification

R = TypeVar("R")
R_in = TypeVar("R_in", contravariant=True)


class Formatter(Protocol[R_in]):
    """Writes one result (on stdout, or a file of its own)."""

    def write(self, result: R_in) -> None: ...


def to_dict(result: Any) -> Any:
    """A result's JSON shape: its ``to_dict()``."""
    return result.to_dict()


@dataclass(frozen=True)
class Terminal(Generic[R]):
    """The result drawn for a person: ``draw`` prints it."""

    draw: Callable[[R], None]

    def write(self, result: R) -> None:
        self.draw(result)


@dataclass(frozen=True)
class Json(Generic[R]):
    """``--json``: ``shape(result)`` as indented JSON on stdout."""

    shape: Callable[[R], Any] = to_dict

    def write(self, result: R) -> None:
        render.print_json(self.shape(result))


@dataclass(frozen=True)
class Outputs(Generic[R]):
    """A result's two writers: the terminal's ``draw`` (the result first, then any
    keywords of its layout) and its JSON ``shape``."""

    draw: Callable[..., None]
    shape: Callable[[R], Any] = to_dict

    def chosen(self, as_json: bool | None, **layout: Any) -> Formatter[R]:
        """The formatter ``--json`` picks; ``layout``: what the terminal's ``draw``
        takes besides the result (the JSON shape is the result's alone)."""
        if as_json:
            return Json(self.shape)
        return Terminal(functools.partial(self.draw, **layout) if layout else self.draw)


@dataclass(frozen=True)
class JUnit:
    """``gate --junit FILE``: one test case per module (and per failure) for CI, written
    atomically to ``path``; ``report`` is the gated report, at ``report_path``."""

    path: Path
    report: Report
    report_path: str
    include_loss: bool

    def write(self, result: GateResult) -> None:
        from fpaudit.cli import ci

        modules = ci.gate_modules(self.report, result, include_loss=self.include_loss)
        ci.write_junit(ci.junit_xml(result, modules, report_path=self.report_path), self.path)


@dataclass(frozen=True)
class GitHubAnnotations:
    """The gate's failures as GitHub Actions workflow commands, one per line on
    ``stream`` (stderr under ``--json``, which keeps stdout parseable)."""

    report_path: str
    stream: TextIO

    def write(self, result: GateResult) -> None:
        from fpaudit.cli import ci

        for line in ci.github_annotations(result, report_path=self.report_path):
            self.stream.write(line + "\n")


# -- each result's writers, declared once --------------------------------------
# A terminal drawing that needs more than the result takes it as keywords (how many
# rows, the report it came from): ``chosen(as_json, top=5)`` hands them to ``draw``.
def _format_rows(formats: Iterable[Format]) -> list[dict[str, Any]]:
    return [f.limits.to_dict() for f in formats]


def _recipe_rows(recipes: Iterable[Recipe]) -> list[dict[str, Any]]:
    return [r.summary.to_dict() for r in recipes]


def _formats_and_recipes(formats: Iterable[Format]) -> None:
    """``fpaudit formats``: the formats' table, then the recipes' (``recipes --json``
    lists those as JSON)."""
    from fpaudit.numerics.recipes import RECIPES

    render.formats(formats)
    render_blocks.recipes(RECIPES.values())


def _modules(view: ModuleView, *, report: Report) -> None:
    """``show``: the module table, then what fp16 autocast would hold."""
    from fpaudit.capture import autocast

    render.show(view)
    render.autocast_prediction(autocast.summary(report))


def _steps(view: StepsView, *, report: Report, limit: int) -> None:
    render_show.steps_view(report, limit, list(view.findings))


def _origins(view: OriginsView, *, top: int) -> None:
    render_show.origins_view(view.live, view.predicted, view.format, view.log2_scale, top=top)


def _blocks(table: pd.DataFrame, *, recipe: str, by: str, kind: str) -> None:
    render_blocks.block_table(table, recipe, by, kind=kind)


def _recommendation(view: RecommendationView) -> None:
    """``recommend``: the worst window it judged (--worst-window), the recommendation,
    and how the scale drifted."""
    worst = view.window
    if worst is not None:
        render.stdout().print(
            f"Worst window: steps {worst.first_step}-{worst.last_step} "
            f"({worst.captured_steps} captured step(s)); the recommendation below is its own."
        )
    render.recommendation(view.recommendation)
    for line in render_run.drift_lines(view.drift):
        render.stdout().print(line)


FORMATS: Outputs[Iterable[Format]] = Outputs(_formats_and_recipes, _format_rows)
RECIPES: Outputs[Iterable[Recipe]] = Outputs(render_blocks.recipes, _recipe_rows)
MODULES: Outputs[ModuleView] = Outputs(_modules, lambda view: view.rows())
STEPS: Outputs[StepsView] = Outputs(_steps)
ORIGINS: Outputs[OriginsView] = Outputs(_origins)
SKIPS: Outputs[SkipVerdict] = Outputs(render_show.skips_view)
BLOCKS: Outputs[pd.DataFrame] = Outputs(_blocks, render_blocks.block_rows)
RECOMMENDATION: Outputs[RecommendationView] = Outputs(_recommendation)
SIMULATION: Outputs[Simulation] = Outputs(render_simulate.simulation)
FP8_REPLAY: Outputs[DelayedReplay] = Outputs(render_simulate.fp8_replay)
FP8_SWEEP: Outputs[DelayedSweep] = Outputs(render_simulate.fp8_sweep)
# the gate's reasons name the flags (--max-underflow), as its terminal words do
GATE: Outputs[GateResult] = Outputs(render.gate, lambda result: result.to_dict(flags=True))
BLOCK_GATE: Outputs[BlockGateResult] = Outputs(render_blocks.block_gate)
COMPARISON: Outputs[Comparison] = Outputs(render.comparison)
BLOCK_COMPARISON: Outputs[BlockComparison] = Outputs(render_blocks.block_comparison)
PLAN: Outputs[RecipePlan] = Outputs(render_blocks.plan)
PLAN_NAMES: Formatter[RecipePlan] = Terminal(render_blocks.plan_names)  # plan --names
VERIFICATION: Outputs[Verification] = Outputs(render.verification)
FP16_PLAN: Outputs[Fp16Plan] = Outputs(render_fp16plan.fp16_plan)
