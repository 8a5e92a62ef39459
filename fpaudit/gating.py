"""The CI gate: pass when the underflow fraction at a scale stays under a threshold.

The gate fails when the underflow fraction (overall, or of any module with
``per_module``) exceeds ``max_underflow``, or when any value overflows at the
scale: a scale that overflows would make a dynamic scaler skip the step and a
static one train on inf. It also fails on a report whose run was interrupted,
unless ``allow_incomplete``. The scale defaults to the recommended one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from fpaudit import analysis
from fpaudit.formats import Format, as_format
from fpaudit.recommendation import DEFAULT_HEADROOM_BITS, recommend
from fpaudit.report import Report


@dataclass(frozen=True)
class GateResult:
    passed: bool
    format: str
    log2_scale: int
    scale: float
    scale_source: str  # "recommended" or "given"
    max_underflow: float
    underflow_fraction: float
    underflow: int
    nonzero: int
    overflow: int
    per_module: bool
    offenders: list[dict[str, Any]] = field(default_factory=list)
    complete: bool = True  # False: the report's run was interrupted
    incomplete_allowed: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gate(
    report: Report,
    fmt: Format | str,
    max_underflow: float,
    *,
    log2_scale: int | None = None,
    per_module: bool = False,
    headroom_bits: int = DEFAULT_HEADROOM_BITS,
    include_loss: bool = False,
    allow_incomplete: bool = False,
) -> GateResult:
    """Judge ``report`` at ``2**log2_scale`` (default: the recommended scale)."""
    fmt = as_format(fmt)
    if not 0.0 <= max_underflow <= 1.0:
        raise ValueError("max_underflow must be a fraction between 0 and 1")
    scale_source = "given"
    if log2_scale is None:
        recommended = recommend(report, fmt, headroom_bits, include_loss=include_loss)
        log2_scale = recommended.log2_scale if recommended.log2_scale is not None else 0
        scale_source = "recommended"
    scope = analysis.default_scope(report, include_loss)
    overall = analysis.totals(report, fmt, log2_scale, scope=scope)
    offenders: list[dict[str, Any]] = []
    if per_module:
        for row in analysis.module_table(report, fmt, log2_scale, scope=scope).itertuples():
            if row.underflow_fraction > max_underflow or row.overflow > 0:
                offenders.append(_offender(str(row.module), row._asdict()))
    elif overall["underflow_fraction"] > max_underflow or overall["overflow"] > 0:
        offenders.append(_offender("(all modules)", overall))
    return GateResult(
        passed=not offenders and (report.complete or allow_incomplete),
        format=fmt.name,
        log2_scale=log2_scale,
        scale=math.ldexp(1.0, log2_scale),
        scale_source=scale_source,
        max_underflow=max_underflow,
        underflow_fraction=float(overall["underflow_fraction"]),
        underflow=int(overall["underflow"]),
        nonzero=int(overall["nonzero"]),
        overflow=int(overall["overflow"]),
        per_module=per_module,
        offenders=offenders,
        complete=report.complete,
        incomplete_allowed=allow_incomplete,
    )


def _offender(module: str, row: dict[str, Any]) -> dict[str, Any]:
    return {
        "module": module,
        "underflow_fraction": float(row["underflow_fraction"]),
        "underflow": int(row["underflow"]),
        "nonzero": int(row["nonzero"]),
        "overflow": int(row["overflow"]),
    }
