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

import builtins
from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fpaudit.capture.audit import Audit as Audit
    from fpaudit.capture.audit import Selection as Selection
    from fpaudit.capture.audit import audit as audit
    from fpaudit.capture.compiled import compile as compile
    from fpaudit.kernels.blockstats import block_stats as block_stats
    from fpaudit.numerics.formats import FORMATS as FORMATS
    from fpaudit.numerics.formats import Fate as Fate
    from fpaudit.numerics.formats import Format as Format
    from fpaudit.numerics.formats import get_format as get_format
    from fpaudit.numerics.recipes import RECIPES as RECIPES
    from fpaudit.numerics.recipes import Recipe as Recipe
    from fpaudit.numerics.recipes import get_recipe as get_recipe
    from fpaudit.report.records import LOSS_MODULE as LOSS_MODULE
    from fpaudit.report.store import Report as Report
    from fpaudit.rules.analysis import Scope as Scope
    from fpaudit.rules.analysis import module_table as module_table
    from fpaudit.rules.analysis import range_loss as range_loss
    from fpaudit.rules.blockplan import block_gate as block_gate
    from fpaudit.rules.blockplan import block_table as block_table
    from fpaudit.rules.blockplan import plan as plan
    from fpaudit.rules.gating import GateResult as GateResult
    from fpaudit.rules.gating import gate as gate
    from fpaudit.rules.recommendation import Recommendation as Recommendation
    from fpaudit.rules.recommendation import recommend as recommend

# The public names, each declared once here with the module it lives in; ``__all__`` is
# derived from it. The imports above repeat them for type checkers only (``X as X``: a
# name loaded lazily has no other way to be seen, and re-exported, by mypy);
# tests/project/test_architecture.py checks the two agree.
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
    return sorted([*_WHERE, "__version__"])


# ``from fpaudit import *`` must not shadow a builtin: ``fpaudit.compile`` is used by name.
__all__ = sorted(name for name in [*_WHERE, "__version__"] if not hasattr(builtins, name))
