"""Build small reports from tensors, without running a model."""

from __future__ import annotations

import numpy as np
import torch

from fpaudit.kernels import histogram
from fpaudit.report.records import KIND_BACKWARD, RecordKey, ReportBuilder, StepRecords
from fpaudit.report.store import Report
from fpaudit.rules import analysis


def report_from(
    tensors: dict[str, torch.Tensor],
    *,
    loss_scale: float = 1.0,
    steps: int = 1,
    fixed: frozenset[str] = frozenset(),
    window: int = 1,
) -> Report:
    """One backward record per module name (op 'aten.mul.Tensor'), repeated for ``steps`` steps.

    Modules named in ``fixed`` are recorded as not scaling with the loss.
    """
    builder = ReportBuilder(modules=list(tensors), window=window)
    for _ in range(steps):
        records = {}
        for module, tensor in tensors.items():
            hist = histogram.Histogram(tensor.device)
            hist.add(tensor)
            host = hist.host()
            key = RecordKey(KIND_BACKWARD, module, "MulBackward0", "aten.mul.Tensor", 0, "float32",
                            module not in fixed)  # fmt: skip
            records[key] = host
        builder.add_step(
            StepRecords.from_histograms(records), loss=1.0, loss_scale=loss_scale, seconds=0.0
        )
    return Report.from_builder(builder)


def report_of_steps(values: list[torch.Tensor], *, loss_scale: float = 1.0) -> Report:
    """One backward record (module 'a') per step, holding ``values[step]``."""
    builder = ReportBuilder(modules=["a"])
    for tensor in values:
        hist = histogram.Histogram(tensor.device)
        hist.add(tensor)
        key = RecordKey(KIND_BACKWARD, "a", "MulBackward0", "aten.mul.Tensor", 0, "float32", True)
        builder.add_step(
            StepRecords.from_histograms({key: hist.host()}),
            loss=1.0,
            loss_scale=loss_scale,
            seconds=0.0,
        )
    return Report.from_builder(builder)


def bins_per_module(
    report: Report, kind: str = KIND_BACKWARD
) -> dict[str, tuple[int, bytes, bytes]]:
    """Every module's values of ``kind`` (the loss pseudo-module included), binned exactly:
    (elements, scaled bins, fixed bins), for comparing a report with its twin's."""
    condensed = analysis.condense(report, analysis.Scope(kinds=(kind,), include_loss=True))
    return {
        str(module): (
            int(condensed.groups["elements"].iloc[i]),
            np.ascontiguousarray(condensed.scaled[i]).tobytes(),
            np.ascontiguousarray(condensed.fixed[i]).tobytes(),
        )
        for i, module in enumerate(condensed.groups["module"])
    }
