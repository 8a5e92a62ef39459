"""The dispatch mode (:class:`BackwardMode`): sees every aten op while the autograd
engine runs, and hands each backward op's outputs to the recorder under the module that
made the node (``fpaudit.capture.clock``), with whether they scale with the loss
(``fpaudit.capture.provenance``). It runs once per backward op: what it does per op is
kept to attribute and dictionary lookups until an op is one to record."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fpaudit import torch_internals as _internals
from fpaudit.capture import compiled
from fpaudit.capture.clock import ModuleClock, model_name, wrapped_paths
from fpaudit.capture.oprules import (
    ACCUMULATE_GRAD,
    DATA_MOVEMENT,
    as_contracted,
    constant_op,
    creates_new_values,
    float_tensors,
    gemm_operands,
    inputs_clean,
    works_on_grad,
    written,
)
from fpaudit.capture.provenance import UNSCALABLE as _UNSCALABLE
from fpaudit.capture.provenance import Provenance
from fpaudit.capture.recorder import Place, Recorder
from fpaudit.errors import MonitorFailure
from fpaudit.numerics.formats import FORMATS
from fpaudit.report.records import KIND_BACKWARD, KIND_FORWARD, LOSS_MODULE
from fpaudit.torch_internals import OpOverload, TorchDispatchMode

if TYPE_CHECKING:
    from fpaudit.capture.context import CaptureContext

_aten = torch.ops.aten
current_autograd_node = _internals.current_autograd_node
is_grad_enabled = torch.is_grad_enabled
_COMPILED_NODE = compiled.COMPILED_NODE


def weight_modules(model: nn.Module) -> frozenset[str]:
    """Names (as reported) of the modules that own a floating weight of two or more
    dimensions themselves: where a backward matrix multiply is a Linear's (``nn.Linear``,
    Hugging Face's ``Conv1D``), not attention's or a loss's."""
    names = set()
    wrapped = wrapped_paths(model)
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dim() >= 2:
                names.add(model_name(name, wrapped))
                break
    return frozenset(names)


# The dtypes --shadow re-runs in fp32: every registered format's (a format added to
# numerics/formats.py is shadowed too)
_LOW_PRECISION = frozenset(fmt.dtype for fmt in FORMATS.values())
_CASTS = frozenset({_aten._to_copy.default, _aten.copy_.default})


def _upcast(value: Any) -> Any:
    """``value`` with low-precision tensors (and dtype arguments) turned into fp32."""
    if isinstance(value, torch.Tensor):
        return value.to(torch.float32) if value.dtype in _LOW_PRECISION else value
    if isinstance(value, torch.dtype):
        return torch.float32 if value in _LOW_PRECISION else value
    if isinstance(value, list | tuple):
        return type(value)(_upcast(v) for v in value)
    if isinstance(value, dict):
        return {k: _upcast(v) for k, v in value.items()}
    return value


def _inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The op's input tensors as ``origin_probe.tensors_in`` finds them (tensors, and
    tensors in a list argument when there are no keyword arguments), built as one list:
    the walk for calls whose schema does not say where their tensors are (``_Op.at``)."""
    if kwargs:
        found = [a for a in args if isinstance(a, torch.Tensor)]
        found += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
        return found
    found = []
    for a in args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, list | tuple):
            found += [t for t in a if isinstance(t, torch.Tensor)]
    return found


_Tensor = torch.Tensor
_STRIDED = torch.strided


class _Op:
    """What the mode decides once per op overload (``OpOverload``), not per call."""

    __slots__ = ("alias", "at", "call", "func", "grad_work", "lists", "movement", "mutable",
                 "name", "needs", "never_new", "one", "pick", "view")  # fmt: skip

    def __init__(self, func: OpOverload, name: str) -> None:
        self.func = func  # kept alive: the mode's table is keyed by its id
        self.call = _internals.op_caller(func)  # func itself, without a Python frame
        self.name = name
        self.mutable = _internals.is_mutable(func)
        self.view = bool(func.is_view)
        # ``creates_new_values``: always False for views, uninitialised buffers and
        # collectives, always True for other ops but data movement, which depends on the
        # call's dtypes (asked per call)
        self.movement = func in DATA_MOVEMENT
        self.never_new = not self.movement and not creates_new_values(func, (), None)
        # ``works_on_grad``'s first test: under an AccumulateGrad node, a view or a move
        # of the gradient is always the node's own work
        self.grad_work = self.view or self.movement
        # where a call without keyword arguments has its input tensors (the schema's
        # Tensor and Tensor[] positions; None: walk the arguments, ``_inputs``), and
        # ``one``: the op's one input position is the first (most backward views)
        positions = _internals.tensor_argument_positions(func)
        self.at: tuple[int, ...] | None = None if positions is None else positions[0]
        self.lists: tuple[int, ...] = () if positions is None else positions[1]
        self.one = positions is not None and positions == ((0,), ())
        # several Tensor positions, no list: picked at C speed from a call that has them all
        several = positions is not None and not self.lists and len(self.at or ()) > 1
        self.pick = operator.itemgetter(*self.at) if several and self.at else None
        self.needs = self.at[-1] + 1 if self.at else 0
        # a view of its one input (``t``, ``detach``, ``view``): its outputs alias that
        # input's storage, so they are fixed exactly when the input is, and when that is by
        # a marked storage, theirs already is
        self.alias = self.view and not self.mutable and self.one

    def inputs(self, args: tuple[Any, ...]) -> list[torch.Tensor]:
        """The call's input tensors (no keyword arguments): what ``_inputs`` finds, read
        at the schema's positions. A Tensor position may hold a Python number."""
        at = self.at
        if at is None:
            return _inputs(args, {})
        n = len(args)
        found = [x for i in at if i < n and isinstance(x := args[i], _Tensor)]
        for i in self.lists:
            if i < n and isinstance(values := args[i], list | tuple):
                found += [t for t in values if isinstance(t, _Tensor)]
        return found


def _float_outputs(output: Any) -> list[tuple[int, torch.Tensor]]:
    """``float_tensors(output)`` as a list, a single tensor output without the walk."""
    if type(output) is torch.Tensor:
        if output.layout == torch.strided and not output.is_meta and output.is_floating_point():
            return [(0, output)]
        if not output.is_complex():
            return []
    return list(float_tensors(output))


class BackwardMode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves the mode untyped
    """Sees every aten op; hands backward (and, in a forward pass, forward) outputs on."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # By default torch wraps __torch_dispatch__ in torch._dynamo.disable, whose
        # first call imports dynamo and sympy: +77 MB of RSS and a wrapper on every
        # op. Dynamo never traces the mode (it is entered around the engine only), so opt out.
        return False

    def __init__(
        self,
        context: CaptureContext,
        model: nn.Module,
        clock: ModuleClock,
        provenance: Provenance,
        recorder: Recorder,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves TorchDispatchMode untyped
        self._context = context  # the audit's shared state (shadow, recompute, optimizer steps)
        self._clock, self._provenance, self._recorder = clock, provenance, recorder
        self._record = recorder.record
        self._op_names: dict[OpOverload, str] = {}
        self._ops: dict[int, _Op] = {}
        self._unshadowable: set[OpOverload] = set()
        self._origins = context.origins  # scan --origins: None unless asked for
        self._owners: list[str] = []  # of the nested (reentrant checkpoint) backward passes
        self._last_node: tuple[torch.autograd.graph.Node | None, str] = (None, LOSS_MODULE)
        self._last_name: tuple[torch.autograd.graph.Node | None, str] = (None, "")
        self._forward = clock.forward_frames  # this thread's modules in forward (in_forward)
        # --recipe: the modules whose backward GEMMs' operands get block statistics
        self._gemm_modules = weight_modules(model) if recorder.blocks is not None else None
        self._mark_made = context.name_first_nonfinite  # fpaudit run: a skip's op
        self._lean = self._origins is None and self._gemm_modules is None and not self._mark_made

    def enter_nested(self, node: torch.autograd.graph.Node | None) -> None:
        """A backward inside backward: reentrant checkpointing runs the graph it rebuilt
        from the node it replaces. That graph's ops outside every submodule (a checkpointed
        method's own ops) belong to the module that called ``checkpoint``."""
        owner = self._node_module(node) if node is not None else LOSS_MODULE
        self._owners.append(owner)
        self.forget_node()

    def exit_nested(self) -> None:
        if self._owners:
            self._owners.pop()
        self.forget_node()

    def forget_node(self) -> None:
        """Drop the last node's module (``_node_module``), and the node with it: at the
        end of a backward pass, and where the modules of nodes may change."""
        self._last_node = (None, LOSS_MODULE)
        self._last_name = (None, "")

    def _node_module(self, node: torch.autograd.graph.Node) -> str:
        """The module ``node`` is attributed to (the clock's, or, outside every submodule
        in a nested backward, its owner's), looked up once for the node's ops in a row (a
        node runs several: a Linear's backward two matrix multiplies and a sum). Holding
        the node keeps its Python object, so the engine hands back the same one next op."""
        last = self._last_node  # one tuple: read whole, whichever thread wrote it
        if last[0] is node:
            return last[1]
        module = self._clock.module_of(node)
        if module == LOSS_MODULE and self._owners:
            module = self._owners[-1]
        self._last_node = (node, module)
        return module

    def _op_name(self, func: OpOverload) -> str:
        op = self._op_names.get(func)
        if op is None:
            op = self._op_names[func] = str(func)
        return op

    def _new_op(self, func: OpOverload) -> _Op:
        """What the mode decides about ``func`` once (``_Op``), kept by its id."""
        try:
            info = self._ops[id(func)] = _Op(func, self._op_name(func))
        except Exception as error:  # fpaudit's: the op has not run
            raise MonitorFailure(f"capturing {func}", error) from error
        return info

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        info = self._ops.get(id(func))  # OpOverload hashes in Python: id is cheaper
        if info is None:
            info = self._new_op(func)
        if kwargs is None:
            kwargs = {}
        if info.alias:
            output = info.call(*args, **kwargs)
            if (
                args
                and isinstance(first := args[0], _Tensor)
                and not (first.requires_grad or first.dtype in _UNSCALABLE)
            ):
                # A view of a value that is fixed, if at all, by its marked storage, which
                # the view shares: nothing to mark, record or note, wherever it runs.
                return output
            try:
                self._observe(info, args, kwargs, output, None)
            except Exception as error:
                raise MonitorFailure(f"capturing {func}", error) from error
            return output
        before = None
        if self._origins is not None and not info.view:
            try:  # inputs are read before the op runs: an in-place op overwrites them
                before = self._origins.before(args, kwargs)
            except Exception as error:
                raise MonitorFailure(f"capturing {func}", error) from error
        output = info.call(*args, **kwargs)  # the op itself: its errors are the script's
        try:
            self._observe(info, args, kwargs, output, before)
        except Exception as error:  # fpaudit's recording: never the script's error
            raise MonitorFailure(f"capturing {func}", error) from error
        return output

    def _observe(
        self,
        info: _Op,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
        before: Any,
    ) -> None:
        """Record what ``info.func`` made (``output``), if it is forward or backward work.

        This runs for every op the engine runs (but the views ``__torch_dispatch__``
        stops), a single tensor output recorded from this frame: what is the same for
        every call of an op overload is decided once (``_Op``), and an op whose outputs
        cannot be recorded (views, detach, moves) stops at its provenance."""
        node = current_autograd_node()
        if node is None:
            if self._recorder.forward_active:
                self._observe_forward(info.func, args, output, before)
            return
        if self._forward.frames or (self._context.grad_mode_means_recompute and is_grad_enabled()):
            # Forward work in backward: activation checkpointing recomputing a module, a
            # method or a function (the engine runs backward with grad mode off unless
            # create_graph; checkpointing turns it on to rebuild the graph).
            return
        # node.name(), asked once for the node's ops in a row (as _node_module): one
        # tuple, read and written whole, whichever thread wrote it
        last = self._last_name
        if last[0] is node:
            node_name = last[1]
        else:
            node_name = node.name()
            self._last_name = (node, node_name)
        if node_name == _COMPILED_NODE and compiled.inside_observed_backward():
            return  # its stored values come from its outputs (compiled_receiver)
        if self._context.optimizer_steps or (
            node_name == ACCUMULATE_GRAD
            and not info.grad_work
            and not works_on_grad(info.func, args, kwargs, output, node)
        ):
            return  # a hook's work (an optimizer step, an EMA): not the model's gradient
        if info.alias:
            # a view of its one input, which is fixed without a marked storage (it requires
            # grad, an index; ``__torch_dispatch__`` took the others): the view shares the
            # storage, now marked
            self._provenance.mark_output(output)
            return
        # whether the outputs are fixed (``Provenance``): their storages marked so, or
        # what a mutable op with a scaled input wrote unmarked
        provenance = self._provenance
        if kwargs:
            fixed = provenance.all_fixed(_inputs(args, kwargs))
        elif info.one:  # one input, first: no list to build
            fixed = not args or not isinstance(args[0], _Tensor) or provenance.is_fixed(args[0])
        elif info.pick is not None and len(args) >= info.needs:
            fixed = provenance.all_fixed(info.pick(args))
        else:
            fixed = provenance.all_fixed(info.inputs(args))
        if fixed:
            provenance.mark_output(output)
        elif info.mutable and provenance.has_fixed():
            # e.g. buffer[i].copy_(scaled value): the whole storage now carries the scale
            provenance.unmark(written(info.func, args, kwargs, output))
        if info.never_new or (info.movement and not creates_new_values(info.func, args, output)):
            return
        if type(output) is _Tensor and self._lean:  # one output, no --origins nor --recipe
            if output.layout is _STRIDED and not output.is_meta and output.is_floating_point():
                last = self._last_node
                module = last[1] if last[0] is node else self._node_module(node)
                place = self._record(KIND_BACKWARD, module, node_name, info.name, 0, not fixed,
                                     output)  # fmt: skip
                if self._context.shadow and output.dtype in _LOW_PRECISION:
                    self._compare_with_fp32(info.func, args, kwargs, [(place, output)])
                return
            if not output.is_complex():
                return  # nothing that can be recorded (indices, masks, counts)
        self._record_outputs(info, node, node_name, fixed, (args, kwargs, output, before))

    def _record_outputs(
        self,
        info: _Op,
        node: torch.autograd.graph.Node,
        node_name: str,
        fixed: bool,
        call: tuple[tuple[Any, ...], dict[str, Any], Any, Any],
    ) -> None:
        """Record a backward op's floating outputs (and ``--origins``, ``--recipe``,
        ``--shadow``'s views of it); ``call`` is its (args, kwargs, output, inputs before)."""
        args, kwargs, output, before = call
        outputs = _float_outputs(output)
        if outputs:
            module = self._node_module(node)
            record = self._record
            scaled = not fixed
            places = [
                (record(KIND_BACKWARD, module, node_name, info.name, index, scaled, tensor), tensor)
                for index, tensor in outputs
            ]
            _mark_made_nonfinite(self._mark_made, self._recorder, args, places)
        elif self._origins is None and self._gemm_modules is None:
            return  # nothing that can be recorded (indices, masks, counts)
        else:
            module, places = self._node_module(node), []
        func = info.func
        if self._origins is not None or self._gemm_modules is not None:
            self._observe_extras(func, args, node_name, info.name, module, outputs, fixed, before)
        if places and self._context.shadow and any(t.dtype in _LOW_PRECISION for _, t in places):
            self._compare_with_fp32(func, args, kwargs, places)

    def _observe_forward(
        self, func: OpOverload, args: tuple[Any, ...], output: Any, before: Any
    ) -> None:
        self._record_forward(func, args, output)
        origins = self._origins
        if origins is not None and creates_new_values(func, args, output):
            origins.after(before, KIND_FORWARD, self._clock.current_module(), "",
                          self._op_name(func), list(float_tensors(output)),
                          False)  # fmt: skip

    def _observe_extras(
        self,
        func: OpOverload,
        args: tuple[Any, ...],
        node_name: str,
        op: str,
        module: str,
        outputs: list[tuple[int, torch.Tensor]],
        fixed: bool,
        before: Any,
    ) -> None:
        """``scan --origins`` and ``--recipe``'s GEMM operands, for a backward op."""
        if self._origins is not None:
            self._origins.after(before, KIND_BACKWARD, module, node_name, op, outputs,
                                not fixed)  # fmt: skip
        if self._gemm_modules is not None and module in self._gemm_modules:
            operands = gemm_operands(func, args)
            for index, operand in enumerate(operands):
                scaled = not self._provenance.is_fixed(operand)
                contracted = as_contracted(operand, index)
                self._recorder.record_operand(module, node_name, op, index, scaled, contracted)

    def _record_forward(self, func: OpOverload, args: tuple[Any, ...], output: Any) -> None:
        if not creates_new_values(func, args, output):
            return
        op = self._op_name(func)
        module = self._clock.current_module()
        sequence = self._recorder.next_forward_op()
        outputs = list(float_tensors(output))
        # the first op to *make* inf/NaN (fpaudit.rules.origins' rule): not a constant op writing
        # them by design, nor an op reading inf/NaN or a finfo(float32) mask sentinel
        computes = not constant_op(op)
        for index, tensor in outputs:
            place = self._record(KIND_FORWARD, module, "", op, index, False, tensor)
            if place is not None and computes:
                clean = inputs_clean(args, [t for _, t in outputs], tensor.device)
                place[0].mark_nonfinite(place[1], tensor, sequence, clean)

    def _compare_with_fp32(
        self,
        func: OpOverload,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        places: list[tuple[Place | None, torch.Tensor]],
    ) -> None:
        """Re-run a low-precision op on its inputs upcast to fp32; count lost values."""
        if func in _CASTS:  # a cast to low precision: the fp32 value is its own input
            source = args[1] if func is _aten.copy_.default else args[0]
            shadows: list[torch.Tensor] = [source.to(torch.float32)]
        elif func in self._unshadowable or _internals.is_mutable(func):
            return
        else:
            try:
                shadows = [t for _, t in float_tensors(func(*_upcast(args), **_upcast(kwargs)))]
            except Exception:  # some ops insist on their dtypes: no shadow for them
                self._unshadowable.add(func)
                return
        for (place, real), shadow in zip(places, shadows, strict=False):
            if place is not None and real.dtype in _LOW_PRECISION and shadow.shape == real.shape:
                place[0].add_shadow(place[1], real, shadow)


def _mark_made_nonfinite(
    wanted: bool,
    recorder: Recorder,
    args: tuple[Any, ...],
    places: list[tuple[Place | None, torch.Tensor]],
) -> None:
    """Where ``wanted`` (fpaudit run: the op a skip came from), mark the outputs of a
    backward op that made inf/NaN from finite inputs, in the same op numbering as
    forward's: the step's first such op, either pass, is named."""
    if not wanted:
        return
    sequence = recorder.next_forward_op()
    made = [tensor for _, tensor in places]
    for place, tensor in places:
        if place is not None:
            clean = inputs_clean(args, made, tensor.device)
            place[0].mark_nonfinite(place[1], tensor, sequence, clean)
