"""Capture every backward op output, attributed to the module that owns it.

How attribution works, in plain words:

* In forward, hooks on every module note the thread's autograd *sequence
  number* each time a module starts or finishes (``clock.ModuleClock``). Autograd
  stamps every node it creates with the next sequence number, so the node
  created by an op inside ``encoder.layer.0.fc1`` carries a number that falls
  in a stretch of time when ``encoder.layer.0.fc1`` was the innermost module.
* In backward, a ``TorchDispatchMode`` sees every aten op. The engine tells us
  which node is executing (``current_autograd_node``); its sequence number
  looks the module up. ``AccumulateGrad`` nodes carry their parameter instead,
  which names its module.

This holds when the model's own forward computes the loss (Hugging Face style)
and when a module's inputs do not require grad, where backward module hooks
(``torch.utils.module_tracker``) see nothing. Nodes created outside every
module of the model (the loss, other top-level code) belong to the pseudo-module
``LOSS_MODULE``.

Whether a backward value scales with the loss (provenance) follows data, not
tensor objects (``provenance.Provenance``). Decided per op: its outputs are *fixed* (they
do not move with the loss scale) when none of its floating inputs carries
loss-scaled values; a tensor carries none when it requires grad (a saved forward
value, a parameter) or its *storage* is marked fixed. Integer and bool inputs
carry no scale. An in-place write with a scaled input unmarks the storage it
wrote, through whichever view it wrote: a ``zeros`` buffer filled through
``select``/``slice`` and ``copy_`` (``pack_padded_sequence``'s backward) is
scaled, and so is everything read from it. A forward tensor that does not
require grad (a batch, a mask) counts as scaled: the conservative side.

Only backward work is recorded as backward:

* Recomputation is forward work. The engine runs backward with grad mode off
  unless ``create_graph``; activation checkpointing turns it on to rebuild the
  graph. So an op that runs in backward with grad mode on is recomputation and
  is not recorded, whatever was checkpointed (a module, a method, a function,
  reentrant or not, Hugging Face's ``gradient_checkpointing_enable``). A
  reentrant checkpoint then runs a nested backward over the rebuilt graph; its
  ops outside every submodule belong to the module that called ``checkpoint``.
  With ``create_graph``, only a checkpointed module's recomputation is known
  (by its forward hooks).
* Hooks are not the model's gradient. An optimizer step (any
  ``torch.optim.Optimizer``, counted through torch's global step hooks), as in
  optimizer-in-backward, is not recorded, nor is a post-accumulate-grad hook's
  bookkeeping: under an ``AccumulateGrad`` node only work on the gradient is
  recorded (adding into ``.grad``, changing it in place, FSDP1's hook on its
  flat gradient). Other hooks' ops (a tensor hook that changes a gradient) are
  recorded under the node they run in.

Each captured tensor is handed to one recording function with
``(kind, module, node, op, output_index, scales_with_loss, tensor)``
(``recorder.Recorder.record``); its counts accumulate in a row of a
``kernels.histogram.HistogramTable`` on the tensor's device and nothing is retained.
``Audit.step`` brings a step's statistics to the host with one transfer.
Complex tensors are recorded as their real and imaginary parts
(``view_as_real``).

The parts, each a module of ``fpaudit.capture``: ``clock`` (the module clock and the
names reports give modules), ``mode`` (the dispatch mode), ``engine`` (the mode on only
while the engine runs), ``oprules`` (what an op is: new values or a view, what it wrote,
a GEMM's operands), ``provenance``, ``optimizer_hooks`` (optimizer steps in backward),
``selection``, ``recorder`` (the recording function and a step's histogram rows) and
``compiled_receiver`` (what a compiled backward stored). ``Audit`` opens and closes them
together and closes each step.

Known limitations:

* Attribution assumes forward runs on one thread (not ``nn.DataParallel``).
* ``torch.compile`` with ``backend="aot_eager"`` is captured and attributed like
  the eager model. With ``inductor``, a model compiled through ``fpaudit.compile``
  (or ``scan --compile``) has every buffer its compiled backward stores counted, in
  the dtype it stores, under the model's module names; values a fused kernel keeps in
  registers are never rounded and are not counted (``docs/compile.md``).
* ``torch.jit.script``ed models cannot be hooked; audit the eager module.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import torch
from torch import nn

from fpaudit import _signals
from fpaudit.capture import compiled
from fpaudit.capture.clock import ModuleClock
from fpaudit.capture.compiled_receiver import CompiledReceiver
from fpaudit.capture.context import CaptureContext
from fpaudit.capture.engine import activate_during_backward
from fpaudit.capture.mode import BackwardMode
from fpaudit.capture.optimizer_hooks import optimizer_steps_counted
from fpaudit.capture.origin_probe import OriginTracker
from fpaudit.capture.provenance import Provenance
from fpaudit.capture.recorder import MadeNonfinite, Recorder, registrations_watched
from fpaudit.capture.selection import Selection
from fpaudit.kernels.blockstats import BlockRecorder
from fpaudit.numerics.recipes import Recipe, as_recipe
from fpaudit.report.records import KIND_BACKWARD, KIND_GRAD, LOSS_MODULE, ReportBuilder

if TYPE_CHECKING:
    from fpaudit.report.store import Report
    from fpaudit.rules.metrics import StepView

__all__ = ["Audit", "Selection", "StepSummary", "audit"]

P = ParamSpec("P")
T = TypeVar("T")
_EVERY_RECORD = Selection()  # the default: capture everything


def _rank() -> int:
    """This process's torch.distributed rank (0 when not distributed)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@dataclass(frozen=True)
class StepSummary:
    """What a closed step looked like, for the caller's decisions (optimizer step, progress)."""

    step: int
    loss: float | None
    loss_finite: bool
    nonfinite_grads: int  # inf/NaN elements in parameter gradients
    records: int
    made_nonfinite: MadeNonfinite | None = None  # name_first_nonfinite: the op that did


class Audit:
    """Records backward-op outputs and parameter gradients of ``model``, step by step.

    Use it as a context manager::

        with fpaudit.audit(model) as audit:
            for batch in batches:
                loss = loss_fn(model, batch)
                loss.backward()
                audit.step(loss=loss)
        audit.report.write("report-dir")

    Hooks and the dispatch mode are removed on exit, also when the body raises.
    A step with records still open at exit is closed then.
    """

    backward_only = True
    """Activate the dispatch mode only while the autograd engine runs (see
    ``fpaudit.capture.engine``); False keeps it on for the whole context."""

    def __init__(
        self,
        model: nn.Module,
        *,
        loss_scale: float = 1.0,
        selection: Selection = _EVERY_RECORD,
        window: int = 1,
        shadow: bool = False,
        origins: bool = False,
        recipes: Sequence[Recipe | str] = (),
        module_hooks: bool = True,
        name_nonfinite: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"audit() needs an nn.Module, got {type(model).__name__}")
        if isinstance(model, torch.jit.ScriptModule):
            raise TypeError(
                "audit() cannot hook a torch.jit.ScriptModule's modules; "
                "audit the eager module (the one passed to torch.jit.script)"
            )
        self.model = model
        self.module_hooks = module_hooks  # False: the owner's global hooks feed the clock
        self.loss_scale = loss_scale
        # scan --origins: per op call, did it make inf/NaN (fpaudit.capture.origin_probe)
        self.origins: OriginTracker | None = OriginTracker() if origins else None
        self._context = CaptureContext(shadow, self.origins, name_first_nonfinite=name_nonfinite)
        self._mode: BackwardMode | None = None
        self._clock = ModuleClock(model)
        self._provenance = Provenance()
        chosen = tuple(dict.fromkeys(as_recipe(r) for r in recipes))
        blocks = BlockRecorder(chosen, window) if chosen else None  # opt-in: --recipe
        self._recorder = Recorder(selection, blocks)
        self.record = self._recorder.record
        """Add a tensor's values to the open step's record for its key (a caller's own
        values; see :meth:`~fpaudit.capture.recorder.Recorder.record`)."""
        self._builder = ReportBuilder(
            modules=[LOSS_MODULE, *dict.fromkeys(self._clock.names.values())],
            window=window,
            rank=_rank(),
        )
        self._stack: ExitStack | None = None
        self._step_started = time.perf_counter()
        self._metric_modules: dict[tuple[str, int], list[str]] = {}
        # torch.compile: observed compiled backward runs, ops fused away, what is not covered
        self._compiled = CompiledReceiver(model, self._clock, self._recorder)

    @property
    def selection(self) -> Selection:
        """Which records to capture (see :class:`Selection`)."""
        return self._recorder.selection

    @selection.setter
    def selection(self, selection: Selection) -> None:
        self._recorder.selection = selection

    # -- open / close ------------------------------------------------------
    @property
    def is_open(self) -> bool:
        """Hooks and the dispatch mode are installed (between :meth:`open` and :meth:`close`)."""
        return self._stack is not None

    def open(self) -> Audit:
        """Install the hooks and the dispatch mode: record from now on.

        Opening an audit that is already open is an error (its hooks would be
        installed twice); :meth:`close` first."""
        if self._stack is not None:
            raise RuntimeError("this audit is already open; close() it before opening it again")
        stack = ExitStack()
        try:
            self._clock.install(self.model, stack, on_modules=self.module_hooks)
            stack.enter_context(registrations_watched())
            mode = BackwardMode(
                self._context, self.model, self._clock, self._provenance, self._recorder
            )
            self._mode = mode
            stack.enter_context(optimizer_steps_counted(self._context))
            restore = activate_during_backward(mode, self._context) if self.backward_only else None
            if restore is not None:
                stack.callback(restore)
            else:
                stack.enter_context(mode)
            compiled.add_receiver(self._compiled)
            stack.callback(compiled.remove_receiver, self._compiled)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        self._step_started = time.perf_counter()
        return self

    def close(self, discard: bool = False) -> None:
        """Remove the hooks and the dispatch mode. A step with records still open is
        closed as a step, or with ``discard`` dropped (nothing of it is recorded).

        Closing an audit that is not open (never opened, or closed already) does
        nothing, so a ``finally`` may always close."""
        stack, self._stack = self._stack, None
        if stack is None:
            return
        stack.close()
        if not discard and self._recorder.has_open_records():
            self.step()
        self._recorder.discard()  # a discarded step's block statistics go with it
        self._clock.forget()

    # -- context manager -------------------------------------------------
    def __enter__(self) -> Audit:
        return self.open()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close(discard=exc_type is not None)

    @contextmanager
    def forward_pass(self) -> Iterator[None]:
        """Also record forward op outputs (kind ``forward``) inside this block.

        Forward values are reported apart from backward ones, and the op that
        first produced an inf or NaN is named in the step (``first_nonfinite``).
        """
        if self._mode is None:
            raise RuntimeError("forward_pass() needs the audit to be active (inside `with audit`)")
        self._recorder.forward_active = True
        try:
            with self._mode if self.backward_only else nullcontext():
                yield
        finally:
            self._recorder.forward_active = False

    @property
    def module_names(self) -> list[str]:
        """The model's module names as reports name them ("" is the model itself)."""
        return list(dict.fromkeys(self._clock.names.values()))

    def seen_ops(self, kind: str = KIND_BACKWARD) -> set[str]:
        """The ops seen so far (recorded or left out by the selection)."""
        return self._recorder.seen_ops(kind)

    def note_not_covered(self, line: str) -> None:
        """Note what this audit cannot observe (a compiled backward without the observer)."""
        self._compiled.note_not_covered(line)

    def entered_by(self, module: nn.Module) -> None:
        """Note that ``module`` of the model is already running forward.

        For an audit entered from inside a forward pre-hook: the module's own
        hooks were installed too late for this call.
        """
        self._clock.enter(self._clock.names.get(id(module), ""))

    @property
    def clock(self) -> ModuleClock:
        """The module clock (``module_hooks=False``: the owner's hooks call its ``module_*``)."""
        return self._clock

    def step(
        self,
        loss: torch.Tensor | None = None,
        *,
        index: int | None = None,
        loss_scale: float | torch.Tensor | None = None,
    ) -> StepSummary:
        """Close the current step: record parameter gradients, then gather its statistics.

        ``loss`` (optional) is stored with the step. A non-finite loss marks the
        step as a forward problem and its backward records are dropped, so they
        never count as backward overflow. ``index`` is the training step's number
        (default: the next after the last closed one), for runs that capture only
        some steps. ``loss_scale`` is the scale this step ran under (default: the
        audit's); a 0-dim tensor, such as a ``GradScaler``'s, is read in the same
        transfer. This is the one host sync per step.
        """
        if loss is not None and (not isinstance(loss, torch.Tensor) or loss.numel() != 1):
            raise ValueError("step(loss=...) needs a tensor with exactly one element")
        self._recorder.record_parameter_gradients(self.model)
        scale_tensor = loss_scale if isinstance(loss_scale, torch.Tensor) else None
        # without a window nothing reads a record's bin counts past what the kernel reads
        collected = self._recorder.collect(loss, scale_tensor, keep_rows=self._builder.window > 1)
        records, loss_value, scale_value = collected.records, collected.loss, collected.loss_scale
        if scale_value is None:
            scale_value = self.loss_scale if loss_scale is None else float(loss_scale)
        self._provenance.clear()
        try:
            with _signals.deferred():  # a step is recorded whole or not at all
                self._builder.add_step(
                    records,
                    loss=loss_value,
                    loss_scale=scale_value,
                    seconds=time.perf_counter() - self._step_started,
                    index=index,
                    first_nonfinite=collected.first_nonfinite,
                )
                blocks = self._recorder.blocks
                if blocks is not None:  # dropped with the records when the loss is not finite
                    finite = loss_value is None or math.isfinite(loss_value)
                    blocks.close_step(self._builder.last_index, self._builder.rank, finite)
            nonfinite_grads = records.nonfinite(KIND_GRAD)
        finally:
            self._recorder.release()  # the records may be the table's rows: read by now
        if self.origins is not None:
            self.origins.collect(self._builder.last_index, scale_value)
        self._clock.forget()
        if self._mode is not None:
            self._mode.forget_node()
        self._step_started = time.perf_counter()
        return StepSummary(
            step=self._builder.last_index,
            loss=loss_value,
            loss_finite=loss_value is None or math.isfinite(loss_value),
            nonfinite_grads=nonfinite_grads,
            records=len(records.keys),
            made_nonfinite=collected.made_nonfinite,
        )

    def mark_optimizer_step(self, stepped: bool, skipped: bool = False) -> None:
        """Note whether an optimizer step followed the last closed step, or was skipped
        for inf/NaN gradients."""
        with _signals.deferred():
            self._builder.mark_optimizer_step(stepped, skipped)

    @property
    def steps(self) -> int:
        return self._builder.steps

    @property
    def report(self) -> Report:
        """Everything recorded so far, as a :class:`~fpaudit.report.store.Report`."""
        return self.build_report()

    def metrics(self, fmt: str | None = "fp16", *, top: int = 8) -> dict[str, float]:
        """The dashboard metrics of the last closed step (names and meanings:
        :data:`fpaudit.rules.metrics.METRICS`), for users who log them themselves;
        empty before a step is closed. ``fmt`` None: the format of the dtype the step held
        its backward values in (bf16 under bf16 autocast), else fp16. It reads that step's
        records alone (its cost does not grow with the run; with ``window`` > 1, the
        window's so far); the per-module series are the ``top`` modules the first call
        found losing the most, kept for the run so their names stay (modules with values
        only in later steps join them while fewer than ``top`` have a series)."""
        view = self.last_step_view(fmt, top=top)
        return {} if view is None else dict(view.metrics.values)

    def last_step_view(self, fmt: str | None = "fp16", *, top: int = 8) -> StepView | None:
        """:meth:`metrics` with what a dashboard draws from: the last closed step's records
        alone as a report, and the modules with a series of their own (for
        :func:`fpaudit.rules.metrics.bin_series`); None before a step is closed."""
        from fpaudit.report.store import Report
        from fpaudit.rules.metrics import step_view

        last = self._builder.last_step()
        if last is None:
            return None
        step = Report.from_builder(last)
        return step_view(step, fmt, top, self._metric_modules, self._builder.skipped_steps)

    def step_rows(self) -> dict[str, list[Any]]:
        """The steps table of the captured steps so far, column by column."""
        return self._builder.step_rows()

    def build_report(self, steps: dict[str, Any] | None = None) -> Report:
        """The report; ``steps`` replaces its steps table (see ``Report.from_builder``)."""
        # pandas and pyarrow: only once a report is built
        from fpaudit.report.store import Report, run_metadata

        report = Report.from_builder(self._builder, run_metadata(self.model), steps)
        report.update_info(out_of_range=self._recorder.out_of_range())
        compiled_info = self._compiled.info_for(report.records)
        if compiled_info is not None:
            report.update_info(compiled=compiled_info)
        if self.origins is not None:
            from fpaudit.rules.origins import table_from_columns

            report.origins = table_from_columns(self.origins.columns())
        blocks = self._recorder.blocks
        if blocks is not None:
            from fpaudit.report.schema import BLOCKS_SCHEMA, frame

            report.blocks = frame(blocks.columns(), BLOCKS_SCHEMA)
            report.update_info(recipes=tuple(r.name for r in blocks.recipes))
        return report


def _constructor(cls: Callable[P, T], name: str, doc: str) -> Callable[P, T]:
    """A function ``name`` that calls ``cls`` with the same parameters, declared once
    (by ``cls``): type checkers and ``inspect.signature`` (so ``help``) read them there."""

    def make(*args: P.args, **kwargs: P.kwargs) -> T:
        return cls(*args, **kwargs)

    make.__name__ = make.__qualname__ = name
    make.__doc__ = doc
    make.__module__ = cls.__module__
    returns = getattr(cls, "__name__", inspect.Signature.empty)
    make.__dict__["__signature__"] = inspect.signature(cls).replace(return_annotation=returns)
    return make


audit = _constructor(
    Audit,
    "audit",
    """Audit the backward pass of ``model``: see :class:`Audit`.

    ``selection`` limits what is recorded; ``window`` merges the records of that
    many consecutive captured steps (exactly) to keep long runs' reports small;
    ``shadow`` re-runs every low-precision backward op in fp32 to count the
    values it lost (see :class:`~fpaudit.capture.mode.BackwardMode`); ``origins`` notes,
    per op call in ``forward_pass`` and backward, whether it made inf/NaN
    (``fpaudit.capture.origin_probe``);
    ``recipes`` (names or :class:`~fpaudit.numerics.recipes.Recipe`) adds exact block-scaled
    statistics of every recorded tensor under each (see :mod:`fpaudit.kernels.blockstats`).
    """,
)
