"""fpaudit: measure where the backward pass falls out of fp16, bf16 and fp8 range.

The library API the CLI is built on::

    import fpaudit

    with fpaudit.audit(model) as audit:
        for batch in batches:
            loss = loss_fn(model, batch)
            loss.backward()
            audit.step(loss=loss)
    report = audit.report
    print(fpaudit.recommend(report, "fp16").scale)
    report.write("my-report")
"""

from __future__ import annotations

__version__ = "0.1.0"

from typing import TYPE_CHECKING, Any

from fpaudit.analysis import Scope, module_table, range_loss
from fpaudit.formats import FORMATS, Fate, Format, get_format
from fpaudit.gate import GateResult, gate
from fpaudit.recommend import Recommendation, recommend
from fpaudit.report import LOSS_MODULE, Report

if TYPE_CHECKING:
    from fpaudit.capture import Audit, Selection, audit

# Capturing needs torch; reading a report does not. Import torch only when a
# capture name is first used, so `fpaudit show/recommend/gate` start fast.
_CAPTURE_NAMES = ("Audit", "Selection", "audit")


def __getattr__(name: str) -> Any:
    if name in _CAPTURE_NAMES:
        from fpaudit import capture

        return getattr(capture, name)
    raise AttributeError(f"module 'fpaudit' has no attribute {name!r}")


__all__ = [
    "FORMATS",
    "LOSS_MODULE",
    "Audit",
    "Fate",
    "Format",
    "GateResult",
    "Recommendation",
    "Report",
    "Scope",
    "Selection",
    "__version__",
    "audit",
    "gate",
    "get_format",
    "module_table",
    "range_loss",
    "recommend",
]
