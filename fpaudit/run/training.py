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
comes after every optimizer of the iteration. A loop without ``torch.optim``
(manual SGD, ``p.data.add_(p.grad, alpha=-lr)``) makes its own updates: while no
optimizer has stepped, a step ends at the next ``zero_grad`` after a backward, else
at the next forward after a backward once the gradients were set to None, and at the
script's end when backward ran since. Backward passes inside an optimizer step
(LBFGS's closure) belong to that step; its loss is the first closure's (what
``LBFGS.step`` returns), not their sum.

Nothing of fpaudit's is put on the script's objects: module calls are seen through
torch's global module hooks, which also feed the capture's module clock (no hook on
any module, so ``torch.save(model)``, ``copy.deepcopy`` and ``pickle`` meet nothing of
fpaudit's); the script runs with ``__file__`` absolute, as Python gives it.

Nothing here reads a device value while the script runs: the scale in force,
the inf checks, norms and losses stay 0-dim device tensors (``ScalarLog``)
and are read in one transfer per device at the end, so the run has no host
syncs beyond the one ``GradScaler.step`` makes anyway. Every K-th step
(``capture_every``) the core audit records every backward op under the scale
in force; a captured step costs one more sync, as in ``fpaudit scan``. With
``recipes`` (``--recipe``) the captured tensors (backward op outputs and parameter
gradients) also get exact block-scaled statistics, as ``scan --recipe`` records them.

The monitor translates each patched call into an update of its state
(``steps.RunState``); misuse is judged after the run, from that state's log of
calls and those values (``findings``): each finding names the file and line of
the call, the first frame outside torch and fpaudit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import sys
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

import fpaudit
from fpaudit import defaults
from fpaudit.bounds import AT_LEAST_1
from fpaudit.capture import compiled
from fpaudit.capture import torch_patches as patches
from fpaudit.capture.audit import Audit, Selection
from fpaudit.capture.torch_patches import Call
from fpaudit.errors import FpauditError, Interrupted, ModelFileError, OptionError
from fpaudit.numerics.recipes import get_recipe
from fpaudit.report.records import LOSS_MODULE, ReportBuilder
from fpaudit.report.runinfo import RunInfo, RunMeta
from fpaudit.rules.findings import (
    FINDINGS,
    Finding,
    _number,
    grad_call_findings,
    mixed_scale_findings,
    scale_findings,
    scheduler_findings,
    skip_statistics,
    sorted_findings,
)
from fpaudit.run import modelfile
from fpaudit.run.skips import skips_table
from fpaudit.run.steps import RunState, ScalarLog, Step, steps_table

if TYPE_CHECKING:
    from fpaudit.report.store import Report

__all__ = [  # the findings and the step state live in fpaudit.rules.findings and fpaudit.run.steps
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
    # defaults: declared once in fpaudit.defaults, which the CLI options read too
    max_steps: int | None = None  # stop after this many optimizer steps
    capture_every: int = defaults.RUN_CAPTURE_EVERY  # 0: never
    # capture the step after a skip (past calibration) with its forward, this many times
    capture_after_skip: int = defaults.RUN_CAPTURE_AFTER_SKIP
    window: int = defaults.WINDOW  # merge W consecutive captured steps
    selection: Selection = field(default_factory=Selection)
    max_backoffs: int = defaults.RUN_MAX_BACKOFFS  # more is a finding
    max_skip_rate: float = defaults.RUN_MAX_SKIP_RATE  # more is a finding
    watch_grad_reads: bool = True  # find .grad reads while the gradients are scaled
    recipes: tuple[str, ...] = ()  # block-scaled recipes to audit (--recipe)

    def __post_init__(self) -> None:
        for name in self.recipes:
            get_recipe(name)  # an unknown name is a one-line UsageError, before the script runs
        AT_LEAST_1.check("max_steps", self.max_steps)  # None: until the script ends
        if self.capture_every < 0:
            raise OptionError(
                "capture_every", f"must be 0 (never) or more, got {self.capture_every}"
            )
        if self.capture_after_skip < 0:
            raise OptionError(
                "capture_after_skip", f"must be 0 (never) or more, got {self.capture_after_skip}"
            )
        AT_LEAST_1.check("window", self.window)
        AT_LEAST_1.check("max_backoffs", self.max_backoffs)
        if not 0.0 <= self.max_skip_rate <= 1.0:
            raise OptionError("max_skip_rate", f"must be between 0 and 1, got {self.max_skip_rate}")


def call_site() -> tuple[str, int]:
    """File and line of the innermost frame outside torch and fpaudit: the script's call."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_OUTSIDE) and not filename.startswith("<"):
            return filename, frame.f_lineno
        frame = frame.f_back
    return "<unknown>", 0


@contextmanager
def _warnings_told_at(site: tuple[str, int]) -> Iterator[None]:
    """Warnings raised inside (torch's own), told at ``site``, the script's line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for warning in caught:
        warnings.warn_explicit(warning.message, warning.category, *site, module="__main__")


class BackwardCapture:
    """Capture of every backward op of a step, every K-th step (``capture_every``), by
    the core audit of the first model with trainable parameters the script calls."""

    def __init__(
        self, options: RunOptions, on_captured: Callable[[Audit], None] | None = None
    ) -> None:
        self.options = options
        self.on_captured = on_captured
        self.audit: Audit | None = None
        self.audited_model: nn.Module | None = None
        self.models: list[str] = []  # class names of top-level modules with trainable parameters
        self.open = False
        self._forward = ExitStack()  # the open capture's forward recording (after a skip)
        self._trainable: dict[int, bool] = {}

    def trainable(self, module: nn.Module) -> bool:
        known = self._trainable.get(id(module))
        if known is None:
            known = any(p.requires_grad for p in module.parameters())
            self._trainable[id(module)] = known
            if known:
                self.models.append(type(module).__name__)
        return known

    def start(self, module: nn.Module, forward: bool = False) -> None:
        """A top-level call of ``module`` begins a step to capture; ``forward``: its
        forward ops too, until its backward starts (the step after a skip)."""
        if self.open or not self.trainable(module):
            return
        if self.audit is None:
            self.audited_model = module
            self.audit = Audit(
                module,
                selection=self.options.selection,
                window=self.options.window,
                recipes=self.options.recipes,
                module_hooks=False,  # the monitor's global hooks tell it of module calls
                name_nonfinite=True,  # the op that first made a skipped step's inf/NaN
            )
            self.options.selection.check_modules(self.audit.module_names)  # a typo stops here
        elif module is not self.audited_model:
            return  # another model: only the first is audited
        self.audit.open()
        self.open = True
        if forward:
            self._forward.enter_context(self.audit.forward_pass())

    def end_forward(self) -> None:
        """The captured step's backward starts (or the capture closes): forward is over."""
        self._forward.close()

    def entered(self, module: nn.Module) -> None:
        """``module`` starts forward: the open capture's module clock notes it."""
        if self.open and self.audit is not None:
            self.audit.clock.module_entered(module)

    def exited(self, module: nn.Module) -> None:
        if self.open and self.audit is not None:
            self.audit.clock.module_exited(module)

    def close(self, step: Step) -> None:
        """Gradients are complete (unscale_ or an optimizer step is next): close ``step``."""
        assert self.audit is not None
        self.end_forward()
        self.open = False
        if step.backward_calls == 0:  # forward only so far (evaluation): try again later
            self.audit.close(discard=True)
            return
        scale = patches.scaler_scale(step.scaler) if step.scaler is not None else None
        try:
            summary = self.audit.step(
                loss=step.loss, index=step.index, loss_scale=1.0 if scale is None else scale
            )
        finally:
            self.audit.close()
        step.made_nonfinite = summary.made_nonfinite
        step.captured = True
        step.capture = False
        if self.on_captured is not None:
            self.on_captured(self.audit)

    def discard(self) -> None:
        """The run ended inside a step: drop it."""
        if self.open and self.audit is not None:
            self.end_forward()
            self.open = False
            self.audit.close(discard=True)


class TrainingMonitor:
    """Instruments torch's training APIs while installed (see the module docstring):
    translates the patched calls into updates of its :class:`RunState`."""

    def __init__(
        self,
        options: RunOptions = RunOptions(),
        on_captured: Callable[[Audit], None] | None = None,
    ) -> None:
        self.options = options
        self.state = RunState(options.capture_every, options.max_steps, options.capture_after_skip)
        self.capture = BackwardCapture(options, on_captured)
        self.update_site: tuple[str, int] | None = None
        self._depth = 0  # module call depth
        self._optimizer_depth = 0
        self._scheduler_depth = 0
        self._in_scaler_step = 0
        self._internal = 0  # inside a call whose own .grad reads are not the script's
        self._in_backward = 0
        self._backward_calls_before_step = 0  # at the optimizer step's start (LBFGS)
        self._optimizer_calls = 0  # optimizer steps begun (a scaler's step that skipped: none)

    # -- installation --------------------------------------------------------
    @contextmanager
    def installed(self) -> Iterator[TrainingMonitor]:
        """Patch torch's training APIs for the duration of the block."""
        with ExitStack() as stack:
            patches.install(stack, self, grad_reads=self.options.watch_grad_reads)
            stack.enter_context(compiled.compiles_observed())
            try:
                yield self
                self._end_manual_step_at_exit()
            except SystemExit:  # the script's own end, whatever its status
                self._end_manual_step_at_exit()
                raise
            finally:
                self.capture.discard()

    def on_grad_read(self, caller: FrameType) -> None:
        """The script (or torch, or fpaudit) read a ``.grad`` in frame ``caller``."""
        if not self.state.scaled_pending or self._internal or self._in_backward:
            return  # unscaled reads are not logged: no concern, and many
        filename = caller.f_code.co_filename
        if not filename.startswith(_OUTSIDE) and not filename.startswith("<"):
            self.state.log_call("read", (filename, caller.f_lineno))

    def _maybe_stop(self) -> None:
        if self.state.done:
            raise StopRun

    def _close_capture(self) -> None:
        if self.capture.open:
            with self._own_calls():
                self.capture.close(self.state.step)

    def _end_step(self) -> None:
        self._close_capture()
        self.state.end_step()

    def _attempt(self, optimizer: torch.optim.Optimizer) -> None:
        self._close_capture()
        self.state.attempt(optimizer)

    # -- loops without torch.optim: the script's own update ends a step ----------
    def _manual_step_due(self) -> bool:
        """No optimizer has stepped, and backward ran in the step in progress."""
        state = self.state
        return (
            not state.optimizer_stepped
            and state.step.backward_calls > 0
            and not self._in_backward
            and not self._optimizer_depth
            and not state.done
        )

    def _end_manual_step(self) -> None:
        """The script updated the weights itself (no optimizer): the step ends here."""
        step = self.state.step
        step.stepped = True  # the script's own update
        step.grad_amax = step.backward_amax
        self._end_step()

    def _end_manual_step_at_exit(self) -> None:
        if self._manual_step_due():
            self._end_manual_step()

    # -- hooks -----------------------------------------------------------------
    def forward_pre_hook(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return  # Dynamo traces the call: not a call of this process (and no graph break)
        if self._depth == 0:
            self._maybe_stop()
            if self._manual_step_due() and self.state.grads_dropped_by_hand():
                self._end_manual_step()  # a loop without zero_grad that sets grads to None
                self._maybe_stop()
            self.state.note_root(module)
            if self.state.step.capture and not self._in_backward and torch.is_grad_enabled():
                self.capture.start(module, forward=self.state.step.capture_forward)
        self.capture.entered(module)
        self._depth += 1

    def forward_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        self.capture.exited(module)
        self._depth = max(self._depth - 1, 0)

    def optimizer_pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizer_depth += 1
        self._optimizer_calls += 1
        if self._optimizer_depth > 1:
            return
        self.state.step.stepped = True
        self._backward_calls_before_step = self.state.step.backward_calls
        if self._in_scaler_step:
            return
        self._maybe_stop()
        self.state.log_call("step", call_site(), type(optimizer).__name__)
        self._attempt(optimizer)
        with self._own_calls():
            self.state.note_grad_amax(optimizer)

    def optimizer_post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizer_depth -= 1
        if self._optimizer_depth or self._in_scaler_step:
            return
        if self.state.ends_on_optimizer(optimizer):
            if self.state.step.backward_calls > self._backward_calls_before_step:
                # a closure (LBFGS) computed the gradients inside the step: theirs
                with self._own_calls():
                    self.state.note_grad_amax(optimizer, replace=True)
            self._end_step()

    # -- handlers of the patched calls (see torch_patches) --------------------------
    @contextmanager
    def on_scale(self, call: Call) -> Iterator[None]:
        scaler, outputs = call.arguments["self"], call.arguments["outputs"]
        if not patches.scaler_enabled(scaler):
            yield
            return
        self._maybe_stop()
        self.state.probe_span()
        site = call_site()
        yield  # the original initialises the scaler's scale on first use
        self.state.scaled(scaler, outputs, site)

    @contextmanager
    def on_unscale(self, call: Call) -> Iterator[None]:
        scaler, optimizer = call.arguments["self"], call.arguments["optimizer"]
        if not patches.scaler_enabled(scaler):
            yield
            return
        site = call_site()
        self._close_capture()
        self.state.unscaling(scaler, optimizer, site)
        with self._own_calls():
            # still scaled: divided by the scale later; each gradient's inf/NaN flag kept
            self.state.note_grad_amax(optimizer, checked=True)
            yield
        self.state.unscaled()

    @contextmanager
    def on_scaler_step(self, call: Call) -> Iterator[None]:
        scaler, optimizer = call.arguments["self"], call.arguments["optimizer"]
        if not patches.scaler_enabled(scaler):
            yield
            return
        self._maybe_stop()
        self.state.scaler_stepping(scaler, optimizer)
        self._close_capture()
        self._in_scaler_step += 1
        calls = self._optimizer_calls
        try:  # unscale_ (patched too) runs inside unless the script called it
            with self._own_calls():
                yield
        finally:
            self._in_scaler_step -= 1
        # the scaler synced already to decide: no optimizer step began, so it skipped
        self.state.scaler_stepped(scaler, optimizer, skipped=self._optimizer_calls == calls)

    @contextmanager
    def on_update(self, call: Call) -> Iterator[None]:
        scaler = call.arguments["self"]
        if not patches.scaler_enabled(scaler):
            yield
            return
        if self.update_site is None:
            self.update_site = call_site()
        if patches.scaler_scale(scaler) is not None:
            self.state.use_scaler(scaler)
        yield
        if self.state.updated():
            self._end_step()

    @contextmanager
    def on_backward(self, call: Call) -> Iterator[None]:
        self._maybe_stop()
        self.capture.end_forward()
        self.state.backward_starts(call.arguments["tensors"], in_step=self._optimizer_depth > 0)
        self._in_backward += 1
        try:
            yield
        finally:
            self._in_backward -= 1
        self.state.backward_done()
        if not self.state.optimizer_stepped and not self._in_backward:
            # no optimizer (yet): the gradients as the last backward left them, taken now
            # (a loop may set them to None before the step is known to have ended); the
            # step's if it ends as the script's own update
            with self._own_calls():
                self.state.step.backward_amax = patches.amax(self.state.root_grads())

    @contextmanager
    def on_clip(self, call: Call) -> Iterator[None]:
        name = call.name.rsplit(".", 1)[-1]
        parameters = call.arguments["parameters"]
        limit = call.arguments["clip_value" if name == "clip_grad_value_" else "max_norm"]
        site = call_site()
        state = self.state
        scaled = state.scaled_pending
        by_value = name == "clip_grad_value_"
        if scaled or by_value:
            with self._own_calls():
                grads = state.clipped_grads(parameters)
                if scaled:  # measure before clipping shrinks them: unscale_ sees the result
                    state.note_amax_of(grads)
                if by_value:  # the elements it will clamp, counted on the device
                    state.clipped_by_value(grads, limit)
        state.log_call("clip", site, f"{name}(..., {_number(limit)})")
        with self._own_calls():
            yield
        # the total norm: clip_grad_norm_ returns it, clip_grads_with_norm_ is given it
        norm = call.arguments.get("total_norm", call.result)
        if name != "clip_grad_value_" and isinstance(norm, torch.Tensor):
            state.clipped_norm(norm, scaled, limit)

    @contextmanager
    def on_zero_grad(self, call: Call) -> Iterator[None]:
        if self._manual_step_due():
            self._end_manual_step()  # before the gradients it read are zeroed
        self.state.zeroed(call.arguments["self"])
        with self._own_calls():
            yield

    @contextmanager
    def on_scheduler_step(self, call: Call) -> Iterator[None]:
        scheduler = call.arguments["self"]
        site = call_site()
        if self._scheduler_depth == 0 and not patches.scheduler_initial_step(scheduler):
            self.state.scheduler_step(scheduler, site)
        self._scheduler_depth += 1
        try:
            with _warnings_told_at(site):
                yield
        finally:
            self._scheduler_depth -= 1

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
        values = self.state.log.read()
        audit = self.capture.audit
        rows = audit.step_rows() if audit is not None else None
        return steps_table(self.state.steps, values, rows), values

    def skips_table(self, table: dict[str, list[Any]], values: np.ndarray) -> dict[str, list[Any]]:
        """The skips table: each skipped step and where its inf/NaN came from."""
        return skips_table(self.state.steps, table, values)

    def judge(self, table: dict[str, list[Any]], values: np.ndarray) -> list[Finding]:
        """The findings: calls on scaled gradients, scales, skips, schedulers, accumulation."""
        found = grad_call_findings(self.state.calls)
        found += scheduler_findings(table, self.state.scheduler_calls)
        found += mixed_scale_findings(self.state.spans(), values, self.update_site)
        if self.state.scaler_settings is not None:
            site = self.update_site or ("<script>", 0)
            options = self.options
            found += scale_findings(table, site, options.max_backoffs, options.max_skip_rate)
        unique = {(finding.code, finding.file, finding.line): finding for finding in found}
        return sorted_findings(list(unique.values()))


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
    exited: bool = False  # the script ended with a non-zero sys.exit (exit_status is its own)
    exit_message: str | None = None  # what Python prints for it: sys.exit("text") prints text


def run_script(
    script: str | os.PathLike[str],
    args: list[str] | tuple[str, ...] = (),
    options: RunOptions = RunOptions(),
    *,
    meta: RunMeta | None = None,
    on_captured: Callable[[Audit], None] | None = None,
) -> RunOutcome:
    """Run ``script`` with ``args`` as ``python script args`` would, under a monitor.

    Whatever way the script ends (finishes, reaches ``max_steps``, raises,
    exits, is interrupted) the steps done so far come back as a report.
    ``on_captured`` gets the audit after each captured step closed (a dashboard reads
    :meth:`Audit.last_step_view` there; which steps were skipped is known only once the
    run ends).
    """
    path = Path(script)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ModelFileError(f"training script {path} {what}")
    monitor = TrainingMonitor(options, on_captured)
    ending = _run_as_main(monitor, path, args)
    table, values = monitor.steps_table()
    findings = [
        dataclasses.replace(found, file=_as_given(found.file, path))
        for found in monitor.judge(table, values)
    ]
    report = _report_of(monitor, table)
    if monitor.state.scaler_settings is not None:
        from fpaudit.report.schema import SKIPS_SCHEMA, frame

        report.skips = frame(monitor.skips_table(table, values), SKIPS_SCHEMA)
    _record(report, monitor, path, args, ending.stopped_by, findings, table, meta)
    interrupted = ending.interrupted
    exit_status = interrupted.exit_code if interrupted is not None else ending.exit_status
    exited = ending.stopped_by == "script exit"
    return RunOutcome(
        report, findings, ending.failure, interrupted, exit_status, exited, ending.exit_message
    )


@dataclass(frozen=True)
class _Ending:
    """How the script ended, as :class:`RunOutcome` tells it; ``stopped_by``: what ended
    it early, in words (None: it finished)."""

    stopped_by: str | None = None
    failure: FpauditError | None = None
    interrupted: Interrupted | None = None
    exit_status: int = 0
    exit_message: str | None = None


def _run_as_main(monitor: TrainingMonitor, path: Path, args: Sequence[str]) -> _Ending:
    """Run the script as ``__main__`` under ``monitor``, with its ``sys.argv`` and its
    folder first on ``sys.path`` (both restored after), and say how it ended."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.resolve().parent))
    try:
        # os._exit(n) from the script ends it like sys.exit(n); a forked child's is real.
        with monitor.installed(), modelfile.exits_caught():
            _exec_as_main(_main_file(path))
    except StopRun:
        return _Ending("max-steps")
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
        # as Python ends for it: None is 0, an int its status, anything else is printed
        # and exits 1. A non-zero exit ends the run early (the report says so), not in error.
        code = done.code
        exit_status = 0 if code is None else int(code) if isinstance(code, int) else 1
        exit_message = None if code is None or isinstance(code, int) else str(code)
        stopped_by = "script exit" if exit_status else None
        return _Ending(stopped_by, exit_status=exit_status, exit_message=exit_message)
    except KeyboardInterrupt as error:  # SIGINT, or SIGTERM as the CLI raises it
        interrupted = error if isinstance(error, Interrupted) else Interrupted()
        return _Ending(interrupted.signal_name, interrupted=interrupted)
    except Exception as error:
        site = _as_given(modelfile.where(error, path), path)
        failure = ModelFileError(f"{site}: the script raised {modelfile.describe(error)}")
        return _Ending("script error", failure, exit_status=1)
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
    return _Ending()


def _exec_as_main(file: str) -> None:
    """Run ``file`` as ``python file`` runs a script: in a fresh ``__main__`` module (put
    back after), whose ``__file__`` (and code) is ``file``; ``sys.argv`` stays the
    caller's. (``runpy.run_path`` would set ``sys.argv[0]`` to ``file`` too, where
    Python keeps the path as typed.)"""
    with io.open_code(file) as handle:
        source = handle.read()
    code = compile(source, file, "exec", dont_inherit=True)  # not fpaudit's __future__
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=file, __cached__=None)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def _main_file(path: Path) -> str:
    """The script's ``__file__`` as ``python`` sets it: joined to the working directory,
    not resolved (``python ./a/../t.py`` gives ``/cwd/./a/../t.py``)."""
    return str(path) if path.is_absolute() else os.path.join(os.getcwd(), str(path))


def _as_given(site: str, path: Path) -> str:
    """``site`` (``file`` or ``file:line``) with the script's absolute ``__file__`` as the
    user named the script: messages and findings say ``train.py:12``, as typed."""
    absolute = _main_file(path)
    if site == absolute or site.startswith(absolute + ":"):
        return str(path) + site[len(absolute) :]
    return site


def _report_of(monitor: TrainingMonitor, table: dict[str, list[Any]]) -> Report:
    """The audit's report with the steps table, or a report of the steps alone when no
    model was audited."""
    if monitor.capture.audit is not None:
        return monitor.capture.audit.build_report(table)
    from fpaudit.report.store import Report, run_metadata

    return Report.from_builder(ReportBuilder(modules=[LOSS_MODULE]), run_metadata(), table)


def _record(
    report: Report,
    monitor: TrainingMonitor,
    path: Path,
    args: Sequence[str],
    stopped_by: str | None,
    findings: list[Finding],
    table: dict[str, list[Any]],
    meta: RunMeta | None,
) -> None:
    """Stamp the run on ``report``: how it ended, what the monitor saw (the scaler, the
    optimizers, the models, the findings, the skips), then the caller's meta."""
    from fpaudit.rules.analysis import held_dtype

    options = monitor.options
    amp_dtype = held_dtype(report)
    steps = (options.max_steps, len(monitor.state.steps))
    selection = options.selection.describe()
    # --max-steps ends a complete run; an error, an interruption or a non-zero exit does not
    complete = stopped_by in (None, "max-steps")
    run = RunInfo.ended(
        "run", stopped_by, steps, selection, amp_dtype, complete=complete, script=str(path)
    )
    run = dataclasses.replace(
        run,
        scaler=monitor.state.scaler_settings,
        findings=tuple(findings),
        training=skip_statistics(np.array(table["skipped"], dtype=bool)),
    )
    report.record_run(
        run,
        {
            "script_args": list(args),
            "capture_every": options.capture_every,
            "optimizers": monitor.state.optimizers,
            "schedulers": monitor.state.schedulers,
            "models": monitor.capture.models,
            "audited_model": type(monitor.capture.audited_model).__name__
            if monitor.capture.audited_model is not None
            else None,
        },
        meta,
    )
