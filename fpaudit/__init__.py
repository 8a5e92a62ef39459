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

from fpaudit.analysis import Scope, module_table, range_loss
from fpaudit.capture import LOSS_MODULE, Audit, audit
from fpaudit.formats import FORMATS, Fate, Format, get_format
from fpaudit.gate import GateResult, gate
from fpaudit.recommend import Recommendation, recommend
from fpaudit.report import Report

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
    "__version__",
    "audit",
    "gate",
    "get_format",
    "module_table",
    "range_loss",
    "recommend",
]
