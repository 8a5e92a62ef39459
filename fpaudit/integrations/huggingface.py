"""Audit a Hugging Face ``Trainer`` run: ``FpauditTrainerCallback``, a ``TrainerCallback``.

Usage::

    from transformers import Trainer, TrainingArguments
    from fpaudit.integrations.huggingface import FpauditTrainerCallback

    audit = FpauditTrainerCallback(out="fpaudit-report", steps=50, every=5)
    trainer = Trainer(model=model, args=TrainingArguments(..., fp16=True),
                      train_dataset=data, callbacks=[audit])
    try:
        trainer.train()
    finally:
        audit.finish()  # writes the report if training raised (no-op after on_train_end)
    # then: fpaudit show fpaudit-report --scale recommended

Requires ``transformers`` with its ``Trainer`` (``pip install transformers accelerate``).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from fpaudit.capture import compiled
from fpaudit.capture.torch_patches import Call, Patches, step_targets
from fpaudit.integrations import SessionCallback, scale_tensor, unscaled

try:
    import transformers
    from transformers import TrainerCallback
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK
    from transformers.trainer_callback import CallbackHandler
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "fpaudit.integrations.huggingface needs Hugging Face transformers: "
        "pip install transformers accelerate"
    ) from error

__all__ = ["FpauditTrainerCallback"]


class FpauditTrainerCallback(SessionCallback, TrainerCallback):
    """Audit the backward pass of selected optimizer steps; write a report when training ends.

    Options as :class:`fpaudit.integrations.lightning.FpauditCallback`:
    ``steps`` (audit among the first N optimizer steps of the run; None: all),
    ``every`` (every K-th of them), ``formats`` (None: the run's AMP dtype,
    else fp16), ``force`` (replace an existing report; checked when training
    starts) and ``selection``. Steps are numbered by ``state.global_step``.

    How a step is captured (transformers 5.x ``Trainer._inner_training_loop``):
    ``on_step_begin`` comes before the first micro-batch's forward and enters
    the audit on ``kwargs["model"]``. After the last micro-batch's backward the
    Trainer clips the gradients (``max_grad_norm``, default 1.0; with fp16 the
    ``GradScaler`` unscales them first) and measures their norm, *then* calls
    ``on_pre_optimizer_step``: no callback sees the gradients as backward left
    them. So while a step is audited the callback also wraps, and puts back
    when the step closes, the calls that come first: the scaler's ``unscale_``
    (an attribute of that one scaler object) and
    ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` (which
    accelerate calls even without clipping, to measure the norm) and
    ``clip_grads_with_norm_`` (accelerate >= 1.16 clips in torch's two parts,
    ``get_total_norm`` then ``clip_grads_with_norm_``). The first
    of them, or ``on_pre_optimizer_step``, closes the step: parameter
    gradients are recorded accumulated, unclipped and still multiplied by the
    scale, which is the step's loss scale (1 without a scaler). Each backward's
    loss is read from ``torch.autograd.backward`` (also wrapped during the step)
    and unscaled: the step's loss is the sum of the losses backpropagated
    (divided by ``gradient_accumulation_steps`` as the Trainer does).

    Supported: one process, CPU or GPU; fp32, ``bf16=True`` (also on CPU),
    ``fp16=True`` (GPU; the CPU backend runs fp16 as fp32);
    ``gradient_accumulation_steps``; ``max_grad_norm``. Under DDP (torchrun)
    every process audits its own backward pass and writes its part of one report;
    one that stops on an exception writes its steps alone to ``OUT.rankN``.

    Compiled: a model passed in ``torch.compile``d with Inductor, or
    ``torch_compile=True`` (Inductor, any ``torch_compile_mode``): for the run, the
    callback compiles the model's ``forward`` through fpaudit's backend
    (``fpaudit.capture.compiled.observe_in_place``; the Trainer's wrapper calls the
    model, whose ``forward`` it then is) and puts the original back when training
    ends. Every buffer the compiled backward stores is recorded under the model's own
    names, in the dtype it is stored in (``docs/compile.md``).

    Metrics (``log_metrics``, default on; ``metrics_top`` modules with a series of their
    own): after each audited optimizer step, its dashboard metrics
    (``fpaudit.rules.metrics.METRICS``) go to the Trainer's ``report_to`` integrations
    (TensorBoard, W&B, MLflow, ...) through their own ``on_log``, at the Trainer's step
    numbering (``state.global_step`` after that optimizer step, where the Trainer logs
    the step's loss: fpaudit's step k is logged at k + 1). The Trainer calls its reporting
    callbacks before a user's, so a user callback that edits ``logs`` comes too late;
    fpaudit finds the reporters in the Trainer's callback handler when training starts.
    They are not added to ``state.log_history`` or printed. A reporter that raises is
    warned about and the audit goes on.

    Not supported: DeepSpeed and FSDP (their engines unscale and clip
    elsewhere: gradients would be recorded after clipping), ``torch_compile`` with
    another ``torch_compile_backend``, several GPUs in one process
    (``nn.DataParallel``). The Trainer has no exception callback: if
    ``train()`` raises, call :meth:`finish` (see the module docstring) to
    remove the hooks and write the steps recorded so far, marked incomplete.
    """

    COMMAND = "huggingface"

    def _reset(self) -> None:
        self._reporters: list[Any] = []
        self._to_log = False
        self._last_step = 0
        self._meta: dict[str, Any] = {}
        self._patches = Patches()
        self._scaler: Any = None
        self._unscaled = False

    @property
    def report_path(self) -> Path | None:
        """Where the report was written (after training ends), else None."""
        return self.session.path

    # -- Trainer events ----------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._active = False
        reason = _unsupported(args)
        if reason is not None:
            warnings.warn(f"fpaudit: {reason}; nothing is audited", stacklevel=2)
            return
        model = kwargs["model"]
        self._reporters = _reporters(self) if self.log_metrics else []
        self._first_step = self._last_step = int(state.global_step)
        self._start(model, _observed_in_place(args, model))
        self._meta = {
            "transformers_version": transformers.__version__,
            "precision": "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32",
            "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
            "max_grad_norm": float(args.max_grad_norm),
            "world_size": int(args.world_size),
        }
        self._active = True

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._active:
            return
        self._last_step = int(state.global_step)
        if self.session.is_open:  # a step that never reached its optimizer
            self._close_or_drop(ok=False)
        if not self.session.wants(int(state.global_step)):
            return
        optimizer = kwargs.get("optimizer")
        self._meta["optimizer"] = type(getattr(optimizer, "optimizer", optimizer)).__name__
        self._scaler = getattr(optimizer, "scaler", None)
        self._unscaled = False
        self.session.begin(int(state.global_step))
        self._install()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._active and self.session.is_open:
            self._close_or_drop(ok=True)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._active and self.session.pending is not None:
            skipped = bool(getattr(kwargs.get("optimizer"), "step_was_skipped", False))
            self.session.mark_optimizer_step(stepped=not skipped, skipped=skipped)
            self._to_log = True  # once the step is counted (on_step_end)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._active:
            return
        self._last_step = int(state.global_step)
        if self._to_log:
            self._to_log = False
            model = kwargs.get("model")
            self._log_metrics(
                self._reporters,
                lambda reporter, logs: reporter.on_log(
                    args, state, control, logs=logs, model=model
                ),
            )
        if self.session.is_open:  # no on_pre_optimizer_step (transformers < 4.45)
            self._close_or_drop(ok=False)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._active:
            self._last_step = int(state.global_step)
            self._finish(None)

    def finish(self, stopped_by: str | None = None) -> Path | None:
        """Remove every hook and write the report; a no-op once it is written.

        ``on_train_end`` writes the report of a run that ends normally. Call
        this when ``trainer.train()`` raises (in ``except`` or ``finally``):
        ``stopped_by`` defaults to the type of the exception being handled,
        which marks the report incomplete.
        """
        if stopped_by is None:
            error = sys.exc_info()[1]
            stopped_by = type(error).__name__ if error is not None else None
        return self._finish(stopped_by)

    def _finish(self, stopped_by: str | None) -> Path | None:
        if not self._active:
            return None
        self._active = False
        if self.session.is_open:
            self.session.abort()
        self._patches.restore()
        self._put_back_compiled()
        return self.session.finish(
            steps_run=self._last_step - self._first_step, stopped_by=stopped_by, meta=self._meta
        )

    # -- closing the step before the gradients change ---------------------
    def _close_or_drop(self, ok: bool) -> None:
        """Close the open step (``ok``: the gradients are still as backward left them)."""
        self._patches.restore()
        if not ok:
            warnings.warn(
                "fpaudit: an audited step ended without reaching the optimizer; it is dropped",
                stacklevel=3,
            )
            self.session.abort()
            return
        scale = None if self._unscaled else scale_tensor(self._scaler)
        self.session.close(scale if scale is not None else 1.0)

    def _before_gradients_change(self) -> None:
        if self.session.is_open:
            self._close_or_drop(ok=True)

    def _install(self) -> None:
        """Wrap (``torch_patches.Patches``: the originals' signatures, arguments passed on
        untouched) the calls that change the gradients before ``on_pre_optimizer_step``."""
        for owner, name, handler in self.patch_targets():
            self._patches.wrap(owner, name, handler)

    def patch_targets(self) -> list[tuple[Any, str, Callable[[Call], Any]]]:
        """What :meth:`_install` wraps while a step is audited: (owner, attribute, handler)."""
        return [
            (owner, name, getattr(self, f"_{handler}"))
            for owner, name, handler in step_targets(self._scaler)
        ]

    @contextmanager
    def _on_backward(self, call: Call) -> Iterator[None]:
        tensors = call.arguments["tensors"]
        is_loss = isinstance(tensors, torch.Tensor) and tensors.numel() == 1
        if is_loss and self.session.is_open:  # unscale it (no host sync)
            self.session.add_loss(unscaled(tensors, scale_tensor(self._scaler)))
        yield

    @contextmanager
    def _on_clip(self, call: Call) -> Iterator[None]:
        self._before_gradients_change()
        yield

    @contextmanager
    def _on_unscale(self, call: Call) -> Iterator[None]:
        self._before_gradients_change()
        self._unscaled = True
        yield


def _reporters(callback: FpauditTrainerCallback) -> list[Any]:
    """The ``report_to`` callbacks of the Trainer whose handler is calling ``callback``
    now (its ``CallbackHandler.call_event`` frame: no public API names the Trainer or its
    handler to a callback); empty, with a warning, when it cannot be found."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(4):  # call_event, then on_train_begin's callers
        if frame is None:
            break
        handler = frame.f_locals.get("self")
        if isinstance(handler, CallbackHandler) and any(c is callback for c in handler.callbacks):
            kinds = tuple(INTEGRATION_TO_CALLBACK.values())
            return [c for c in handler.callbacks if isinstance(c, kinds)]
        frame = frame.f_back
    warnings.warn(
        "fpaudit: the Trainer's callback handler was not found; fpaudit's metrics are not "
        "logged to report_to (read them with callback.session.metrics)",
        stacklevel=3,
    )
    return []


def _unsupported(args: Any) -> str | None:
    if getattr(args, "deepspeed", None):
        return "FpauditTrainerCallback does not support DeepSpeed"
    if getattr(args, "fsdp", None):
        return "FpauditTrainerCallback does not support FSDP"
    backend = getattr(args, "torch_compile_backend", None) or "inductor"
    if getattr(args, "torch_compile", False) and backend != "inductor":
        return (
            "FpauditTrainerCallback audits torch_compile with Inductor only, "
            f"not torch_compile_backend={backend!r}"
        )
    return None


def _observed_in_place(args: Any, model: torch.nn.Module) -> compiled.InPlace | None:
    """A model the Trainer runs compiled with Inductor, its ``forward`` compiled again through
    fpaudit's backend for the run: a model passed in ``torch.compile``d, or one the Trainer
    compiles itself (``torch_compile=True``, inside ``train()`` where no callback sees the
    wrapper). Either wrapper calls the model, whose ``forward`` is then fpaudit's compiled
    one. None for an eager model, or one compiled otherwise (the audit says so)."""
    eager = compiled.eager_module(model)
    if eager is not None:
        options = compiled.inductor_options(model)
        if options is None:
            return None
        return compiled.observe_in_place(eager, {"forward": eager.forward}, options)
    if getattr(args, "torch_compile", False):
        options = compiled.mode_options(getattr(args, "torch_compile_mode", None))
        return compiled.observe_in_place(model, {"forward": model.forward}, options)
    return None
