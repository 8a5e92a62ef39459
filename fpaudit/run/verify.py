"""``fpaudit verify``: one fp32 step against one mixed-precision step, from the same start.

From identical weights and the same batch:

* the fp32 reference: backward, optional clipping, optimizer step;
* the mixed-precision step: forward under ``torch.autocast``, backward on
  ``S * loss`` (the seed is S), then *unscale* (divide by S, exact for a power
  of two), skip the step if any gradient is inf or NaN (as GradScaler does),
  clip the **unscaled** gradients at the same threshold, optimizer step.

Per parameter it reports the fraction of gradient elements that are nonzero in
fp32 but zero after unscaling, the relative error against the fp32 gradient,
and whether the parameter changed in each step. The check fails when the step
was skipped or a parameter that changes in fp32 did not change, and, as a
verdict needs evidence, when the fp32 reference itself proves nothing: its loss
or gradients hold inf or NaN, or no gradient element is nonzero (no backward
reached a parameter).
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fpaudit.errors import OptionError
from fpaudit.run import modelfile
from fpaudit.run.scan import AMP_DTYPES, resolve_device, seed_everything


@dataclass(frozen=True)
class ParameterCheck:
    name: str
    elements: int
    zeroed_fraction: float  # nonzero in fp32, zero after unscaling
    relative_error: float  # |g_mixed - g_fp32| / |g_fp32| (0 when both are zero)
    changed_fp32: bool
    changed_mixed: bool
    update_error: float  # |dw_mixed - dw_fp32| / |dw_fp32|: does the step move it alike?
    zeroed: int = 0  # the count behind zeroed_fraction
    nonzero: int = 0  # gradient elements nonzero in fp32


@dataclass(frozen=True)
class Verification:
    model_file: str
    amp: str
    scale: float
    log2_scale: int
    clip_norm: float | None
    skipped: bool  # non-finite gradients after the mixed backward: no optimizer step
    grad_norm_fp32: float  # total gradient norm before clipping
    grad_norm_mixed: float  # the same, of the unscaled mixed-precision gradients
    optimizer: str
    parameters: list[ParameterCheck] = field(default_factory=list)
    reference_nonzero: int = 0  # nonzero elements of the fp32 reference gradients
    reference_finite: bool = True  # the fp32 loss and gradients are finite

    @property
    def stalled(self) -> list[str]:
        """Parameters that change in fp32 but not in mixed precision."""
        return [p.name for p in self.parameters if p.changed_fp32 and not p.changed_mixed]

    @property
    def reasons(self) -> list[str]:
        """Every reason the check failed, one line each; empty when it passed."""
        reasons = []
        if not self.reference_finite:
            reasons.append(
                "the fp32 reference step holds inf or NaN (loss or gradients): there is "
                "nothing sound to compare with"
            )
        if self.reference_nonzero == 0:
            reasons.append(
                "measured nothing: no fp32 reference gradient element is nonzero (did the "
                "loss reach any parameter?), so no parameter can be seen to stall"
            )
        if self.skipped:
            reasons.append(
                f"the {self.amp} step was skipped: its gradients held inf or NaN at this scale"
            )
        if self.stalled:
            reasons.append(
                f"these parameters change in fp32 but not in {self.amp}: {', '.join(self.stalled)}"
            )
        return reasons

    @property
    def passed(self) -> bool:
        return not self.reasons

    @property
    def lost_fraction(self) -> float:
        """Gradient elements nonzero in fp32 but zero after unscaling, over all parameters."""
        nonzero = sum(p.nonzero for p in self.parameters)
        return sum(p.zeroed for p in self.parameters) / nonzero if nonzero else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: inf and NaN (a skipped step's norms, an error against zero) are None."""
        data: dict[str, Any] = _finite_or_none(asdict(self))
        data.update(passed=self.passed, stalled=self.stalled, reasons=self.reasons)
        return data


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


def _gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """|value - reference| / |reference|; 0 when both are zero, inf when only it is."""
    norm = float(reference.float().norm())
    difference = float((value.float() - reference.float()).norm())
    if norm > 0:
        return difference / norm
    return 0.0 if difference == 0 else math.inf


def _total_norm(grads: dict[str, torch.Tensor]) -> float:
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads.values()])))


def keep_out_of_autocast(model: nn.Module, names: Iterable[str], device_type: str) -> None:
    """Run the forward of each named submodule with autocast disabled, on fp32 inputs.

    Its outputs are fp32; ops after it under autocast cast them as they need. The
    backward of what ran in fp32 runs in fp32 too.
    """

    def to_fp32(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.float()
        return value

    for name in names:
        module = model.get_submodule(name)
        original: Callable[..., Any] = module.forward

        @functools.wraps(original)
        def fp32_forward(
            *args: Any, _original: Callable[..., Any] = original, **kwargs: Any
        ) -> Any:
            with torch.autocast(device_type=device_type, enabled=False):
                return _original(
                    *[to_fp32(a) for a in args], **{k: to_fp32(v) for k, v in kwargs.items()}
                )

        module.forward = fp32_forward


def verify(
    model_path: str | Path,
    *,
    log2_scale: int,
    amp: str = "fp16",
    clip_norm: float | None = None,
    device: str = "auto",
    seed: int | None = 0,
    keep_fp32: Sequence[str] = (),
) -> Verification:
    """Run the fp32 reference step and the mixed-precision step and compare them.

    ``keep_fp32`` names modules whose forward the mixed step runs with autocast
    disabled, on fp32 inputs (``fpaudit fp16-plan``)."""
    if amp not in AMP_DTYPES:
        raise OptionError("amp", f"must be one of {', '.join(AMP_DTYPES)}, got {amp!r}")
    if clip_norm is not None and not (math.isfinite(clip_norm) and clip_norm > 0):
        raise OptionError("clip_norm", f"must be a positive number, got {clip_norm}")
    path = Path(model_path)
    target = resolve_device(device)
    if seed is not None:
        seed_everything(seed)
    spec = modelfile.load(path)
    batch = modelfile.move_to(next(spec.batches(1)), target)
    with modelfile.user_code(path, f"moving the model to {target}"):
        start = spec.model.to(target)
    steps = _Steps(path, spec, batch, clip_norm)
    scale = math.ldexp(1.0, log2_scale)
    reference = steps.fp32(copy.deepcopy(start).train())
    mixed_model = copy.deepcopy(start).train()
    if keep_fp32:
        keep_out_of_autocast(mixed_model, keep_fp32, target.type)
    mixed = steps.mixed(mixed_model, target.type, AMP_DTYPES[amp], scale)
    return Verification(
        model_file=str(path),
        amp=amp,
        scale=scale,
        log2_scale=log2_scale,
        clip_norm=clip_norm,
        skipped=mixed.skipped,
        grad_norm_fp32=_total_norm(reference.grads),
        grad_norm_mixed=_total_norm(mixed.grads),
        optimizer=mixed.optimizer,
        parameters=_parameter_checks(reference, mixed),
        reference_nonzero=sum(int(torch.count_nonzero(g)) for g in reference.grads.values()),
        reference_finite=reference.finite,
    )


@dataclass(frozen=True)
class _Step:
    """What one optimizer step did: the (unscaled) gradients and each weight's update."""

    grads: dict[str, torch.Tensor]
    updates: dict[str, torch.Tensor]
    finite: bool  # the loss and every gradient finite
    skipped: bool  # non-finite gradients: the step was skipped, as a scaler does
    optimizer: str


@dataclass(frozen=True)
class _Steps:
    """One step of the model file's model on one batch, in fp32 or mixed precision."""

    path: Path
    spec: modelfile.ModelFile
    batch: Any
    clip_norm: float | None

    def _optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        optimizer = self.spec.optimizer(model.parameters())
        return optimizer if optimizer is not None else torch.optim.SGD(model.parameters(), lr=1e-3)

    def _step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor, *, skips: bool
    ) -> _Step:
        """Clip (on the unscaled gradients, as the threshold means) and step; a step that
        ``skips`` does not when a gradient is not finite, as a loss scaler does."""
        grads = _gradients(model)
        grads_finite = all(bool(torch.isfinite(g).all()) for g in grads.values())
        finite = bool(torch.isfinite(loss.detach()).all()) and grads_finite
        skipped = skips and not grads_finite
        before = _weights(model)
        if not skipped:
            if self.clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), self.clip_norm)
            with modelfile.user_code(self.path, "optimizer.step()"):
                optimizer.step()
        updates = {n: w - before[n] for n, w in _weights(model).items()}
        return _Step(grads, updates, finite, skipped, type(optimizer).__name__)

    def fp32(self, model: nn.Module) -> _Step:
        optimizer = self._optimizer(model)
        optimizer.zero_grad(set_to_none=True)
        with modelfile.user_code(self.path, "loss(model, batch)"):
            loss = modelfile.check_loss(self.spec.loss(model, self.batch), self.path)
        with modelfile.user_code(self.path, "backward"):
            loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward untyped
        return self._step(model, optimizer, loss, skips=False)

    def mixed(self, model: nn.Module, device: str, dtype: torch.dtype, scale: float) -> _Step:
        """Backward on S * loss under autocast, unscale, skip if non-finite, clip, step."""
        optimizer = self._optimizer(model)
        optimizer.zero_grad(set_to_none=True)
        with (
            torch.autocast(device, dtype=dtype),
            modelfile.user_code(self.path, "loss(model, batch)"),
        ):
            loss = modelfile.check_loss(self.spec.loss(model, self.batch), self.path)
        with modelfile.user_code(self.path, "backward"):
            torch.autograd.backward(loss, grad_tensors=torch.full_like(loss, scale))
        for param in model.parameters():
            if param.grad is not None:
                param.grad.div_(scale)  # exact: a power of two
        return self._step(model, optimizer, loss, skips=True)


def _parameter_checks(reference: _Step, mixed: _Step) -> list[ParameterCheck]:
    checks = []
    for name, reference_grad in reference.grads.items():
        grad = mixed.grads[name]
        nonzero = reference_grad != 0
        zeroed = int((nonzero & (grad == 0)).sum())
        checks.append(
            ParameterCheck(
                name=name,
                elements=reference_grad.numel(),
                zeroed_fraction=zeroed / max(1, int(nonzero.sum())),
                relative_error=_relative_error(grad, reference_grad),
                changed_fp32=bool(reference.updates[name].any()),
                changed_mixed=bool(mixed.updates[name].any()),
                update_error=_relative_error(mixed.updates[name], reference.updates[name]),
                zeroed=zeroed,
                nonzero=int(nonzero.sum()),
            )
        )
    return checks
