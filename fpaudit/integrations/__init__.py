"""Audit a run of a training framework from one of its callbacks.

Each integration lives in its own module and imports its framework only there,
so ``import fpaudit`` never imports Lightning or transformers:

* :mod:`fpaudit.integrations.lightning`: ``FpauditCallback``, a
  ``lightning.pytorch.Callback``;
* :mod:`fpaudit.integrations.huggingface`: ``FpauditTrainerCallback``, a
  ``transformers.TrainerCallback``.

Both audit the optimizer steps they are told to (``steps``: the first N
optimizer steps of the run; ``every``: every K-th of them) and write one
report when training ends::

    from fpaudit.integrations.lightning import FpauditCallback

    trainer = lightning.Trainer(callbacks=[FpauditCallback(out="fpaudit-report", steps=20)])
    trainer.fit(model, data)
    # then: fpaudit show fpaudit-report

This module holds what the two share (:class:`AuditSession`): which steps to
audit, the audit of the open step, and the report's metadata.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from fpaudit import defaults
from fpaudit.capture import compiled
from fpaudit.capture.audit import Audit, Selection, StepSummary
from fpaudit.errors import UsageError
from fpaudit.numerics.formats import get_format
from fpaudit.report.runinfo import AMP_NAMES, RunInfo

if TYPE_CHECKING:
    from fpaudit.report.store import Report

__all__ = ["AuditSession", "SessionCallback", "scale_tensor", "unscaled"]


class AuditSession:
    """Which optimizer steps to audit, the open step's audit, and the report.

    A framework callback calls, in order: :meth:`start` when training starts,
    then per audited optimizer step :meth:`begin` (before the first forward of
    the step), :meth:`add_loss` per backward, :meth:`close` once every backward
    of the step is done and before the gradients are unscaled or clipped, and
    :meth:`mark_optimizer_step` once the optimizer ran; :meth:`finish` writes
    the report. :meth:`abort` drops an open step.

    ``steps`` counts optimizer steps from the start of training (a resumed run
    counts from where it resumed): steps ``0 .. steps-1`` of the run are
    candidates, of which every ``every``-th (0, K, 2K, ...) is audited, as
    ``fpaudit scan --steps N --every K`` does. None: no limit.
    """

    def __init__(
        self,
        command: str,
        *,
        out: str | Path,
        steps: int | None,
        every: int,
        formats: Sequence[str] | None,
        force: bool,
        selection: Selection | None,
    ) -> None:
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise UsageError(f"steps must be at least 1 (or None: no limit), got {steps!r}")
        if not isinstance(every, int) or every < 1:
            raise UsageError(f"every must be at least 1, got {every!r}")
        if isinstance(formats, str):
            formats = (formats,)
        self.formats: tuple[str, ...] | None = (
            tuple(get_format(name).name for name in dict.fromkeys(formats))
            if formats is not None
            else None
        )
        if self.formats == ():
            raise UsageError("formats must name at least one format (or be None: automatic)")
        self.command = command
        self.out = Path(out)
        self.steps = steps
        self.every = every
        self.force = force
        self.selection = selection if selection is not None else Selection()
        self.audit: Audit | None = None
        self.model: nn.Module | None = None
        self.report: Report | None = None
        self.path: Path | None = None
        self._first = 0
        self._index = -1
        self._loss: torch.Tensor | None = None
        self._open = False
        self._pending: StepSummary | None = None
        self._finished = True

    # -- the run ---------------------------------------------------------
    def start(self, model: nn.Module, first_step: int, audited: nn.Module | None = None) -> None:
        """Training starts at optimizer step ``first_step`` (0, or where a resumed run resumes).

        ``audited``: what the audit is given in place of ``model``, a compiled model's view
        through fpaudit's backend (:func:`fpaudit.capture.compiled.observe_in_place`).
        Refuses an existing ``out`` unless ``force`` (and anything there but a report),
        now rather than after training.
        """
        if self.out.exists() or self.out.is_symlink():
            if not self.force:
                raise UsageError(f"{self.out} already exists; pass force=True to overwrite it")
            if not (self.out / "meta.json").is_file():
                raise UsageError(
                    f"{self.out} exists and is not an fpaudit report; refusing to replace it"
                )
        self.model = model
        self.audit = Audit(audited if audited is not None else model, selection=self.selection)
        self.report = self.path = None
        self._first = first_step
        self._index = -1
        self._open = False
        self._pending = None
        self._finished = False

    def wants(self, index: int) -> bool:
        """Is optimizer step ``index`` (the framework's global step) one to audit?"""
        if self.audit is None or self._open or index <= self._index:
            return False
        relative = index - self._first
        if relative < 0 or (self.steps is not None and relative >= self.steps):
            return False
        return relative % self.every == 0

    @property
    def is_open(self) -> bool:
        """A step is being audited: its forward and backward passes are recorded."""
        return self._open

    def begin(self, index: int) -> None:
        """Start auditing optimizer step ``index``: enter before the step's first forward."""
        if self.audit is None or self._open:
            return
        self.audit.open()
        self._open = True
        self._index = index
        self._loss = None
        self._pending = None

    def add_loss(self, loss: torch.Tensor) -> None:
        """Add one backward's unscaled loss (a 0-dim tensor; no host sync) to the step's."""
        if not self._open:
            return
        value = loss.detach().reshape(()).float()
        self._loss = value if self._loss is None else self._loss + value.to(self._loss.device)

    def close(self, loss_scale: float | torch.Tensor) -> StepSummary | None:
        """Every backward of the step is done: record the parameter gradients (still
        multiplied by ``loss_scale``, the scale backward ran under) and close the step."""
        if self.audit is None or not self._open:
            return None
        self._open = False
        try:
            summary = self.audit.step(loss=self._loss, index=self._index, loss_scale=loss_scale)
        except BaseException:
            self.audit.close(discard=True)
            raise
        self.audit.close()
        self._loss = None
        self._pending = summary
        return summary

    def abort(self) -> None:
        """Drop the open step (its hooks come off; nothing of it is recorded)."""
        if self.audit is not None and self._open:
            self._open = False
            self._loss = None
            self.audit.close(discard=True)

    @property
    def pending(self) -> StepSummary | None:
        """The last closed step, until :meth:`mark_optimizer_step` records its outcome."""
        return self._pending

    def metrics(self, top: int) -> dict[str, float]:
        """The dashboard metrics of the last closed step (:meth:`Audit.metrics`), in the
        session's first format (default: the dtype the step held its values in, else fp16)."""
        if self.audit is None:
            return {}
        return self.audit.metrics(self.formats[0] if self.formats else None, top=top)

    def mark_optimizer_step(self, stepped: bool, skipped: bool = False) -> None:
        """Whether the optimizer stepped after the last closed step, or skipped for inf/NaN."""
        if self.audit is not None and self._pending is not None:
            self.audit.mark_optimizer_step(stepped, skipped)
            self._pending = None

    def finish(
        self,
        *,
        steps_run: int,
        stopped_by: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Path | None:
        """Write the report to ``out`` (once per run); its path, or None when not started.

        ``stopped_by`` (an exception's name) marks the report incomplete.
        """
        if self._finished or self.audit is None:
            return None
        self._finished = True
        self.abort()
        report = self.audit.report
        from fpaudit.rules.analysis import held_dtype

        amp_dtype = held_dtype(report)
        formats = self.formats or (AMP_NAMES.get(amp_dtype or "", "fp16"),)
        model = self.model
        first = next(model.parameters(), None) if model is not None else None
        steps = (self.steps, max(steps_run, 0))
        run = RunInfo.ended(self.command, stopped_by, steps, self.selection.describe(), amp_dtype)
        report.update_info(formats=tuple(formats))
        report.record_run(
            run,
            {
                "every": self.every,
                "capture_dtype": str(first.dtype).removeprefix("torch.")
                if first is not None
                else None,
                "model_class": type(model).__name__ if model is not None else None,
                **(meta or {}),  # the integration's own (its trainer's settings)
            },
        )
        self.report = report
        self.path = self._write(report, stopped_by)
        if not report.info.steps:
            warnings.warn(
                f"fpaudit: no optimizer step was audited; {self.out} holds an empty report",
                stacklevel=2,
            )
        return self.path

    def _write(self, report: Report, stopped_by: str | None) -> Path:
        """One report from every rank under torch.distributed (each writes its part);
        a rank that stops on an exception writes its own steps alone, to ``OUT.rankN``:
        the other ranks may never reach a collective write, and waiting for them would
        hang this one."""
        from fpaudit.run import distributed

        if not distributed.active():
            return report.write(self.out, force=self.force)
        if stopped_by is None:
            return distributed.write_report(report, self.out, force=self.force)
        import torch.distributed as dist

        own = self.out.with_name(f"{self.out.name}.rank{dist.get_rank()}")
        warnings.warn(
            f"fpaudit: training stopped ({stopped_by}) on rank {dist.get_rank()}; its audited "
            f"steps are in {own}, a report of this rank alone",
            stacklevel=3,
        )
        return report.write(own, force=self.force)


def scale_tensor(scaler: Any) -> torch.Tensor | None:
    """The scale an enabled ``torch.amp.GradScaler`` is in force with (a 0-dim tensor,
    no host sync), or None for no scaler, a disabled one or one not yet used."""
    from fpaudit.capture.torch_patches import scaler_enabled, scaler_scale  # GradScaler's reader

    return scaler_scale(scaler) if scaler_enabled(scaler) else None


def unscaled(loss: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``loss`` (as backpropagated) divided by the loss scale: exact for powers of two."""
    value = loss.detach().reshape(()).float()
    return value if scale is None else value / scale.to(value.device).reshape(())


class SessionCallback:
    """What every framework callback starts from: one :class:`AuditSession` built from
    the same arguments, named by the class's ``COMMAND``, and training not yet under way.
    A callback lists it before its framework's base class; :meth:`_reset` sets what a
    callback keeps of its own."""

    COMMAND: ClassVar[str]

    def __init__(
        self,
        out: str | Path = "fpaudit-report",
        steps: int | None = None,
        every: int = 1,
        formats: Sequence[str] | None = None,
        force: bool = True,
        selection: Selection | None = None,
        *,
        log_metrics: bool = True,
        metrics_top: int = defaults.METRICS_TOP,
    ) -> None:
        super().__init__()
        self.log_metrics = log_metrics  # each audited step's metrics to the trainer's loggers
        self.metrics_top = metrics_top
        self.session = AuditSession(
            self.COMMAND,
            out=out,
            steps=steps,
            every=every,
            formats=formats,
            force=force,
            selection=selection,
        )
        self._active = False
        self._first_step = 0
        self._in_place: compiled.InPlace | None = None
        self._reset()

    def _reset(self) -> None:
        """The callback's own state before training starts."""

    def _start(self, model: nn.Module, in_place: compiled.InPlace | None) -> None:
        """Start the session on ``model``; a compiled model's methods were rebound to
        compile through fpaudit's backend (``in_place``), and its view is audited."""
        self._in_place = in_place
        try:
            self.session.start(model, self._first_step, in_place.view if in_place else None)
        except BaseException:
            self._put_back_compiled()
            raise

    def _log_metrics(
        self, loggers: Iterable[Any], log: Callable[[Any, dict[str, float]], object]
    ) -> None:
        """With ``log_metrics``, the last closed step's metrics to each of ``loggers``
        (``log(logger, metrics)``); a logger that fails is warned about and training goes
        on. No host sync: the step close already read what the metrics need."""
        metrics = self.session.metrics(self.metrics_top) if self.log_metrics else {}
        for logger in loggers if metrics else ():
            try:
                log(logger, dict(metrics))
            except Exception as error:  # the user's logger: never stop training for it
                warnings.warn(
                    f"fpaudit: {type(logger).__name__} failed to log fpaudit's metrics "
                    f"({type(error).__name__}: {error}); the audit goes on",
                    stacklevel=3,
                )

    def _put_back_compiled(self) -> None:
        """Put back the methods the callback compiled through fpaudit's backend."""
        if self._in_place is not None:
            self._in_place.restore()
            self._in_place = None
