"""Build small reports from tensors, without running a model."""

from __future__ import annotations

import torch

from fpaudit import histogram
from fpaudit.report import KIND_BACKWARD, RecordKey, Report, ReportBuilder, StepRecords


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
    return builder.build({})
