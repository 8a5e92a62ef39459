"""Audit an unmodified training script: what ``fpaudit run SCRIPT.py`` does.

The script runs in this process as ``python SCRIPT.py ARGS`` would run it
(``__name__ == "__main__"``, ``sys.argv``, the script's folder first on
``sys.path``), while fpaudit watches the calls a mixed-precision loop makes:

* ``torch.amp.GradScaler`` (``torch.cuda.amp.GradScaler`` is a subclass):
  ``scale``, ``unscale_``, ``step`` and ``update``;
* every optimizer's ``step`` (torch's global optimizer hooks) and ``zero_grad``;
* ``lr_scheduler.step``, ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_``;
* ``torch.autograd.backward`` (what ``loss.backward()`` calls);
* reads of ``.grad`` by the script while the gradients are still scaled;
* top-level module calls: the first one with trainable parameters is the model.

A *step* is one optimizer step of the first optimizer that steps; when an
enabled ``GradScaler`` takes part, the step ends at ``scaler.update()``, which
comes after every optimizer of the iteration.

Nothing here reads a device value while the script runs: the scale in force,
the inf checks, norms and losses stay 0-dim device tensors (``_ScalarLog``)
and are read in one transfer per device at the end, so the run has no host
syncs beyond the one ``GradScaler.step`` makes anyway. Every K-th step
(``capture_every``) the core audit records every backward op under the scale
in force; a captured step costs one more sync, as in ``fpaudit scan``.

Misuse is judged after the run, from those values (``findings``): each finding
names the file and line of the call, the first frame outside torch and fpaudit.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

import fpaudit
from fpaudit import _torch_patches as patches
from fpaudit import modelfile, options
from fpaudit._torch_patches import Call
from fpaudit.capture import Audit, Selection
from fpaudit.errors import FpauditError, Interrupted, ModelFileError, OptionError
from fpaudit.findings import (
    FINDINGS,
    Finding,
    Findings,
    SchedulerCall,
    SpanScale,
    _number,
    mixed_scale_findings,
    scale_findings,
    scheduler_findings,
    skip_statistics,
    sorted_findings,
)
from fpaudit.records import LOSS_MODULE, ReportBuilder
from fpaudit.runinfo import RunInfo
from fpaudit.steps import ScalarLog, Span, Step, steps_table

if TYPE_CHECKING:
    from fpaudit.report import Report

__all__ = [  # the findings and the step state live in fpaudit.findings and fpaudit.steps
    "FINDINGS",
    "Finding",
    "RunOptions",
    "RunOutcome",
    "ScalarLog",
    "StopRun",
    "TrainingMonitor",
    "call_site",
    "run_script",
    "scale_findings",
    "scheduler_findings",
    "skip_statistics",
]

# Frames that are never the script's: torch, fpaudit, and contextlib (fpaudit's
# handlers of patched calls are context managers).
_OUTSIDE = (
    *(os.path.dirname(m.__file__) + os.sep for m in (torch, fpaudit) if m.__file__),
    contextlib.__file__,
)


class StopRun(BaseException):
    """``--max-steps`` reached: unwinds the script (a BaseException, so that a script's
    ``except Exception`` does not swallow it)."""


@dataclass(frozen=True)
class RunOptions:
    # defaults: the one declaration of each option, fpaudit.options
    max_steps: int | None = None  # stop after this many optimizer steps
    capture_every: int = options.default_int("run", "capture_every")  # 0: never
    window: int = options.default_int("run", "window")  # merge W consecutive captured steps
    selection: Selection = field(default_factory=Selection)
    max_backoffs: int = options.default_int("run", "max_backoffs")  # more is a finding
    max_skip_rate: float = options.default_float("run", "max_skip_rate")  # more is a finding
    watch_grad_reads: bool = True  # find .grad reads while the gradients are scaled

    def __post_init__(self) -> None:
        if self.max_steps is not None and self.max_steps < 1:
            raise OptionError("max_steps", f"must be at least 1, got {self.max_steps}")
        if self.capture_every < 0:
            raise OptionError(
                "capture_every", f"must be 0 (never) or more, got {self.capture_every}"
            )
        if self.window < 1:
            raise OptionError("window", f"must be at least 1, got {self.window}")
        if self.max_backoffs < 1:
            raise OptionError("max_backoffs", f"must be at least 1, got {self.max_backoffs}")
        if not 0.0 <= self.max_skip_rate <= 1.0:
            raise OptionError("max_skip_rate", f"must be between 0 and 1, got {self.max_skip_rate}")


def call_site() -> tuple[str, int]:
    """File and line of the innermost frame outside torch and fpaudit: the script's call."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_OUTSIDE) and not filename.startswith("<"):
            return filename, frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>", 0


class TrainingMonitor:
    """Instruments torch's training APIs while installed (see the module docstring)."""

    def __init__(self, options: RunOptions = RunOptions()) -> None:
        self.options = options
        self.findings = Findings()
        self.log = ScalarLog()
        self.steps: list[Step] = []
        self.audit: Audit | None = None
        self.audited_model: nn.Module | None = None
        self.models: list[str] = []  # class names of top-level modules with trainable parameters
        self.scaler_settings: dict[str, Any] | None = None
        self.optimizers: list[str] = []
        self.schedulers: list[str] = []
        self.update_site: tuple[str, int] | None = None
        self.done = False  # --max-steps reached: the next step's first call stops the script
        self._primary: torch.optim.Optimizer | None = None
        self._probes: dict[int, torch.Tensor] = {}  # optimizer id -> a parameter to watch
        self._last_attempt: dict[int, int] = {}  # optimizer id -> step index
        self._scheduler_calls: list[SchedulerCall] = []
        self._updates = 0  # scaler.update() calls: the scale's version
        self._trainable: dict[int, bool] = {}
        self._roots: list[nn.Module] = []  # the first top-level modules called
        self._depth = 0  # module call depth
        self._optimizer_depth = 0
        self._scheduler_depth = 0
        self._in_scaler_step = 0
        self._internal = 0  # inside a call whose own .grad reads are not the script's
        self._in_backward = 0
        self._scaled_since_unscale = False  # an enabled scaler's scale() since unscale_/step
        self._scaled_pending = False  # gradients hold scaled values not yet unscaled
        self._capturing = False
        self._span = Span()
        self._mixed: list[list[SpanScale]] = []
        self._step = self._new_step(0)

    # -- installation --------------------------------------------------------
    @contextmanager
    def installed(self) -> Iterator[TrainingMonitor]:
        """Patch torch's training APIs for the duration of the block."""
        with ExitStack() as stack:
            patches.install(stack, self, grad_reads=self.options.watch_grad_reads)
            try:
                yield self
            finally:
                if self._capturing and self.audit is not None:
                    self._capturing = False
                    self.audit.close(discard=True)  # drop the open step

    def on_grad_read(self, caller: FrameType) -> None:
        """The script (or torch, or fpaudit) read a ``.grad`` in frame ``caller``."""
        if not self._scaled_pending or self._quiet():
            return
        filename = caller.f_code.co_filename
        if filename.startswith(_OUTSIDE) or filename.startswith("<"):
            return
        self.findings.add(
            "grad-read-while-scaled",
            (filename, caller.f_lineno),
            self._step.index,
            ".grad read while the gradients are still multiplied by the loss scale: values "
            "logged or checked here are S times too large; call scaler.unscale_(optimizer) "
            "first",
        )

    def _quiet(self) -> bool:
        return bool(self._internal or self._in_backward)

    # -- steps ---------------------------------------------------------------
    def _new_step(self, index: int) -> Step:
        every = self.options.capture_every
        return Step(index, time.perf_counter(), capture=bool(every) and index % every == 0)

    def _maybe_stop(self) -> None:
        if self.done:
            raise StopRun

    def _scale_slot(self, scaler: Any) -> int:
        scale = patches.scaler_scale(scaler)
        assert scale is not None, "a used scaler has a scale"
        return self.log.add(scale)

    def _use_scaler(self, scaler: Any) -> None:
        step = self._step
        if step.scaler is None:
            step.scaler = scaler
            step.scale_before = self._scale_slot(scaler)
        if self.scaler_settings is None:
            self.scaler_settings = patches.scaler_settings(scaler)

    def _end_step(self) -> None:
        step = self._step
        if self._capturing:
            self._close_capture()
        step.seconds = time.perf_counter() - step.started
        if step.loss is not None:
            step.slots["loss"] = self.log.add(step.loss)
        if step.found_inf is not None:
            step.slots["found_inf"] = self.log.add(step.found_inf)
        if step.grad_amax is not None:
            step.slots["grad_amax"] = self.log.add(step.grad_amax)
        if step.scaler is not None:
            step.slots["scale_after"] = self._scale_slot(step.scaler)
        self.steps.append(step)
        if self.options.max_steps is not None and len(self.steps) >= self.options.max_steps:
            self.done = True
        self._step = self._new_step(step.index + 1)

    def _attempt(self, optimizer: torch.optim.Optimizer) -> None:
        if self._primary is None:
            self._primary = optimizer
        if self._capturing:
            self._close_capture()
        self._last_attempt[id(optimizer)] = self._step.index
        if optimizer is self._primary:
            self._step.attempted = True
        if id(optimizer) not in self._probes:
            self._note_optimizer(optimizer)

    def _note_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizers.append(type(optimizer).__name__)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if isinstance(param, torch.Tensor) and param.requires_grad:
                    self._probes[id(optimizer)] = param
                    return

    def _note_grad_amax(self, optimizer: torch.optim.Optimizer) -> None:
        """The largest gradient magnitude, as the optimizer sees the gradients (no sync)."""
        grads = [patches.raw_grad(p) for group in optimizer.param_groups for p in group["params"]]
        self._note_amax_of([g for g in grads if g is not None])

    def _note_amax_of(self, grads: list[torch.Tensor]) -> None:
        amax = patches.amax(grads)
        if amax is None:
            return
        step = self._step
        step.grad_amax = amax if step.grad_amax is None else torch.maximum(step.grad_amax, amax)

    # -- capture of backward ops ----------------------------------------------
    def _trainable_root(self, module: nn.Module) -> bool:
        known = self._trainable.get(id(module))
        if known is None:
            known = any(p.requires_grad for p in module.parameters())
            self._trainable[id(module)] = known
            if known:
                self.models.append(type(module).__name__)
        return known

    def _start_capture(self, module: nn.Module) -> None:
        if self.audit is None:
            self.audited_model = module
            self.audit = Audit(module, selection=self.options.selection, window=self.options.window)
            self.options.selection.check_modules(self.audit.module_names)  # a typo stops here
        elif module is not self.audited_model:
            return  # another model: only the first is audited
        self.audit.open()
        self.audit.entered_by(module)
        self._capturing = True

    def _close_capture(self) -> None:
        """Gradients are complete (unscale_ or an optimizer step is next): close the step."""
        assert self.audit is not None
        step = self._step
        self._capturing = False
        if step.backward_calls == 0:  # forward only so far (evaluation): try again later
            self.audit.close(discard=True)
            return
        scale = patches.scaler_scale(step.scaler) if step.scaler is not None else None
        self._internal += 1
        try:
            self.audit.step(
                loss=step.loss, index=step.index, loss_scale=1.0 if scale is None else scale
            )
        finally:
            self._internal -= 1
            self.audit.close()
        step.captured = True
        step.capture = False

    # -- hooks -----------------------------------------------------------------
    def forward_pre_hook(self, module: nn.Module, args: Any) -> None:
        if self._depth == 0:
            self._maybe_stop()
            if len(self._roots) < 16 and all(module is not root for root in self._roots):
                self._roots.append(module)  # stands in for a clip call's generator
            step = self._step
            if (
                step.capture
                and not self._capturing
                and not self._in_backward
                and self._trainable_root(module)
            ):
                self._start_capture(module)
        self._depth += 1

    def forward_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth = max(self._depth - 1, 0)

    def optimizer_pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizer_depth += 1
        if self._optimizer_depth > 1:
            return
        self._step.stepped = True
        if self._in_scaler_step:
            return
        self._maybe_stop()
        if self._scaled_pending:
            self.findings.add(
                "step-without-unscale",
                call_site(),
                self._step.index,
                f"{type(optimizer).__name__}.step() ran on gradients still multiplied by the "
                "loss scale; call scaler.step(optimizer) (or scaler.unscale_(optimizer) first)",
            )
        self._attempt(optimizer)
        self._internal += 1
        try:
            self._note_grad_amax(optimizer)
        finally:
            self._internal -= 1

    def optimizer_post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizer_depth -= 1
        if self._optimizer_depth or self._in_scaler_step:
            return
        step = self._step
        if optimizer is self._primary and not step.scaler_stepped:
            self._end_step()  # no scaler.update() to wait for

    def _new_span(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Gradients were zeroed (all, or ``optimizer``'s): a new effective batch starts."""
        span = self._span
        if len({version for version, *_ in span.scales}) > 1:
            self._mixed.append(span.scales)  # judged after the run, when values are known
        span.scales = []
        if optimizer is None:
            span.unscaled.clear()
        else:
            span.unscaled.discard(id(optimizer))

    def _probe_span(self) -> None:
        """Gradients set to None by hand (not by zero_grad) also start a new batch
        (checked when a micro-batch is scaled, before its backward)."""
        if self._span.scales or self._span.unscaled:
            for probe in self._probes.values():
                if patches.raw_grad(probe) is None:
                    self._new_span()
                    return

    # -- handlers of the patched calls (see _torch_patches) --------------------------
    @contextmanager
    def on_scale(self, call: Call) -> Iterator[None]:
        scaler, outputs = call.arguments["self"], call.arguments["outputs"]
        if not patches.scaler_enabled(scaler):
            yield
            return
        self._maybe_stop()
        self._probe_span()
        site = call_site()
        yield  # the original initialises the scaler's scale on first use
        self._use_scaler(scaler)
        step = self._step
        span = self._span
        if not span.scales or span.scales[-1][0] != self._updates:
            span.scales.append(SpanScale(self._updates, self._scale_slot(scaler), site, step.index))
        if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
            loss = outputs.detach().reshape(()).float()
            running = step.loss if step.loss_from_scale else None
            step.loss = loss if running is None else running + loss
            step.loss_from_scale = True
        self._scaled_since_unscale = True

    @contextmanager
    def on_unscale(self, call: Call) -> Iterator[None]:
        scaler, optimizer = call.arguments["self"], call.arguments["optimizer"]
        if not patches.scaler_enabled(scaler):
            yield
            return
        site = call_site()
        if self._capturing:
            self._close_capture()
        if id(optimizer) in self._span.unscaled:
            self.findings.add(
                "unscale-twice",
                site,
                self._step.index,
                "unscale_() ran again on gradients already unscaled since they were last "
                "zeroed: they are divided by the scale twice",
            )
        self._span.unscaled.add(id(optimizer))
        self._use_scaler(scaler)
        self._step.scaler_stepped = True
        with self._own_calls():
            self._note_grad_amax(optimizer)  # still scaled: divided by the scale later
            yield
        self._scaled_since_unscale = False
        self._scaled_pending = False

    @contextmanager
    def on_scaler_step(self, call: Call) -> Iterator[None]:
        scaler, optimizer = call.arguments["self"], call.arguments["optimizer"]
        if not patches.scaler_enabled(scaler):
            yield
            return
        self._maybe_stop()
        self._use_scaler(scaler)
        self._step.scaler_stepped = True
        self._attempt(optimizer)
        self._in_scaler_step += 1
        try:  # unscale_ (patched too) runs inside unless the script called it
            with self._own_calls():
                yield
        finally:
            self._in_scaler_step -= 1
        found = patches.found_inf(scaler, optimizer)
        if found is not None:
            current = self._step.found_inf
            self._step.found_inf = found if current is None else current + found
        self._scaled_since_unscale = False
        self._scaled_pending = False

    @contextmanager
    def on_update(self, call: Call) -> Iterator[None]:
        scaler = call.arguments["self"]
        if not patches.scaler_enabled(scaler):
            yield
            return
        if self.update_site is None:
            self.update_site = call_site()
        if patches.scaler_scale(scaler) is not None:
            self._use_scaler(scaler)
        yield
        self._updates += 1
        if self._step.attempted:
            self._end_step()

    @contextmanager
    def on_backward(self, call: Call) -> Iterator[None]:
        self._maybe_stop()
        step = self._step
        step.backward_calls += 1
        tensors = call.arguments["tensors"]
        if not step.loss_from_scale and isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
            loss = tensors.detach().reshape(()).float()
            step.loss = loss if step.loss is None else step.loss + loss
        self._in_backward += 1
        try:
            yield
        finally:
            self._in_backward -= 1
        if self._scaled_since_unscale:
            self._scaled_pending = True

    @contextmanager
    def on_clip(self, call: Call) -> Iterator[None]:
        name = call.name.rsplit(".", 1)[-1]
        parameters = call.arguments["parameters"]
        limit = call.arguments["max_norm" if name == "clip_grad_norm_" else "clip_value"]
        site = call_site()
        step = self._step
        scaled = self._scaled_pending
        if scaled:
            # Measure before clipping shrinks them: unscale_ will only see the result.
            with self._own_calls():
                self._note_amax_of(self._clipped_grads(parameters))
            self.findings.add(
                "clip-before-unscale",
                site,
                step.index,
                f"{name}(..., {_number(limit)}) clipped gradients still multiplied by the loss "
                "scale S: the threshold is meant for unscaled gradients, so clipping is "
                "off by a factor S; call scaler.unscale_(optimizer) before clipping",
            )
        with self._own_calls():
            yield
        if name == "clip_grad_norm_" and isinstance(call.result, torch.Tensor):
            step.norm = self.log.add(call.result)
            step.norm_scaled = scaled
            step.max_norm = float(limit)

    def _clipped_grads(self, parameters: Any) -> list[torch.Tensor]:
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
            params = [p for root in self._roots for p in root.parameters()]
        grads = [patches.raw_grad(p) for p in params if isinstance(p, torch.Tensor)]
        return [g for g in grads if g is not None]

    @contextmanager
    def on_zero_grad(self, call: Call) -> Iterator[None]:
        owner = call.arguments["self"]
        self._new_span(owner if isinstance(owner, torch.optim.Optimizer) else None)
        self._scaled_pending = False
        with self._own_calls():
            yield

    @contextmanager
    def on_scheduler_step(self, call: Call) -> Iterator[None]:
        scheduler = call.arguments["self"]
        outermost = self._scheduler_depth == 0
        if outermost and not patches.scheduler_initial_step(scheduler):
            optimizer = getattr(scheduler, "optimizer", None)
            last = self._last_attempt.get(id(optimizer), -1)
            self._scheduler_calls.append(SchedulerCall(call_site(), last, type(scheduler).__name__))
            name = type(scheduler).__name__
            if name not in self.schedulers:
                self.schedulers.append(name)
        site = call_site()
        self._scheduler_depth += 1
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                yield
        finally:
            self._scheduler_depth -= 1
        for warning in caught:  # torch's own warnings, told at the script's line
            warnings.warn_explicit(
                warning.message, warning.category, site[0], site[1], module="__main__"
            )

    @contextmanager
    def _own_calls(self) -> Iterator[None]:
        """fpaudit's (or torch's) own .grad reads inside, not the script's."""
        self._internal += 1
        try:
            yield
        finally:
            self._internal -= 1

    # -- after the run ---------------------------------------------------------
    def steps_table(self) -> tuple[dict[str, list[Any]], np.ndarray]:
        """The steps table (every column of STEP_COLUMNS) and the scalar log's values."""
        values = self.log.read()
        rows = self.audit.step_rows() if self.audit is not None else None
        return steps_table(self.steps, values, rows), values

    def judge(self, table: dict[str, list[Any]], values: np.ndarray) -> list[Finding]:
        """Findings that need the run's values: scales, skips, schedulers, accumulation."""
        found = [*scheduler_findings(table, self._scheduler_calls)]
        spans = [*self._mixed, self._span.scales]
        found += mixed_scale_findings(spans, values, self.update_site)
        if self.scaler_settings is not None:
            site = self.update_site or ("<script>", 0)
            options = self.options
            found += scale_findings(table, site, options.max_backoffs, options.max_skip_rate)
        for finding in found:
            self.findings.items[(finding.code, finding.file, finding.line)] = finding
        return sorted_findings(list(self.findings.items.values()))


def _script_line(error: BaseException, script: Path) -> str:
    """The script's line where ``error`` surfaced (the innermost frame in ``script``)."""
    found = "an unknown line"
    target = str(script.resolve())
    traceback = error.__traceback__
    while traceback is not None:
        if os.path.abspath(traceback.tb_frame.f_code.co_filename) == target:
            found = f"{script}:{traceback.tb_lineno}"
        traceback = traceback.tb_next
    return found


# -- running a script -----------------------------------------------------------
@dataclass
class RunOutcome:
    """A finished run: the report (not yet written) and how the script ended."""

    report: Report
    findings: list[Finding]
    failure: FpauditError | None = None  # the script failed; write the report, then say this
    interrupted: Interrupted | None = None
    exit_status: int = 0  # what ``python script`` would have exited with (0, or its exit code)


def run_script(
    script: str | os.PathLike[str],
    args: list[str] | tuple[str, ...] = (),
    options: RunOptions = RunOptions(),
    *,
    meta: dict[str, Any] | None = None,
) -> RunOutcome:
    """Run ``script`` with ``args`` as ``python script args`` would, under a monitor.

    Whatever way the script ends (finishes, reaches ``max_steps``, raises,
    exits, is interrupted) the steps done so far come back as a report.
    """
    path = Path(script)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ModelFileError(f"training script {path} {what}")
    monitor = TrainingMonitor(options)
    failure: FpauditError | None = None
    interrupted: Interrupted | None = None
    stopped_by: str | None = None
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.resolve().parent))
    exit_status = 0
    try:
        # os._exit(n) from the script ends it like sys.exit(n); a forked child's is real.
        with monitor.installed(), modelfile.exits_caught():
            runpy.run_path(str(path), run_name="__main__")
    except StopRun:
        stopped_by = "max-steps"
    except patches.MonitorFailure as broken:
        if isinstance(broken.error, FpauditError):
            # the user's input, found once the model was seen (a --module glob that
            # matches no module): their error, one line, not a bug
            raise broken.error from None
        # fpaudit's own code failed, not the script: no report of a half-watched run
        raise RuntimeError(
            f"fpaudit's training monitor failed ({broken}) at {_script_line(broken, path)}; "
            f"this is a bug in fpaudit, not in {path.name}"
        ) from broken.error
    except SystemExit as done:
        if done.code not in (None, 0):
            detail = f"status {done.code}" if isinstance(done.code, int) else repr(done.code)
            failure = ModelFileError(f"{path} exited with {detail}")
            stopped_by = "script exit"
            exit_status = done.code if isinstance(done.code, int) else 1
    except KeyboardInterrupt as error:  # SIGINT, or SIGTERM as the CLI raises it
        interrupted = error if isinstance(error, Interrupted) else Interrupted()
        stopped_by = interrupted.signal_name
    except Exception as error:
        failure = ModelFileError(
            f"{modelfile.where(error, path)}: the script raised {modelfile.describe(error)}"
        )
        stopped_by = "script error"
        exit_status = 1
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path

    table, values = monitor.steps_table()
    findings = monitor.judge(table, values)
    if monitor.audit is not None:
        report = monitor.audit.build_report(table)
    else:
        from fpaudit.report import Report, run_metadata

        report = Report.from_builder(ReportBuilder(modules=[LOSS_MODULE]), run_metadata(), table)
    from fpaudit.analysis import held_dtype

    amp_dtype = held_dtype(report)
    run = RunInfo(
        command="run",
        script=str(path),
        steps_requested=options.max_steps,
        steps_run=len(monitor.steps),
        complete=failure is None and interrupted is None,
        stopped_by=stopped_by,
        selection=options.selection.describe(),
        amp_dtype=amp_dtype,
    )
    report.meta.update(
        {
            **run.to_meta(),
            "script_args": list(args),
            "capture_every": options.capture_every,
            "scaler": monitor.scaler_settings,
            "optimizers": monitor.optimizers,
            "schedulers": monitor.schedulers,
            "models": monitor.models,
            "audited_model": type(monitor.audited_model).__name__
            if monitor.audited_model is not None
            else None,
            "findings": [f.to_dict() for f in findings],
            "training": skip_statistics(np.array(table["skipped"], dtype=bool)),
            **(meta or {}),
        }
    )
    if interrupted is not None:
        exit_status = interrupted.exit_code
    return RunOutcome(report, findings, failure, interrupted, exit_status)
