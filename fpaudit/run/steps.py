"""The step state of ``fpaudit run``: what each optimizer step did, and the steps table.

:class:`RunState` is the run's state in plain methods, which
``training.TrainingMonitor`` calls as the script makes its calls: a :class:`Step`
per optimizer step, a :class:`Span` per accumulated batch, and a log of the
script's calls on gradients (``findings.CallLog``); device values (scales, inf checks, norms,
losses) stay 0-dim tensors in a :class:`ScalarLog` until the run ends, then are
read in one transfer per device. :func:`steps_table` turns the steps and those
values into the report's steps table (every column of ``STEP_COLUMNS``).
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from fpaudit.capture import torch_patches as patches
from fpaudit.capture.recorder import MadeNonfinite
from fpaudit.report.records import STEP_COLUMNS, STEP_DEFAULTS
from fpaudit.report.runinfo import ScalerInfo
from fpaudit.rules.findings import CallLog, SchedulerCall, Site, SpanScale
from fpaudit.run.skips import AfterSkip, GradientFlags, StepFlags

__all__ = ["RunState", "ScalarLog", "Span", "Step", "steps_table"]


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
        return self.add_vector(value.reshape(1))[0]

    def add_vector(self, values: torch.Tensor) -> list[int]:
        """Keep a copy of the 1-D ``values``; their slots, in order."""
        device = values.device
        dtype = torch.float32 if device.type == "mps" else torch.float64
        copy = values.detach().reshape(-1).to(dtype=dtype, copy=True)
        pending = self._pending.setdefault(device, [])
        pending.append(copy)
        slot = self._counts.get(device, 0)
        self._counts[device] = slot + len(copy)
        if len(pending) == self._CHUNK:
            self._chunks.setdefault(device, []).append(torch.cat(pending))
            pending.clear()
        first = len(self._slots)
        self._slots += [(device, slot + i) for i in range(len(copy))]
        return list(range(first, len(self._slots)))

    def read(self) -> np.ndarray:
        """Every value added, in order, as float64 (one transfer per device)."""
        per_device: dict[torch.device, np.ndarray] = {}
        for device, count in self._counts.items():
            parts = list(self._chunks.get(device, []))
            if self._pending.get(device):
                parts.append(torch.cat(self._pending[device]))
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
    loss_from_closure: bool = False  # the loss of an optimizer step's first closure (LBFGS)
    grad_amax: torch.Tensor | None = None  # largest |grad| before unscale_ (scaled)
    backward_amax: torch.Tensor | None = None  # after the last backward (no optimizer yet)
    norm: int = -1
    norm_scaled: bool = False  # the norm was of scaled gradients
    max_norm: float = math.nan
    clip_value: float = math.nan  # clip_grad_value_'s (the last call's)
    clamped: torch.Tensor | None = None  # gradient elements it clamped (a device count)
    clip_elements: int = 0  # the elements it saw (known on the host)
    captured: bool = False
    seconds: float = 0.0
    slots: dict[str, int] = field(default_factory=dict)
    flags: StepFlags | None = None  # which parameters' gradients the scaler found inf/NaN in
    made_nonfinite: MadeNonfinite | None = None  # captured: the op that first made inf/NaN
    capture_forward: bool = False  # captured after a skip: its forward ops too
    scaler_skipped: bool = False  # a scaler's step skipped its optimizer (known on the host)


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
        loss_slot = step.slots.get("loss", -1)
        loss = value(loss_slot)
        norm = value(step.norm)
        grad_norm = norm / scale if step.norm_scaled else norm
        amax = value(step.slots.get("grad_amax", -1))
        clamped = value(step.slots.get("clamped", -1))
        fraction = clamped / step.clip_elements if step.clip_elements else math.nan
        row = {
            **STEP_DEFAULTS,
            "step": step.index,
            "loss": loss,
            "loss_finite": loss_slot < 0 or math.isfinite(loss),  # no loss seen: none broke
            "loss_scale": scale,
            "scale_after": after,
            "skipped": skipped,
            "optimizer_step": step.stepped and not skipped,
            "grad_norm": grad_norm,
            "clip_max_norm": step.max_norm,
            "clipped": bool(norm > step.max_norm) or fraction > 0,
            "clip_value": step.clip_value,
            "clipped_fraction": fraction,
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


class RunState:
    """The step lifecycle of a run, in plain methods: ``TrainingMonitor`` translates
    the patched calls into these. Holds the steps done and the one in progress, the
    span of accumulated gradients, the scalar log and whether the gradients are
    still multiplied by the loss scale. Capture of backward ops is the monitor's."""

    def __init__(
        self, capture_every: int = 0, max_steps: int | None = None, capture_after_skip: int = 0
    ) -> None:
        self.capture_every = capture_every
        self.max_steps = max_steps
        self.after_skip = AfterSkip(capture_after_skip)
        self.log = ScalarLog()
        self.steps: list[Step] = []
        self.optimizers: list[str] = []  # class names, in the order they first stepped
        self.scaler_settings: ScalerInfo | None = None
        self.done = False  # max_steps reached: the next step's first call stops the script
        # the first optimizer that steps, held weakly: a script that builds its optimizer
        # anew (resuming from a checkpoint) drops it, and the next one to step takes over
        self._primary: weakref.ref[torch.optim.Optimizer] | None = None
        self.optimizer_stepped = False  # some optimizer stepped: not a loop without torch.optim
        self.probes: dict[int, torch.Tensor] = {}  # optimizer id -> a parameter to watch
        self.last_attempt: dict[int, int] = {}  # optimizer id -> step index
        self.updates = 0  # scaler.update() calls: the scale's version
        self.roots: list[nn.Module] = []  # the first top-level modules called
        self.span = Span()
        self.mixed: list[list[SpanScale]] = []  # closed spans scaled by more than one scale
        self.scaled_since_unscale = False  # an enabled scaler's scale() since unscale_/step
        self.scaled_pending = False  # gradients hold scaled values not yet unscaled
        self.calls = CallLog()  # the script's calls on gradients, judged after the run
        self.scheduler_calls: list[SchedulerCall] = []
        self.schedulers: list[str] = []  # class names, in the order they first stepped
        self.flags = GradientFlags()  # per step, the parameters with inf/NaN gradients
        self.step = self.new_step(0)

    # -- steps -----------------------------------------------------------------
    def new_step(self, index: int) -> Step:
        every = self.capture_every
        return Step(index, time.perf_counter(), capture=bool(every) and index % every == 0)

    def scale_slot(self, scaler: Any) -> int:
        scale = patches.scaler_scale(scaler)
        assert scale is not None, "a used scaler has a scale"
        return self.log.add(scale)

    def use_scaler(self, scaler: Any) -> None:
        """An enabled scaler takes part in the step in progress."""
        step = self.step
        if step.scaler is None:
            step.scaler = scaler
            step.scale_before = self.scale_slot(scaler)
        if self.scaler_settings is None:
            self.scaler_settings = patches.scaler_settings(scaler)

    def end_step(self) -> None:
        """The step in progress is done: its tensors become slots; the next one starts."""
        step = self.step
        step.seconds = time.perf_counter() - step.started
        for name in ("loss", "found_inf", "grad_amax", "clamped"):
            value = getattr(step, name)
            if value is not None:
                step.slots[name] = self.log.add(value)
        if step.scaler is not None:
            step.slots["scale_after"] = self.scale_slot(step.scaler)
        step.flags = self.flags.close(self.roots, self.log.add_vector)
        self.steps.append(step)
        if self.max_steps is not None and len(self.steps) >= self.max_steps:
            self.done = True
        self.step = self.new_step(step.index + 1)
        if self.after_skip.due(step.scaler is not None, step.scaler_skipped):
            self.step.capture = self.step.capture_forward = True

    def attempt(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` is about to step (by itself or through ``scaler.step``)."""
        self.optimizer_stepped = True
        if self.primary is None:
            self._primary = weakref.ref(optimizer)
        self.last_attempt[id(optimizer)] = self.step.index
        if optimizer is self.primary:
            self.step.attempted = True
        if id(optimizer) not in self.probes:
            self.optimizers.append(type(optimizer).__name__)
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if isinstance(param, torch.Tensor) and param.requires_grad:
                        self.probes[id(optimizer)] = param
                        return

    @property
    def primary(self) -> torch.optim.Optimizer | None:
        """The optimizer whose step ends a step (None before one steps, or once the script
        dropped it)."""
        return self._primary() if self._primary is not None else None

    def ends_on_optimizer(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s step ends the step (no scaler.update() to wait for)."""
        return optimizer is self.primary and not self.step.scaler_stepped

    def note_grad_amax(
        self, optimizer: torch.optim.Optimizer, replace: bool = False, checked: bool = False
    ) -> None:
        """The largest gradient magnitude, as the optimizer sees the gradients (no sync);
        ``replace``: instead of what was noted before (gradients a closure recomputed);
        ``checked``: a scaler checks them for inf/NaN now, so each one's flag is kept
        (from the same per-gradient maxima: no launch more)."""
        if replace:
            self.step.grad_amax = None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        pairs = [(p, g) for p in params if (g := patches.raw_grad(p)) is not None]
        if checked:
            self.note_amax_of([], self.flags.note_gradients(pairs))
        else:
            self.note_amax_of([g for _, g in pairs])

    def root_grads(self) -> list[torch.Tensor]:
        """The gradients of the parameters of the top-level modules called (a loop
        without an optimizer: what its own update reads)."""
        seen: set[int] = set()
        grads = []
        for root in self.roots:
            for param in root.parameters():
                grad = patches.raw_grad(param)
                if grad is not None and id(param) not in seen:
                    seen.add(id(param))
                    grads.append(grad)
        return grads

    def grads_dropped_by_hand(self) -> bool:
        """The first trainable parameter of the models called has no gradient now, after a
        backward gave it one: the script set the gradients to None (no sync)."""
        for root in self.roots:
            for param in root.parameters():
                if param.requires_grad:
                    return patches.raw_grad(param) is None
        return False

    def note_amax_of(self, grads: list[torch.Tensor], amax: torch.Tensor | None = None) -> None:
        amax = patches.amax(grads) if amax is None else amax
        if amax is None:
            return
        step = self.step
        step.grad_amax = amax if step.grad_amax is None else torch.maximum(step.grad_amax, amax)

    def note_root(self, module: nn.Module) -> None:
        """A top-level module call (its parameters stand in for a clip call's generator)."""
        if len(self.roots) < 16 and all(module is not root for root in self.roots):
            self.roots.append(module)

    # -- what the patched calls did ----------------------------------------------
    def scaled(self, scaler: Any, outputs: Any, site: Site) -> None:
        """An enabled ``scaler.scale(outputs)`` at ``site`` returned."""
        self.use_scaler(scaler)
        step, span = self.step, self.span
        if not span.scales or span.scales[-1][0] != self.updates:
            span.scales.append(SpanScale(self.updates, self.scale_slot(scaler), site, step.index))
        if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
            loss = outputs.detach().reshape(()).float()
            running = step.loss if step.loss_from_scale else None
            step.loss = loss if running is None else running + loss
            step.loss_from_scale = True
        self.scaled_since_unscale = True

    def log_call(self, kind: str, site: Site, detail: str = "") -> None:
        """The script's ``kind`` of call on the gradients (see :class:`CallLog`) at ``site``,
        with whether they are still scaled."""
        self.calls.add(kind, site, self.step.index, self.scaled_pending, detail)

    def unscaling(self, scaler: Any, optimizer: torch.optim.Optimizer, site: Site) -> None:
        """An enabled ``scaler.unscale_(optimizer)`` at ``site`` is about to run; logged as
        on scaled gradients unless they were already unscaled since last zeroed."""
        twice = id(optimizer) in self.span.unscaled
        self.calls.add("unscale", site, self.step.index, not twice)
        self.span.unscaled.add(id(optimizer))
        self.use_scaler(scaler)
        self.step.scaler_stepped = True

    def unscaled(self) -> None:
        """unscale_ or scaler.step returned: the gradients are no longer scaled."""
        self.scaled_since_unscale = False
        self.scaled_pending = False

    def scaler_stepping(self, scaler: Any, optimizer: torch.optim.Optimizer) -> None:
        self.use_scaler(scaler)
        self.step.scaler_stepped = True
        self.attempt(optimizer)

    def scaler_stepped(
        self, scaler: Any, optimizer: torch.optim.Optimizer, skipped: bool = False
    ) -> None:
        self.step.scaler_skipped |= skipped  # it did not step ``optimizer``
        found = patches.found_inf(scaler, optimizer)
        if found is not None:
            current = self.step.found_inf
            self.step.found_inf = found if current is None else current + found
        self.unscaled()

    def updated(self) -> bool:
        """``scaler.update()`` returned; whether it ends the step."""
        self.updates += 1
        return self.step.attempted

    def backward_starts(self, tensors: Any, in_step: bool = False) -> None:
        """A backward pass starts; ``in_step``: inside an optimizer step (a closure, as
        LBFGS evaluates several times a step: the step's loss is the first one's)."""
        step = self.step
        step.backward_calls += 1
        if self.scaler_settings is not None:
            self.flags.order.learn(tensors)  # the first few graphs
        if step.loss_from_scale or step.loss_from_closure:
            return
        if isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
            loss = tensors.detach().reshape(()).float()
            step.loss = loss if step.loss is None or in_step else step.loss + loss
            step.loss_from_closure = in_step

    def backward_done(self) -> None:
        if self.scaled_since_unscale:
            self.scaled_pending = True

    def clipped_norm(self, norm: torch.Tensor, scaled: bool, limit: Any) -> None:
        step = self.step
        step.norm = self.log.add(norm)
        step.norm_scaled = scaled
        step.max_norm = float(limit)

    def clipped_by_value(self, grads: list[torch.Tensor], clip_value: Any) -> None:
        """``clip_grad_value_(..., clip_value)`` is about to clamp ``grads``: count on the
        device the elements it will change, ``|g| > clip_value`` (no sync)."""
        if isinstance(clip_value, bool) or not isinstance(clip_value, int | float):
            return  # not a number: clip_grad_value_ itself will say so
        step = self.step
        step.clip_value = float(clip_value)
        for grad in grads:
            if grad.layout != torch.strided or not grad.is_floating_point():
                continue
            over = (grad.abs() > step.clip_value).sum()
            step.clamped = (
                over if step.clamped is None else step.clamped + over.to(step.clamped.device)
            )
            step.clip_elements += grad.numel()

    def clipped_grads(self, parameters: Any) -> list[torch.Tensor]:
        """The gradients a clip call will change, read without consuming ``parameters``:
        a one-shot iterator (a generator) is left to the clip call, and the gradients of
        every model seen instead stand for it."""
        if isinstance(parameters, torch.Tensor):
            return [g for g in [patches.raw_grad(parameters)] if g is not None]
        try:
            iterator = iter(parameters)
        except TypeError:  # not iterable: the clip call itself will say so
            return []
        if iterator is not parameters:
            params: list[Any] = list(parameters)  # a second pass over a list, tuple or set
        else:
            params = [p for root in self.roots for p in root.parameters()]
        grads = [patches.raw_grad(p) for p in params if isinstance(p, torch.Tensor)]
        return [g for g in grads if g is not None]

    def scheduler_step(self, scheduler: Any, site: Site) -> None:
        """The script stepped ``scheduler`` at ``site`` (not its constructor's first step)."""
        optimizer = getattr(scheduler, "optimizer", None)
        name = type(scheduler).__name__
        last = self.last_attempt.get(id(optimizer), -1)
        self.scheduler_calls.append(SchedulerCall(site, last, name))
        if name not in self.schedulers:
            self.schedulers.append(name)

    # -- spans -------------------------------------------------------------------
    def new_span(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Gradients were zeroed (all, or ``optimizer``'s): a new effective batch starts."""
        span = self.span
        if len({version for version, *_ in span.scales}) > 1:
            self.mixed.append(span.scales)  # judged after the run, when values are known
        span.scales = []
        if optimizer is None:
            span.unscaled.clear()
        else:
            span.unscaled.discard(id(optimizer))

    def zeroed(self, owner: Any) -> None:
        """``zero_grad`` of an optimizer (or of a module: every gradient)."""
        self.new_span(owner if isinstance(owner, torch.optim.Optimizer) else None)
        self.scaled_pending = False

    def probe_span(self) -> None:
        """Gradients set to None by hand (not by zero_grad) also start a new batch
        (checked when a micro-batch is scaled, before its backward)."""
        if self.span.scales or self.span.unscaled:
            for probe in self.probes.values():
                if patches.raw_grad(probe) is None:
                    self.new_span()
                    return

    def spans(self) -> list[list[SpanScale]]:
        """The spans that matter to mixed-scale accumulation: the mixed ones and the last."""
        return [*self.mixed, self.span.scales]
