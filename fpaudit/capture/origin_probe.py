"""Per op call, on the device: did this op *make* an inf or NaN? (``scan --origins``).

For every op call that creates values (forward inside ``Audit.forward_pass``, and
backward), :class:`OriginTracker` computes, on the tensors' own device and without
a host sync:

* before the op runs (in-place ops overwrite their inputs): whether any floating
  input holds inf or NaN, and the largest finite input magnitude, split into
  inputs that require grad (forward values and parameters: the loss scale does
  not touch them) and the others (gradients: scaled with the loss, see
  ``capture.provenance.Provenance``);
* after it: the number of non-finite elements of each floating output and its
  largest finite magnitude.

The rows stay on the device until :meth:`OriginTracker.collect`, called once per
step, brings them to the host in one transfer per device. ``fpaudit.rules.origins``
then reads the table: an *origin* is an op call whose output holds inf/NaN while
all its floating inputs are finite; later ops that carry it are propagation.

Known limitations: ops outside the dispatch mode's view (compiled code, custom
kernels that bypass aten) are not seen; an op that consumes a non-finite value
and also makes new ones is counted as propagation; inputs on another device than
the op's accelerator (0-dim CPU constants) are not read.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from fpaudit.report.records import ORIGIN_COLUMNS as COLUMNS

_WIDTH = 5  # nonfinite, amax, inputs_nonfinite, input_amax_scaled, input_amax_fixed


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in an aten op's arguments or outputs: a tensor, or sequences and dicts
    of tensors and scalars (aten nests at most a list of tensors in an argument tuple).
    Cheaper than pytree on the hot path."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, list | tuple):
                yield from (t for t in item if isinstance(t, torch.Tensor))
    elif isinstance(value, dict):
        yield from tensors_in(tuple(value.values()))


def _float_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:

    found = tensors_in((args, tuple(kwargs.values()))) if kwargs else tensors_in(args)
    return [
        t
        for t in found
        if t.is_floating_point() and t.layout == torch.strided and not t.is_meta and t.numel()
    ]


def _finite_amax(t: torch.Tensor) -> torch.Tensor:
    magnitude = t.detach().abs()
    return torch.where(torch.isfinite(magnitude), magnitude, 0).amax().to(torch.float64)


class OriginTracker:
    """Collects one row per floating output of every tracked op call, on the device."""

    def __init__(self) -> None:
        self._values: dict[torch.device, list[torch.Tensor]] = {}
        self._meta: dict[torch.device, list[tuple[Any, ...]]] = {}
        self._sequence = 0
        self._columns: dict[str, list[Any]] = {name: [] for name in COLUMNS}

    def before(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
        """What the inputs hold, before the op may overwrite them: a 3-vector on the device
        of the first floating input (None: no floating input)."""
        inputs = _float_inputs(args, kwargs)
        if not inputs:
            return None
        # one device: an accelerator's when there is one (0-dim CPU tensors beside CUDA
        # ones are constants; moving their flags over would cost a copy per op)
        device = next((t.device for t in inputs if t.device.type != "cpu"), inputs[0].device)
        inputs = [t for t in inputs if t.device == device]
        zero = torch.zeros((), dtype=torch.float64, device=device)
        nonfinite = zero.clone()
        scaled = zero.clone()
        fixed = zero.clone()
        for t in inputs:
            bad = (~torch.isfinite(t.detach())).any().to(torch.float64)
            nonfinite = torch.maximum(nonfinite, bad)
            amax = _finite_amax(t)
            if t.requires_grad:
                fixed = torch.maximum(fixed, amax)
            else:
                scaled = torch.maximum(scaled, amax)
        return torch.stack([nonfinite, scaled, fixed])

    def after(
        self,
        before: torch.Tensor | None,
        phase: str,
        module: str,
        node: str,
        op: str,
        outputs: list[tuple[int, torch.Tensor]],
        scales_with_loss: bool,
    ) -> None:
        """Note the op call's floating outputs (``(index, tensor)`` pairs)."""
        self._sequence += 1
        for index, tensor in outputs:
            if not tensor.numel():
                continue
            device = tensor.device
            detached = tensor.detach()
            count = (~torch.isfinite(detached)).sum().to(torch.float64)
            inputs = (
                before.to(device)
                if before is not None
                else torch.zeros(3, dtype=torch.float64, device=device)
            )
            row = torch.cat([torch.stack([count, _finite_amax(detached)]), inputs])
            self._values.setdefault(device, []).append(row)
            dtype = str(tensor.dtype).removeprefix("torch.")
            meta = (self._sequence, phase, module, node, op, index, dtype, scales_with_loss,
                    tensor.numel())  # fmt: skip
            self._meta.setdefault(device, []).append(meta)

    def collect(self, step: int, loss_scale: float) -> None:
        """Bring the step's rows (run under ``loss_scale``) to the host, one transfer per
        device, and start anew."""
        rows: list[tuple[tuple[Any, ...], np.ndarray]] = []
        for device, values in self._values.items():
            host = torch.stack(values).cpu().numpy() if values else np.zeros((0, _WIDTH))
            rows += list(zip(self._meta[device], host, strict=True))
        rows.sort(key=lambda r: r[0][0])  # execution order
        c = self._columns
        for meta, value in rows:
            (sequence, phase, module, node, op, index, dtype, scales, elements) = meta
            c["step"].append(step)
            c["sequence"].append(sequence)
            c["phase"].append(phase)
            c["module"].append(module)
            c["node"].append(node)
            c["op"].append(op)
            c["output"].append(index)
            c["dtype"].append(dtype)
            c["scales_with_loss"].append(scales)
            c["loss_scale"].append(loss_scale)
            c["elements"].append(elements)
            c["nonfinite"].append(int(value[0]))
            c["amax"].append(float(value[1]))
            c["inputs_nonfinite"].append(bool(value[2] > 0))
            c["input_amax_scaled"].append(float(value[3]))
            c["input_amax_fixed"].append(float(value[4]))
        self._values.clear()
        self._meta.clear()
        self._sequence = 0

    def columns(self) -> dict[str, list[Any]]:
        """Every collected row, column by column (``fpaudit.report.records.ORIGIN_COLUMNS``)."""
        return {name: list(values) for name, values in self._columns.items()}
