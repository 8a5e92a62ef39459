"""The step state of ``fpaudit run``: what each optimizer step did, and the steps table.

``training.TrainingMonitor`` fills a :class:`Step` per optimizer step and a
:class:`Span` per accumulated batch; device values (scales, inf checks, norms,
losses) stay 0-dim tensors in a :class:`ScalarLog` until the run ends, then are
read in one transfer per device. :func:`steps_table` turns the steps and those
values into the report's steps table (every column of ``STEP_COLUMNS``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fpaudit.findings import SpanScale
from fpaudit.records import STEP_COLUMNS, STEP_DEFAULTS

__all__ = ["ScalarLog", "Span", "Step", "steps_table"]


class ScalarLog:
    """0-dim tensors kept on their device until the run ends, then read in one
    transfer per device. Stacked 256 at a time, so a long run holds few tensors."""

    _CHUNK = 256

    def __init__(self) -> None:
        self._pending: dict[torch.device, list[torch.Tensor]] = {}
        self._chunks: dict[torch.device, list[torch.Tensor]] = {}
        self._slots: list[tuple[torch.device, int]] = []
        self._counts: dict[torch.device, int] = {}

    def add(self, value: torch.Tensor) -> int:
        """Keep a copy of ``value`` (so later in-place changes do not show); its slot."""
        device = value.device
        dtype = torch.float32 if device.type == "mps" else torch.float64
        copy = value.detach().reshape(()).to(dtype=dtype, copy=True)
        pending = self._pending.setdefault(device, [])
        pending.append(copy)
        slot = self._counts.get(device, 0)
        self._counts[device] = slot + 1
        if len(pending) == self._CHUNK:
            self._chunks.setdefault(device, []).append(torch.stack(pending))
            pending.clear()
        self._slots.append((device, slot))
        return len(self._slots) - 1

    def read(self) -> np.ndarray:
        """Every value added, in order, as float64 (one transfer per device)."""
        per_device: dict[torch.device, np.ndarray] = {}
        for device, count in self._counts.items():
            parts = list(self._chunks.get(device, []))
            if self._pending.get(device):
                parts.append(torch.stack(self._pending[device]))
            values = torch.cat(parts).cpu().numpy().astype(np.float64)
            assert len(values) == count
            per_device[device] = values
        return np.array([per_device[d][s] for d, s in self._slots], dtype=np.float64)


@dataclass
class Step:
    """What one optimizer step did; tensors become slots of the scalar log at its end."""

    index: int
    started: float
    capture: bool
    backward_calls: int = 0
    attempted: bool = False  # the first optimizer tried to step
    stepped: bool = False  # some optimizer.step() ran
    scaler: Any = None  # the enabled GradScaler in use this step
    scaler_stepped: bool = False  # scaler.unscale_ or scaler.step ran: update() ends the step
    scale_before: int = -1  # slots of the scalar log; -1: none
    found_inf: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    loss_from_scale: bool = False
    grad_amax: torch.Tensor | None = None  # largest |grad| before unscale_ (scaled)
    norm: int = -1
    norm_scaled: bool = False  # the norm was of scaled gradients
    max_norm: float = math.nan
    captured: bool = False
    seconds: float = 0.0
    slots: dict[str, int] = field(default_factory=dict)


@dataclass
class Span:
    """Gradients accumulated since they were last zeroed: one effective batch."""

    scales: list[SpanScale] = field(default_factory=list)
    unscaled: set[int] = field(default_factory=set)  # ids of optimizers unscaled in it


def steps_table(
    steps: Sequence[Step], values: np.ndarray, captured_rows: dict[str, list[Any]] | None = None
) -> dict[str, list[Any]]:
    """The steps table (every column of STEP_COLUMNS) of ``steps``, whose slots index
    ``values`` (the scalar log's); ``captured_rows``: the audit's own steps table of
    the captured steps, whose records and non-finite counts are taken over."""

    def value(slot: int) -> float:
        return float(values[slot]) if slot >= 0 else math.nan

    captured: dict[int, dict[str, Any]] = {}
    if captured_rows is not None:
        for i, index in enumerate(captured_rows["step"]):
            captured[index] = {name: column[i] for name, column in captured_rows.items()}
    table: dict[str, list[Any]] = {name: [] for name in STEP_COLUMNS}
    for step in steps:
        scale = value(step.scale_before) if step.scaler is not None else 1.0
        after = value(step.slots.get("scale_after", -1)) if step.scaler is not None else scale
        found = value(step.slots.get("found_inf", -1))
        skipped = bool(found > 0) if not math.isnan(found) else False
        loss = value(step.slots.get("loss", -1))
        norm = value(step.norm)
        grad_norm = norm / scale if step.norm_scaled else norm
        amax = value(step.slots.get("grad_amax", -1))
        row = {
            **STEP_DEFAULTS,
            "step": step.index,
            "loss": loss,
            "loss_finite": math.isnan(loss) or math.isfinite(loss),
            "loss_scale": scale,
            "scale_after": after,
            "skipped": skipped,
            "optimizer_step": step.stepped and not skipped,
            "grad_norm": grad_norm,
            "clip_max_norm": step.max_norm,
            "clipped": bool(norm > step.max_norm),
            "grad_amax": amax / scale if math.isfinite(amax) else amax,
            "backward_calls": step.backward_calls,
            "captured": step.captured,
            "records": 0,
            "seconds": step.seconds,
        }
        if step.captured and step.index in captured:
            from_audit = captured[step.index]
            for name in ("records", "nonfinite_grads", "first_nonfinite"):
                row[name] = from_audit[name]
        for name in STEP_COLUMNS:
            table[name].append(row[name])
    return table
