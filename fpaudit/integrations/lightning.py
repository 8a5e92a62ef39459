"""Audit a PyTorch Lightning run: ``FpauditCallback``, a ``lightning.pytorch.Callback``.

Usage::

    import lightning as L
    from fpaudit.integrations.lightning import FpauditCallback

    trainer = L.Trainer(
        precision="16-mixed",
        callbacks=[FpauditCallback(out="fpaudit-report", steps=50, every=5)],
    )
    trainer.fit(model, datamodule)
    # then: fpaudit show fpaudit-report --scale recommended

Requires ``lightning`` (``pip install lightning``); the older ``pytorch_lightning``
package is not supported.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from fpaudit import torch_internals as _internals
from fpaudit.capture import compiled
from fpaudit.integrations import SessionCallback, scale_tensor, unscaled

try:
    import lightning
    from lightning.pytorch import Callback
except ImportError as error:  # pragma: no cover - exercised only without lightning
    raise ImportError(
        "fpaudit.integrations.lightning needs PyTorch Lightning: pip install lightning"
    ) from error

__all__ = ["FpauditCallback"]


class FpauditCallback(SessionCallback, Callback):
    """Audit the backward pass of selected optimizer steps; write a report when training ends.

    ``steps``: audit among the first N optimizer steps of the run (None: all);
    ``every``: audit every K-th of them (0, K, 2K, ...); ``formats``: the
    formats ``fpaudit show`` and ``gate`` judge by default (None: the run's AMP
    dtype, else fp16); ``force``: replace an existing report at ``out``
    (checked when training starts); ``selection``: which modules and ops to
    record (:class:`fpaudit.Selection`). Steps are numbered by
    ``trainer.global_step``; the report is written at ``on_train_end``, and at
    ``on_exception`` marked incomplete (``stopped_by``: the exception's type).
    ``log_metrics`` (default on): after each audited step, its dashboard metrics
    (``fpaudit.rules.metrics.METRICS``, ``metrics_top`` modules with a series of their
    own) go to every logger of the trainer (TensorBoardLogger, WandbLogger,
    MLFlowLogger, CSVLogger), at the step's global step; a logger that raises is
    warned about and the audit goes on.

    How a step is captured (Lightning 2.x hook order, automatic optimization):
    the audit is entered in ``on_train_batch_start`` of the step's first
    micro-batch, before its ``training_step``; each ``on_before_backward`` adds
    the micro-batch's loss; the step closes in ``on_after_backward`` of the
    last micro-batch, before ``MixedPrecision.optimizer_step`` unscales the
    gradients and before ``on_before_optimizer_step`` and gradient clipping.
    So parameter gradients are recorded as backward made them, accumulated
    over every micro-batch and still multiplied by the ``GradScaler`` scale,
    which is recorded as the step's loss scale (1 without a scaler). The
    step's loss is the sum of the (unscaled) losses backpropagated, i.e. the
    mean of the micro-batch losses under ``accumulate_grad_batches``.

    Supported: one device (CPU or GPU); ``precision`` 32, ``16-mixed`` (with
    its ``GradScaler``), ``bf16-mixed``, ``16-true`` and ``bf16-true``;
    ``accumulate_grad_batches`` (one audited step per optimizer step); gradient
    clipping. DDP-style strategies: every rank audits its own backward pass and
    writes its part of one report, as ``fpaudit scan`` does under torchrun (see
    ``fpaudit.run.distributed``); a rank that stops on an exception writes its steps
    alone to ``OUT.rankN``.

    Compiled: ``trainer.fit(torch.compile(model))`` with Inductor (any mode):
    Lightning unwraps the module and compiles its ``forward`` and ``training_step``;
    for the run, the callback compiles them again from the originals Lightning keeps,
    through fpaudit's backend (``fpaudit.capture.compiled.observe_in_place``), and puts
    Lightning's back when training ends. Every buffer the compiled backward stores is
    recorded under the model's own names, in the dtype it is stored in, as ``fpaudit
    scan`` of a compiled model does (``docs/compile.md``).

    Not supported (the callback warns and records nothing): manual optimization
    (``automatic_optimization = False``) and strategies that run backward and
    accumulation themselves (DeepSpeed). Not supported by the audit itself:
    ``nn.DataParallel``; a submodule compiled inside the LightningModule (its
    not-covered line says so); a backend other than Inductor; Lightning's FSDP strategy
    is untested.
    """

    COMMAND = "lightning"

    def _reset(self) -> None:
        self._scale: torch.Tensor | None = None

    @property
    def report_path(self) -> Path | None:
        """Where the report was written (after training ends), else None."""
        return self.session.path

    # -- Lightning hooks ---------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._active = False
        reason = _unsupported(trainer, pl_module)
        if reason is not None:
            warnings.warn(f"fpaudit: {reason}; nothing is audited", stacklevel=2)
            return
        self._first_step = int(trainer.global_step)
        self._start(pl_module, _observed_in_place(pl_module))
        self._active = True

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._active or batch_idx % trainer.accumulate_grad_batches != 0:
            return  # not the first micro-batch of an optimizer step
        if self.session.is_open:  # a step that never reached its last backward
            self.session.abort()
        if self.session.wants(int(trainer.global_step)):
            self._scale = None
            self.session.begin(int(trainer.global_step))

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self._active and self.session.is_open:
            # MixedPrecision.pre_backward scaled the loss before this hook
            self._scale = scale_tensor(getattr(trainer.precision_plugin, "scaler", None))
            self.session.add_loss(unscaled(loss, self._scale))

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if self._active and self.session.is_open and not _accumulating(trainer):
            self.session.close(self._scale if self._scale is not None else 1.0)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._active and self.session.is_open:
            # The step was not closed after its last backward (an unforeseen hook order);
            # the gradients may be unscaled by now: drop it rather than mislabel them.
            warnings.warn(
                "fpaudit: a step reached the optimizer before its last backward was seen; "
                "it is not recorded",
                stacklevel=2,
            )
            self.session.abort()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._active:
            return
        summary = self.session.pending
        if summary is not None:
            # A GradScaler skips the optimizer step on inf/NaN gradients; otherwise it steps.
            skipped = self._scale is not None and summary.nonfinite_grads > 0
            self.session.mark_optimizer_step(stepped=not skipped, skipped=skipped)
            self._log_metrics(
                getattr(trainer, "loggers", ()),
                lambda logger, metrics: logger.log_metrics(metrics, step=summary.step),
            )
        elif self.session.is_open and not _accumulating(trainer):
            self.session.abort()  # training_step returned None: no backward to record

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._active:
            self._finish(trainer, None)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._active:
            self._finish(trainer, type(exception).__name__)

    def _finish(self, trainer: Any, stopped_by: str | None) -> None:
        self._active = False
        self._put_back_compiled()
        optimizers = getattr(trainer, "optimizers", None) or []
        self.session.finish(
            steps_run=int(trainer.global_step) - self._first_step,
            stopped_by=stopped_by,
            meta={
                "lightning_version": lightning.__version__,
                "precision": str(trainer.precision),
                "accumulate_grad_batches": int(trainer.accumulate_grad_batches),
                "strategy": type(trainer.strategy).__name__,
                "world_size": int(trainer.world_size),
                "optimizer": type(optimizers[0]).__name__ if optimizers else None,
                "gradient_clip_val": trainer.gradient_clip_val,
            },
        )


def _unsupported(trainer: Any, pl_module: Any) -> str | None:
    if not getattr(pl_module, "automatic_optimization", True):
        return "FpauditCallback supports automatic optimization only, not manual optimization"
    if getattr(trainer.strategy, "handles_gradient_accumulation", False):
        name = type(trainer.strategy).__name__
        return f"FpauditCallback does not support {name}, which runs backward itself"
    return None


def _observed_in_place(pl_module: Any) -> compiled.InPlace | None:
    """``trainer.fit(torch.compile(model))``: Lightning unwraps the compiled module and runs
    its ``forward`` and ``training_step`` compiled by the context it keeps
    (``_compiler_ctx``, with the eager originals). With Inductor they are compiled again
    from those originals through fpaudit's backend, for the run; None otherwise."""
    context = _internals.lightning_compiled(pl_module)
    if context is None:
        return None
    options = compiled.inductor_options(context.dynamo_context)
    if options is None:  # another backend: audited as an eager module (hooks break its graph)
        return None
    methods = {"forward": context.forward, "training_step": context.training_step}
    in_place: compiled.InPlace = compiled.observe_in_place(pl_module, methods, options)
    return in_place


def _accumulating(trainer: Any) -> bool:
    """Will more micro-batches be accumulated before the optimizer steps?"""
    should_accumulate = _internals.lightning_should_accumulate(trainer.fit_loop)
    if should_accumulate is not None:  # private, but exactly Lightning's own rule
        return should_accumulate
    epoch_loop = trainer.fit_loop.epoch_loop
    ready = epoch_loop.batch_progress.current.ready
    last = ready == trainer.num_training_batches or epoch_loop.batch_progress.is_last_batch
    return ready % trainer.accumulate_grad_batches != 0 and not last
