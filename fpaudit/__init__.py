"""fpaudit: measure where the backward pass falls out of fp16, bf16 and fp8 range.

The library API the CLI is built on::

    import fpaudit

    with fpaudit.audit(model) as audit:
        for batch in batches:
            loss = loss_fn(model, batch)
            loss.backward()
            audit.step(loss=loss)
    report = audit.report
    print(fpaudit.recommend(report, "fp16").scale)   # a format name or a Format
    report.write("my-report")
"""

from __future__ import annotations

__version__ = "0.1.0"

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fpaudit.capture.audit import Audit, Selection, audit
    from fpaudit.capture.compiled import compile
    from fpaudit.kernels.blockstats import block_stats
    from fpaudit.numerics.formats import FORMATS, Fate, Format, get_format
    from fpaudit.numerics.recipes import RECIPES, Recipe, get_recipe
    from fpaudit.report.records import LOSS_MODULE
    from fpaudit.report.store import Report
    from fpaudit.rules.analysis import Scope, module_table, range_loss
    from fpaudit.rules.blockplan import block_gate, block_table, plan
    from fpaudit.rules.gating import GateResult, gate
    from fpaudit.rules.recommendation import Recommendation, recommend

# Names load on first use (no module of the package shares a name with one of these, or
# importing it would shadow the name): capturing needs torch but not pandas or pyarrow
# (about 70 MB a training process need not carry); reading a report needs
# pandas and pyarrow but not torch (1.6 s of start-up).
_WHERE = {
    "Scope": "rules.analysis",
    "module_table": "rules.analysis",
    "range_loss": "rules.analysis",
    "block_gate": "rules.blockplan",
    "block_table": "rules.blockplan",
    "plan": "rules.blockplan",
    "block_stats": "kernels.blockstats",
    "RECIPES": "numerics.recipes",
    "Recipe": "numerics.recipes",
    "get_recipe": "numerics.recipes",
    "Audit": "capture.audit",
    "Selection": "capture.audit",
    "audit": "capture.audit",
    "compile": "capture.compiled",
    "FORMATS": "numerics.formats",
    "Fate": "numerics.formats",
    "Format": "numerics.formats",
    "get_format": "numerics.formats",
    "GateResult": "rules.gating",
    "gate": "rules.gating",
    "Recommendation": "rules.recommendation",
    "recommend": "rules.recommendation",
    "LOSS_MODULE": "report.records",
    "Report": "report.store",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'fpaudit' has no attribute {name!r}")
    return getattr(import_module(f"fpaudit.{module}"), name)


def __dir__() -> list[str]:
    """The public names only (not ``Any``, ``import_module``, ... nor loaded submodules)."""
    return sorted(__all__)


__all__ = [
    "FORMATS",
    "LOSS_MODULE",
    "RECIPES",
    "Audit",
    "Fate",
    "Format",
    "GateResult",
    "Recipe",
    "Recommendation",
    "Report",
    "Scope",
    "Selection",
    "__version__",
    "audit",
    "block_gate",
    "block_stats",
    "block_table",
    "compile",
    "gate",
    "get_format",
    "get_recipe",
    "module_table",
    "plan",
    "range_loss",
    "recommend",
]
