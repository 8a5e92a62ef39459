"""Capture every backward op output, attributed to the module that owns it.

How attribution works, in plain words:

* In forward, hooks on every module note the thread's autograd *sequence
  number* each time a module starts or finishes (``_ModuleClock``). Autograd
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
tensor objects (``_Provenance``). Decided per op: its outputs are *fixed* (they
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
``(kind, module, node, op, output_index, tensor)``; statistics accumulate in
``histogram.Histogram`` on the tensor's device and nothing is retained.
``Audit.step`` brings a step's statistics to the host with one transfer.
Complex tensors are recorded as their real and imaginary parts
(``view_as_real``).

Known limitations:

* Attribution assumes forward runs on one thread (not ``nn.DataParallel``).
* ``torch.compile`` with ``backend="aot_eager"`` is captured and attributed like
  the eager model; ``inductor`` runs fused kernels outside aten, so only the ops
  it leaves to aten are seen: audit the eager model.
* ``torch.jit.script``ed models cannot be hooked; audit the eager module.
"""

from __future__ import annotations

import bisect
import difflib
import fnmatch
import functools
import inspect
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import numpy as np
import torch
from torch import nn

from fpaudit import _signals
from fpaudit import torch_internals as _internals
from fpaudit import torch_internals_compile as _compile_internals
from fpaudit.capture import compiled
from fpaudit.capture._torch_patches import guarded
from fpaudit.capture.origin_probe import OriginTracker
from fpaudit.capture.origin_probe import tensors_in as _tensors
from fpaudit.errors import MonitorFailure, Named, OptionError, UsageError
from fpaudit.kernels import histogram
from fpaudit.kernels.blockstats import BlockRecorder
from fpaudit.numerics.formats import FP32
from fpaudit.numerics.recipes import Recipe, as_recipe
from fpaudit.report.records import (
    KIND_BACKWARD,
    KIND_FORWARD,
    KIND_GRAD,
    KIND_OPERAND,
    LOSS_MODULE,
    RecordKey,
    ReportBuilder,
    StepRecords,
)
from fpaudit.rules.origins import is_constant_op
from fpaudit.torch_internals import OpOverload, TorchDispatchMode

if TYPE_CHECKING:
    from fpaudit.report.store import Report

_ACCUMULATE_GRAD_SEQUENCE = 2**64 - 1  # AccumulateGrad nodes have no sequence number

_aten = torch.ops.aten
P = ParamSpec("P")
T = TypeVar("T")
# Ops that only copy, move or zero-pad values: their outputs hold no value
# that is not already in an input (when the dtype is kept). ``SplitBackward0``,
# for one, concatenates gradients that were recorded when they were made.
_DATA_MOVEMENT = frozenset(
    {
        _aten.clone.default,
        _aten._unsafe_view.default,
        _aten.copy_.default,
        _aten._to_copy.default,
        _aten.lift_fresh_copy.default,
        _aten.cat.default,
        _aten.stack.default,
        _aten.slice_backward.default,
        _aten.select_backward.default,
        _aten.diagonal_backward.default,
        _aten.constant_pad_nd.default,
        _aten.repeat.default,
        _aten.flip.default,
        _aten.roll.default,
    }
)


# Ops whose outputs are not values of the computation: uninitialised buffers, and
# the collectives and copies of distributed wrappers (DDP's all-reduce of a gradient
# bucket, FSDP's all-gather of parameters for backward). Each rank records its own
# gradient values where they are computed; these would count them again, or count
# parameters and garbage as backward values.
_UNINITIALISED = frozenset(
    {
        _aten.empty.memory_format,
        _aten.empty_strided.default,
        _aten.empty_like.default,
        _aten.new_empty.default,
        _aten.new_empty_strided.default,
    }
)
_NOT_VALUES = frozenset({"c10d", "_c10d_functional", "fsdp", "_dtensor"})
# Matrix multiplies and where their two operands are in the arguments: the GEMMs whose
# operands a block-scaled recipe quantizes (Transformer Engine, torchao's MX/float8
# Linear). ``aten.linear`` reaches backward as these.
_GEMM_OPERANDS = {
    _aten.mm.default: (0, 1),
    _aten.addmm.default: (1, 2),
    _aten.bmm.default: (0, 1),
    _aten.baddbmm.default: (1, 2),
}


def gemm_operands(func: OpOverload, args: tuple[Any, ...]) -> list[torch.Tensor]:
    """The two operands of a matrix multiply (in the arguments), or [] for another op."""
    positions = _GEMM_OPERANDS.get(func)
    if positions is None:
        return []
    left, right = args[positions[0]], args[positions[1]]
    if not (isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor)):
        return []
    return [left, right]


def as_contracted(operand: torch.Tensor, index: int) -> torch.Tensor:
    """A GEMM operand with its contraction dimension last (the one a 1 x 32 block runs
    along, as frameworks quantize it): the left operand as it is, the right transposed."""
    return operand if index == 0 else operand.transpose(-1, -2)


def weight_modules(model: nn.Module) -> frozenset[str]:
    """Names (as reported) of the modules that own a floating weight of two or more
    dimensions themselves: where a backward matrix multiply is a Linear's (``nn.Linear``,
    Hugging Face's ``Conv1D``), not attention's or a loss's."""
    names = set()
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dim() >= 2:
                names.add(model_name(name))
                break
    return frozenset(names)


_TRACING_TENSORS = frozenset({"FakeTensor", "FunctionalTensor"})


def _tracing(args: tuple[Any, ...]) -> bool:
    """Whether an engine run is ``torch.compile`` (AOTAutograd) tracing a backward graph:
    its tensors are fake or functional, and no value is computed. (Other subclasses, a
    DTensor, run a real backward.)"""
    outputs = args[0] if args else ()
    tensors = outputs if isinstance(outputs, list | tuple) else (outputs,)
    return any(
        isinstance(t, torch.Tensor) and type(t).__name__ in _TRACING_TENSORS for t in tensors
    )


def _activate_during_backward(mode: _BackwardMode) -> Callable[[], None] | None:
    """Make ``mode`` active only while the autograd engine runs; return the undo.

    ``torch.autograd.backward`` and ``torch.autograd.grad`` both enter the
    engine through one private entry (``torch_internals.wrap_engine_entry``).
    Wrapping it keeps forward free of dispatch overhead. Returns None when this
    torch has no such entry point; the caller then keeps the mode on throughout.

    The wrapper has the original's signature, finds ``create_graph`` by binding the
    call to the engine's parameters, calls the original with the very arguments it
    was given and returns its value; fpaudit's own errors around the call become
    ``MonitorFailure``.
    """
    entry = _internals.ENGINE_ENTRY
    depth = threading.local()

    def make(original: Callable[..., Any], signature: inspect.Signature) -> Callable[..., Any]:
        def run_backward(*args: Any, **kwargs: Any) -> Any:
            if _tracing(args):  # torch.compile tracing the joint graph: not a backward that runs
                return original(*args, **kwargs)
            if getattr(depth, "n", 0):  # nested backward (reentrant checkpoint): already on
                try:
                    mode.enter_nested(current_autograd_node())
                except Exception as error:
                    raise MonitorFailure(f"entering a nested {entry}", error) from error
                try:
                    return original(*args, **kwargs)
                finally:
                    mode.exit_nested()
            try:
                create_graph = _internals.create_graph(signature, args, kwargs)
            except Exception as error:
                raise MonitorFailure(f"before {entry}()", error) from error
            depth.n = 1
            mode.grad_mode_means_recompute = not create_graph
            mode.optimizer_steps = 0  # a step that raised never ran its post hook
            try:
                with mode:
                    return original(*args, **kwargs)
            finally:
                depth.n = 0
                mode.grad_mode_means_recompute = False

        return run_backward

    return _internals.wrap_engine_entry(make)


_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"


def _accumulates(
    func: OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
    node: Any,
) -> bool:
    """Whether an op run by an ``AccumulateGrad`` node works on its parameter's ``.grad``:
    adds into it (the node's own work) or changes it in place (a hook averaging it),
    rather than being a post-accumulate-grad hook's bookkeeping (an optimizer's or an
    average's state). FSDP1's hook on its flat parameter is gradient work: the padded,
    divided gradient it reduce-scatters is recorded."""
    if func.is_view or func in _DATA_MOVEMENT:
        return True  # the first gradient, kept as is: nothing new to record anyway
    variable = getattr(node, "variable", None)
    if _internals.is_flat_param(variable):
        return True  # FSDP1's post-backward hook: padding and dividing the flat gradient
    grad = getattr(variable, "grad", None)
    if grad is None:
        return False
    target = _storage(grad)
    if _internals.is_mutable(func):
        return any(_storage(t) is target for t in _written(func, args, kwargs, output))
    return func is _aten.add.Tensor and any(
        isinstance(a, torch.Tensor) and _storage(a) is target for a in args
    )


current_autograd_node = _internals.current_autograd_node
autograd_sequence_number = _internals.autograd_sequence_number


def _float_tensors(output: Any) -> Iterator[tuple[int, torch.Tensor]]:
    """The floating-point tensors among an op's outputs, by position. A complex tensor
    is given as its real and imaginary parts (``view_as_real``): two values of its
    component dtype per element, which is what a cast to a low-precision format keeps."""
    for index, tensor in enumerate(_tensors(output)):
        if tensor.layout != torch.strided or tensor.is_meta:
            continue
        if tensor.is_floating_point():
            yield index, tensor
        elif tensor.is_complex():
            yield index, torch.view_as_real(tensor.resolve_conj())


_IS_VIEW: dict[OpOverload, bool] = {}
_WRITTEN: dict[OpOverload, tuple[tuple[int, str], ...]] = {}


def _written(
    func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> Iterator[torch.Tensor]:
    """The tensors a mutable op wrote: its outputs, and arguments its schema marks as
    written (``_foreach_*_`` ops return nothing)."""
    yield from _tensors(output)
    positions = _WRITTEN.get(func)
    if positions is None:
        positions = _WRITTEN[func] = _internals.written_arguments(func)
    for index, name in positions:
        value = args[index] if index < len(args) else kwargs.get(name)
        yield from _tensors(value)


@functools.cache
def _constant_op(op: str) -> bool:
    return is_constant_op(op)


def _inputs_clean(
    args: tuple[Any, ...], outputs: list[torch.Tensor], device: torch.device
) -> torch.Tensor | None:
    """On ``device``, without a sync: does every floating input on it (an in-place op's
    target aside: it already holds the output) lie strictly inside float32's finite range?
    False for inf, NaN and ``torch.finfo(float32)`` mask sentinels; None: no such input."""
    clean: torch.Tensor | None = None
    for t in _tensors(args):
        if (
            not t.is_floating_point()
            or t.device != device
            or not t.numel()
            or t.layout != torch.strided
            or any(t is out for out in outputs)
        ):
            continue
        values = t.detach() if t.element_size() > 1 else t.detach().float()  # fp8: exact
        low, high = torch.aminmax(values)  # NaN makes both NaN: not inside
        inside = (high < FP32.max_finite) & (low > -FP32.max_finite)
        clean = inside if clean is None else clean & inside
    return clean


def creates_new_values(func: OpOverload, args: tuple[Any, ...], output: Any) -> bool:
    """False for ops that only re-present values: views, detach, same-dtype copies and moves."""
    is_view = _IS_VIEW.get(func)
    if is_view is None:
        is_view = _IS_VIEW[func] = (
            bool(func.is_view) or func in _UNINITIALISED or func.namespace in _NOT_VALUES
        )
    if is_view:
        return False
    if func in _DATA_MOVEMENT:
        source = args[1] if func is _aten.copy_.default else next(_tensors(args), None)
        target = output if isinstance(output, torch.Tensor) else None
        return not (source is not None and target is not None and source.dtype == target.dtype)
    return True


# Dtypes whose values cannot carry a loss scale (indices, masks, counters).
_UNSCALABLE = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
)


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage behind ``tensor`` and all its views, or None for storage-less tensors."""
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class _Provenance:
    """Which backward values do not scale with the loss ("fixed" values).

    Loss scaling multiplies the gradient flowing backward, not the forward
    values that backward formulas read from saved tensors. ``pow``'s backward,
    for one, computes ``2 * x`` from the saved input before multiplying by the
    incoming gradient; that intermediate stays put whatever the scale.

    The rule follows data, not tensor objects. Saved forward values and
    parameters reach backward with ``requires_grad=True``; everything backward
    creates has ``requires_grad=False`` (unless ``create_graph``). A floating
    tensor is fixed when it requires grad or its *storage* is marked fixed; an
    op's outputs are fixed when none of its floating inputs is scaled (integer
    and bool inputs, indices and masks, carry no scale), and their storages are
    then marked. An op that writes in place with a scaled input (``add_``,
    ``copy_``, ``index_put_``, through any view) unmarks the storage it wrote,
    so a zero buffer filled through ``select``/``slice`` views with gradients
    (``pack_padded_sequence``'s backward) is scaled, and so is everything read
    from it. Fixed storages are rare and remembered here by weak reference
    (Python keeps one object per storage, shared by all its views).
    """

    def __init__(self) -> None:
        self._fixed: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def _forget(self, key: int, ref: weakref.ref[torch.UntypedStorage]) -> None:
        if self._fixed.get(key) is ref:  # not a newer storage that reused the id
            del self._fixed[key]

    def is_fixed(self, tensor: torch.Tensor) -> bool:
        if tensor.requires_grad or tensor.dtype in _UNSCALABLE:
            return True
        if not self._fixed:
            return False
        storage = _storage(tensor)
        ref = self._fixed.get(id(storage))
        return ref is not None and ref() is storage

    def all_fixed(self, tensors: Iterator[torch.Tensor]) -> bool:
        if not self._fixed:  # the common case: no storage lookups
            return all(t.requires_grad or t.dtype in _UNSCALABLE for t in tensors)
        return all(self.is_fixed(t) for t in tensors)

    def mark(self, tensors: Iterator[torch.Tensor]) -> None:
        for tensor in tensors:
            storage = _storage(tensor)
            key = id(storage)
            if storage is not None and key not in self._fixed:
                self._fixed[key] = weakref.ref(storage, functools.partial(self._forget, key))

    def has_fixed(self) -> bool:
        return bool(self._fixed)

    def unmark(self, tensors: Iterator[torch.Tensor]) -> None:
        for tensor in tensors:
            self._fixed.pop(id(_storage(tensor)), None)

    def clear(self) -> None:
        self._fixed.clear()


# Modules that wrappers insert between a model's modules: FSDP1's
# FullyShardedDataParallel and activation checkpointing's CheckpointWrapper hold the
# wrapped module under these names. Reports name modules as the model itself does.
# torch.compile's OptimizedModule holds the eager module as ``_orig_mod``.
_WRAPPER_NAMES = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def model_name(qualified: str) -> str:
    """``qualified`` (as in ``named_modules()``) without wrapper segments:
    ``_fsdp_wrapped_module.blocks.0._checkpoint_wrapped_module.attn`` is ``blocks.0.attn``.
    A wrapper and the module it wraps share the name."""
    if "_wrapped_module" not in qualified and "_orig_mod" not in qualified:
        return qualified
    return ".".join(part for part in qualified.split(".") if part not in _WRAPPER_NAMES)


def _known_module(name: str, known: frozenset[str]) -> str:
    """``name``, or its nearest enclosing module the model has (a path Dynamo wrote that
    the model does not name, such as a function's local module, goes to its parent)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def _untraced(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` (fpaudit's), run as it is, never traced, where ``torch.compile`` traces
    a module it is on. Dynamo cannot trace the clock's read of the autograd sequence
    number: it would warn on the script's stderr and break the graph there anyway, so
    the compiled graphs (and the values they compute) are the same either way.

    ``torch.compiler.disable`` imports Dynamo (and sympy: ~150 MB), so a hook is only
    wrapped once something has loaded Dynamo (``torch.compile`` does, before any
    compiled module runs); without Dynamo nothing traces it."""
    if not _internals.dynamo_loaded():
        return hook
    disabled: Callable[..., Any] = torch.compiler.disable(hook)  # type: ignore[no-untyped-call]
    return disabled


def _compiled_modules(model: nn.Module) -> set[int]:
    """The ids of modules ``torch.compile``d with Inductor in ``model`` and of every module
    inside them. (Other backends keep their hooks: each a graph break, and the aten ops
    of ``aot_eager``'s backward attributed as in eager.)"""
    found: set[int] = set()
    for module in model.modules():
        parts = _compile_internals.compiled_module_parts(module)
        if id(module) not in found and parts is not None and parts[0] in compiled.INDUCTORS:
            found.update(id(m) for m in module.modules())
    return found


class _ModuleClock:
    """Remembers, by autograd sequence number, which module was innermost in forward."""

    def __init__(self, model: nn.Module) -> None:
        self.names: dict[int, str] = {}  # as reported (model_name)
        self._qualified: dict[int, str] = {}  # as in named_modules()
        self.param_owner: dict[int, tuple[str, str]] = {}
        for name, module in model.named_modules():
            self._qualified.setdefault(id(module), name)
            self.names.setdefault(id(module), model_name(name))
            for param_name, param in module.named_parameters(recurse=False):
                self.param_owner.setdefault(id(param), (model_name(name), param_name))
            if type(module).__name__ == "FullyShardedDataParallel":
                # FSDP1 with use_orig_params registers the original parameters only; its
                # flat parameter (whose gradient FSDP divides and reduces) is the unit's.
                flat = _internals.fsdp_flat_param(module)
                if flat is not None:
                    self.param_owner.setdefault(id(flat), (model_name(name), "_flat_param"))
        self.known_names = frozenset(self.names.values())
        self._stack = threading.local()
        self._starts: list[int] = []
        self._modules: list[str] = []
        self._cache: dict[int, str] = {}
        self._lock = threading.Lock()

    def _frames(self) -> list[str]:
        frames = getattr(self._stack, "frames", None)
        if frames is None:
            frames = self._stack.frames = []
        return frames

    def current_module(self) -> str:
        """The innermost module running forward on this thread, or the loss pseudo-module."""
        frames = getattr(self._stack, "frames", None)
        return frames[-1] if frames else LOSS_MODULE

    def in_forward(self) -> bool:
        """True while a module of the model runs forward on this thread (also recomputation)."""
        return bool(getattr(self._stack, "frames", None))

    def _mark(self, module_name: str) -> None:
        with self._lock:
            self._starts.append(autograd_sequence_number())
            self._modules.append(module_name)

    def enter(self, name: str) -> None:
        frames = self._frames()
        frames.append(name)
        self._mark(name)

    def exit(self) -> None:
        frames = self._frames()
        if frames:
            frames.pop()
        self._mark(frames[-1] if frames else LOSS_MODULE)

    def install(self, model: nn.Module, stack: ExitStack) -> None:
        compiled = _compiled_modules(model)
        for name, module in model.named_modules():
            if self._qualified.get(id(module)) != name:
                continue  # a shared module keeps its first name
            if id(module) in compiled:
                # Inside torch.compile: a hook would break the graph and recompile it at
                # every open; the compiled backward is attributed by its graph instead.
                continue
            reported = self.names[id(module)]
            enter = guarded("module clock", lambda _m, _a, n=reported: self.enter(n))
            stack.enter_context(module.register_forward_pre_hook(_untraced(enter)))
            exit_ = guarded("module clock", lambda _m, _a, _o: self.exit())
            stack.enter_context(module.register_forward_hook(_untraced(exit_), always_call=True))

    def module_of(self, node: torch.autograd.graph.Node) -> str:
        sequence = _internals.node_sequence_number(node)
        if sequence == _ACCUMULATE_GRAD_SEQUENCE:
            variable = getattr(node, "variable", None)
            owner = self.param_owner.get(id(variable)) if variable is not None else None
            return owner[0] if owner is not None else LOSS_MODULE
        cached = self._cache.get(sequence)
        if cached is not None:
            return cached
        position = bisect.bisect_right(self._starts, sequence) - 1
        name = self._modules[position] if position >= 0 else LOSS_MODULE
        self._cache[sequence] = name
        return name

    def forget(self) -> None:
        """Drop what forward remembered (called when a step closes)."""
        with self._lock:
            self._starts.clear()
            self._modules.clear()
            self._cache.clear()


_LOW_PRECISION = frozenset({torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2})
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


Place = tuple[histogram.HistogramTable, int]
Recorder = Callable[[str, str, str, str, int, bool, torch.Tensor], "Place | None"]


class _BackwardMode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves the mode untyped
    """Sees every aten op; hands backward (and, in a forward pass, forward) outputs on."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # By default torch wraps __torch_dispatch__ in torch._dynamo.disable, whose
        # first call imports dynamo and sympy: +77 MB of RSS and a wrapper on every
        # op. Dynamo never traces the mode (it is entered around the engine only), so opt out.
        return False

    def __init__(self, audit: Audit) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves TorchDispatchMode untyped
        self._audit = audit
        self._clock = audit._clock
        self._provenance = audit._provenance
        self._record: Recorder = audit.record
        self._op_names: dict[OpOverload, str] = {}
        self._unshadowable: set[OpOverload] = set()
        self._origins = audit.origins  # scan --origins: None unless asked for
        self.grad_mode_means_recompute = False
        self.optimizer_steps = 0  # optimizer steps running now (optimizer in backward)
        self._owners: list[str] = []  # of the nested (reentrant checkpoint) backward passes
        # --recipe: the modules whose backward GEMMs' operands get block statistics
        self._gemm_modules = weight_modules(audit.model) if audit._blocks is not None else None

    def enter_nested(self, node: torch.autograd.graph.Node | None) -> None:
        """A backward inside backward: reentrant checkpointing runs the graph it rebuilt
        from the node it replaces. That graph's ops outside every submodule (a checkpointed
        method's own ops) belong to the module that called ``checkpoint``."""
        owner = self._module_of(node) if node is not None else LOSS_MODULE
        self._owners.append(owner)

    def exit_nested(self) -> None:
        if self._owners:
            self._owners.pop()

    def _module_of(self, node: torch.autograd.graph.Node) -> str:
        module = self._clock.module_of(node)
        if module == LOSS_MODULE and self._owners:
            return self._owners[-1]
        return module

    def _op_name(self, func: OpOverload) -> str:
        op = self._op_names.get(func)
        if op is None:
            op = self._op_names[func] = str(func)
        return op

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        origins = self._origins
        try:
            # inputs are read before the op runs: an in-place op overwrites them
            before = (
                origins.before(args, kwargs) if origins is not None and not func.is_view else None
            )
        except Exception as error:
            raise MonitorFailure(f"capturing {func}", error) from error
        output = func(*args, **kwargs)  # the op itself: its errors are the script's
        try:
            self._observe(func, args, kwargs, output, before)
        except Exception as error:  # fpaudit's recording: never the script's error
            raise MonitorFailure(f"capturing {func}", error) from error
        return output

    def _observe(
        self,
        func: OpOverload,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
        before: Any,
    ) -> None:
        """Record what ``func`` made (``output``), if it is forward or backward work."""
        origins = self._origins
        node = current_autograd_node()
        if node is None:
            if self._audit._forward_active:
                self._record_forward(func, args, output)
                if origins is not None and creates_new_values(func, args, output):
                    origins.after(before, KIND_FORWARD, self._clock.current_module(), "",
                                  self._op_name(func), list(_float_tensors(output)),
                                  False)  # fmt: skip
            return
        if self._clock.in_forward() or (self.grad_mode_means_recompute and torch.is_grad_enabled()):
            # Forward work in backward: activation checkpointing recomputing a module, a
            # method or a function (the engine runs backward with grad mode off unless
            # create_graph; checkpointing turns it on to rebuild the graph).
            return
        node_name = node.name()
        if node_name == compiled.COMPILED_NODE and compiled.inside_observed_backward():
            return  # its stored values come from its outputs (Audit.record_compiled)
        if self.optimizer_steps or (
            node_name == _ACCUMULATE_GRAD and not _accumulates(func, args, kwargs, output, node)
        ):
            return  # a hook's work (an optimizer step, an EMA): not the model's gradient
        inputs = _tensors((args, tuple(kwargs.values()))) if kwargs else _tensors(args)
        fixed = self._provenance.all_fixed(inputs)
        if fixed:
            self._provenance.mark(_tensors(output))
        elif self._provenance.has_fixed() and _internals.is_mutable(func):
            # e.g. buffer[i].copy_(scaled value): the whole storage now carries the scale
            self._provenance.unmark(_written(func, args, kwargs, output))
        if not creates_new_values(func, args, output):
            return
        op = self._op_name(func)
        module = self._module_of(node)
        places = [
            (self._record(KIND_BACKWARD, module, node_name, op, index, not fixed, tensor), tensor)
            for index, tensor in _float_tensors(output)
        ]
        if origins is not None:
            origins.after(before, KIND_BACKWARD, module, node_name, op,
                          list(_float_tensors(output)), not fixed)  # fmt: skip
        if self._gemm_modules is not None and module in self._gemm_modules:
            operands = gemm_operands(func, args)
            for index, operand in enumerate(operands):
                scaled = not self._provenance.is_fixed(operand)
                contracted = as_contracted(operand, index)
                self._audit.record_operand(module, node_name, op, index, scaled, contracted)
        if self._audit.shadow and any(t.dtype in _LOW_PRECISION for _, t in places):
            self._compare_with_fp32(func, args, kwargs, places)

    def _record_forward(self, func: OpOverload, args: tuple[Any, ...], output: Any) -> None:
        if not creates_new_values(func, args, output):
            return
        op = self._op_name(func)
        module = self._clock.current_module()
        sequence = self._audit._next_forward_op()
        outputs = list(_float_tensors(output))
        # the first op to *make* inf/NaN (fpaudit.rules.origins' rule): not a constant op writing
        # them by design, nor an op reading inf/NaN or a finfo(float32) mask sentinel
        computes = not _constant_op(op)
        for index, tensor in outputs:
            place = self._record(KIND_FORWARD, module, "", op, index, False, tensor)
            if place is not None and computes:
                clean = _inputs_clean(args, [t for _, t in outputs], tensor.device)
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
                shadows = [t for _, t in _float_tensors(func(*_upcast(args), **_upcast(kwargs)))]
            except Exception:  # some ops insist on their dtypes: no shadow for them
                self._unshadowable.add(func)
                return
        for (place, real), shadow in zip(places, shadows, strict=False):
            if place is not None and real.dtype in _LOW_PRECISION and shadow.shape == real.shape:
                place[0].add_shadow(place[1], real, shadow)


@dataclass(frozen=True)
class Selection:
    """Which records to capture: shell-style globs on module and op names.

    ``modules`` and ``ops`` list what to keep (empty: everything); the
    ``exclude_`` lists win over them. Module patterns match qualified names
    (``blocks.*.attn``; ``blocks.0*`` for a subtree, ``<loss>`` for the loss
    pseudo-module); op patterns match aten op names as reported
    (``aten.mm.*``, ``*softmax*``) and do not apply to parameter gradients.
    Skipped records cost no histogram work.
    """

    modules: tuple[str, ...] = ()
    exclude_modules: tuple[str, ...] = ()
    ops: tuple[str, ...] = ()
    exclude_ops: tuple[str, ...] = ()

    @staticmethod
    def _matches(name: str, patterns: tuple[str, ...]) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)

    def accepts(self, kind: str, module: str, op: str) -> bool:
        if self.modules and not self._matches(module, self.modules):
            return False
        if self._matches(module, self.exclude_modules):
            return False
        if kind == KIND_GRAD:
            return True
        if self.ops and not self._matches(op, self.ops):
            return False
        return not self._matches(op, self.exclude_ops)

    def describe(self) -> dict[str, list[str]]:
        return {k: list(v) for k, v in self.__dict__.items() if v}

    def check_modules(self, names: Iterable[str]) -> None:
        """Raise ``UsageError`` naming a module glob that matches none of ``names`` (the
        model's modules; ``<loss>`` is always one), with the closest names, or when the
        globs together keep no module at all."""
        known = list(dict.fromkeys([LOSS_MODULE, *names]))
        for field in ("modules", "exclude_modules"):
            for pattern in getattr(self, field):
                if not any(fnmatch.fnmatchcase(name, pattern) for name in known):
                    raise _no_match(field, pattern, known, "module")
        if not any(self.accepts(KIND_GRAD, name, "") for name in known):
            raise UsageError(
                "the selection ",
                *self._globs("modules", "exclude_modules"),
                " leaves no module of the model to measure",
            )

    def check_ops(self, ops: Iterable[str]) -> None:
        """Raise ``UsageError`` naming an op glob that matches none of ``ops`` (the aten
        ops that ran in backward), with the closest names, or when the globs keep none."""
        seen = sorted(set(ops))
        if not seen:
            return  # nothing ran in backward: the report says it measured nothing
        for field in ("ops", "exclude_ops"):
            for pattern in getattr(self, field):
                if not any(fnmatch.fnmatchcase(op, pattern) for op in seen):
                    raise _no_match(field, pattern, seen, "backward op")
        kept = [
            op
            for op in seen
            if (not self.ops or self._matches(op, self.ops))
            and not self._matches(op, self.exclude_ops)
        ]
        if (self.ops or self.exclude_ops) and not kept:
            raise UsageError(
                "the selection ",
                *self._globs("ops", "exclude_ops"),
                " leaves no backward op of the model to measure",
            )

    def _globs(self, *fields: str) -> list[str | Named]:
        """The globs of ``fields`` as a message names them, one parameter after another
        (``modules=('a',) exclude_modules=('*',)``; ``--module a --exclude-module '*'``)."""
        parts: list[str | Named] = [
            part
            for field in fields
            if getattr(self, field)
            for part in (" ", Named(field, getattr(self, field)))
        ]
        return parts[1:]


def _no_match(field: str, pattern: str, names: list[str], what: str) -> OptionError:
    shown = [n if n else "(root)" for n in names]
    close = difflib.get_close_matches(pattern, shown, n=3, cutoff=0.5)
    if close:
        hint = f"closest: {', '.join(close)}"
    else:
        listed = ", ".join(shown[:8]) + (", ..." if len(shown) > 8 else "")
        hint = f"{what}s are: {listed}"
    return OptionError(field, f"{pattern!r} matches no {what} of the model ({hint})")


# The modes of open audits, told of every optimizer step (see _optimizer_steps_counted).
_COUNTING_MODES: list[_BackwardMode] = []
_step_hooks: list[Any] = []


def _optimizer_step_started(*_: Any) -> None:
    for mode in _COUNTING_MODES:
        mode.optimizer_steps += 1


def _optimizer_step_finished(*_: Any) -> None:
    for mode in _COUNTING_MODES:
        mode.optimizer_steps = max(mode.optimizer_steps - 1, 0)


@contextmanager
def _optimizer_steps_counted(mode: _BackwardMode) -> Iterator[None]:
    """Count running optimizer steps (any optimizer, through torch's global step hooks),
    so that an optimizer stepping inside backward is not recorded as backward values.

    The two global hooks are registered once per process and stay (doing nothing while
    no audit is open): an audit may open or close inside another optimizer step hook
    (``fpaudit run`` closes its step there), and registering or removing a hook while
    torch iterates over them raises "OrderedDict mutated during iteration".
    """
    if not _step_hooks:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        _step_hooks.append(register_optimizer_step_pre_hook(_optimizer_step_started))
        _step_hooks.append(register_optimizer_step_post_hook(_optimizer_step_finished))
    _COUNTING_MODES.append(mode)
    try:
        yield
    finally:
        _COUNTING_MODES.remove(mode)


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


class Audit:
    """Records backward-op outputs and parameter gradients of ``model``, step by step.

    Use it as a context manager::

        with fpaudit.audit(model) as audit:
            for batch in batches:
                loss_fn(model, batch).backward()
                audit.step(loss=loss)
        audit.report.write("report-dir")

    Hooks and the dispatch mode are removed on exit, also when the body raises.
    A step with records still open at exit is closed then.
    """

    backward_only = True
    """Activate the dispatch mode only while the autograd engine runs (see
    ``_activate_during_backward``); False keeps it on for the whole context."""

    def __init__(
        self,
        model: nn.Module,
        *,
        loss_scale: float = 1.0,
        selection: Selection = Selection(),
        window: int = 1,
        shadow: bool = False,
        origins: bool = False,
        recipes: Sequence[Recipe | str] = (),
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"audit() needs an nn.Module, got {type(model).__name__}")
        if isinstance(model, torch.jit.ScriptModule):
            raise TypeError(
                "audit() cannot hook a torch.jit.ScriptModule's modules; "
                "audit the eager module (the one passed to torch.jit.script)"
            )
        self.model = model
        self.loss_scale = loss_scale
        self.selection = selection
        self.shadow = shadow
        # scan --origins: per op call, did it make inf/NaN (fpaudit.capture.origin_probe)
        self.origins: OriginTracker | None = OriginTracker() if origins else None
        self._accepted: dict[tuple[str, str, str], bool] = {}
        self._forward_active = False
        self._forward_ops = 0
        self._mode: _BackwardMode | None = None
        self._clock = _ModuleClock(model)
        self._provenance = _Provenance()
        self._tables: dict[torch.device, histogram.HistogramTable] = {}
        self._rows: dict[RecordKey, tuple[histogram.HistogramTable, int]] = {}
        self._row_keys: dict[torch.device, list[RecordKey]] = {}
        self._builder = ReportBuilder(
            modules=[LOSS_MODULE, *dict.fromkeys(self._clock.names.values())],
            window=window,
            rank=_rank(),
        )
        self._stack: ExitStack | None = None
        self._step_started = time.perf_counter()
        self._lock = threading.Lock()
        chosen = tuple(dict.fromkeys(as_recipe(r) for r in recipes))
        self._blocks = BlockRecorder(chosen, window) if chosen else None  # opt-in: --recipe
        # torch.compile: observed compiled backward runs, ops fused away, what is not covered
        self._compiled_runs = 0
        self._fused_away: dict[str, set[str]] = {}
        self._not_covered: list[str] = compiled.not_covered_modules(model)
        # Inductor compiles part of the model: backward values hide in fused kernels, so a
        # step without an observed compiled backward measured nothing of them
        self._inductor = bool(_compiled_modules(model))

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
            self._clock.install(self.model, stack)
            mode = self._mode = _BackwardMode(self)
            stack.enter_context(_optimizer_steps_counted(mode))
            restore = _activate_during_backward(mode) if self.backward_only else None
            if restore is not None:
                stack.callback(restore)
            else:
                stack.enter_context(mode)
            compiled.add_receiver(self)
            stack.callback(compiled.remove_receiver, self)
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
        if not discard and self._has_open_records():
            self.step()
        for table in self._tables.values():
            table.reset()
        if self._blocks is not None:  # a discarded step's block statistics go with it
            self._blocks.discard_open()
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
        self._forward_active = True
        try:
            with self._mode if self.backward_only else nullcontext():
                yield
        finally:
            self._forward_active = False

    @property
    def module_names(self) -> list[str]:
        """The model's module names as reports name them ("" is the model itself)."""
        return list(dict.fromkeys(self._clock.names.values()))

    def seen_ops(self, kind: str = KIND_BACKWARD) -> set[str]:
        """The ops seen so far (recorded or left out by the selection)."""
        return {op for (k, _, op) in self._accepted if k == kind}

    def _next_forward_op(self) -> int:
        self._forward_ops += 1
        return self._forward_ops

    def _has_open_records(self) -> bool:
        return any(any(table.calls) for table in self._tables.values())

    # -- recording -------------------------------------------------------
    def record(
        self,
        kind: str,
        module: str,
        node: str,
        op: str,
        output: int,
        scales_with_loss: bool,
        tensor: torch.Tensor,
    ) -> Place | None:
        """Add ``tensor``'s values to the open step's record for this key; its place."""
        accepted = self._accepted.get((kind, module, op))
        if accepted is None:
            accepted = self._accepted[(kind, module, op)] = self.selection.accepts(kind, module, op)
        if not accepted:
            return None
        if type(tensor) is not torch.Tensor and hasattr(tensor, "to_local"):
            tensor = tensor.to_local()  # a DTensor (FSDP2, tensor parallel): this rank's shard
        dtype = str(tensor.dtype).removeprefix("torch.")
        key = RecordKey(kind, module, node, op, output, dtype, scales_with_loss)
        place = self._rows.get(key)
        if place is None:
            with self._lock:
                table = self._tables.get(tensor.device)
                if table is None:
                    table = self._tables[tensor.device] = histogram.HistogramTable(tensor.device)
                    self._row_keys[tensor.device] = []
                place = self._rows[key] = (table, table.new_row())
                self._row_keys[tensor.device].append(key)
        place[0].add(place[1], tensor)
        if self._blocks is not None:
            self._blocks.add(key, tensor)
        return place

    def record_operand(
        self,
        module: str,
        node: str,
        op: str,
        index: int,
        scales_with_loss: bool,
        tensor: torch.Tensor,
    ) -> None:
        """Add a backward GEMM's operand to the block statistics only (``KIND_OPERAND``:
        no histogram record; its values are an output recorded where it was made)."""
        if self._blocks is None or not tensor.is_floating_point():
            return
        if not self.selection.accepts(KIND_BACKWARD, module, op):
            return
        if type(tensor) is not torch.Tensor and hasattr(tensor, "to_local"):
            tensor = tensor.to_local()
        dtype = str(tensor.dtype).removeprefix("torch.")
        key = RecordKey(KIND_OPERAND, module, node, op, index, dtype, scales_with_loss)
        self._blocks.add(key, tensor)

    def record_compiled(self, graph: compiled.CompiledGraph, values: Sequence[Any]) -> None:
        """Record the values a compiled backward stored (``fpaudit.capture.compiled``), under the
        model's module names; a graph compiled from another model is not this audit's."""
        prefix = ""
        if graph.root is not None:
            root = graph.root()
            name = self._clock.names.get(id(root)) if root is not None else None
            if name is None:
                return
            prefix = name
        known = self._clock.known_names
        with self._lock:
            self._compiled_runs += 1
        for site, value in zip(graph.sites, values, strict=False):
            if not isinstance(value, torch.Tensor):
                continue
            path = ".".join(p for p in (prefix, model_name(site.module)) if p)
            module = _known_module(path, known)
            self.record(KIND_BACKWARD, module, compiled.COMPILED_NODE, site.op, 0,
                        site.scales_with_loss, value)  # fmt: skip
        for module_path, ops in graph.fused_away.items():
            path = ".".join(p for p in (prefix, model_name(module_path)) if p)
            module = _known_module(path, known)
            self._fused_away.setdefault(module, set()).update(ops)

    def note_not_covered(self, line: str) -> None:
        """Note what this audit cannot observe (a compiled backward without the observer)."""
        if line not in self._not_covered:
            self._not_covered.append(line)

    def _record_parameter_gradients(self) -> None:
        for name, param in self.model.named_parameters():
            grad = param.grad
            if grad is None or grad.layout != torch.strided:
                continue
            if grad.is_complex():
                grad = torch.view_as_real(grad.resolve_conj())
            elif not grad.is_floating_point():
                continue
            module, _, param_name = name.rpartition(".")
            self.record(KIND_GRAD, model_name(module), "AccumulateGrad", param_name, 0, True, grad)

    def entered_by(self, module: nn.Module) -> None:
        """Note that ``module`` of the model is already running forward.

        For an audit entered from inside a forward pre-hook: the module's own
        hooks were installed too late for this call.
        """
        self._clock.enter(self._clock.names.get(id(module), ""))

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
        self._record_parameter_gradients()
        keys: list[RecordKey] = []
        blocks: list[np.ndarray] = []
        calls: list[int] = []
        loss_value: float | None = None
        scale_value: float | None = None
        scale_tensor = loss_scale if isinstance(loss_scale, torch.Tensor) else None
        for device, table in self._tables.items():
            carries_loss = loss is not None and loss.device == device
            carries_scale = scale_tensor is not None and scale_tensor.device == device
            scalars = ((loss,) if carries_loss and loss is not None else ()) + (
                (scale_tensor,) if carries_scale and scale_tensor is not None else ()
            )
            rows, values = table.collect(scalars)
            if carries_loss:
                loss_value = values[0]
            if carries_scale:
                scale_value = values[-1]
            used = [row for row in range(table.rows) if table.calls[row]]
            keys += [self._row_keys[device][row] for row in used]
            blocks.append(rows[used])
            calls += [table.calls[row] for row in used]
            table.reset()
        if loss is not None and loss_value is None:  # no records on the loss's device
            loss_value = float(loss.detach().reshape(()))
        if scale_tensor is not None and scale_value is None:
            scale_value = float(scale_tensor.detach().reshape(()))
        if scale_value is None:
            scale_value = self.loss_scale if loss_scale is None else float(loss_scale)
        rows = np.concatenate(blocks) if blocks else np.zeros((0, histogram.WIDTH), np.int64)
        records = StepRecords(
            keys=keys,
            counts=rows[:, : histogram.N_BINS],
            amax=histogram.amax_from_bits(rows[:, histogram.AMAX_COLUMN]),
            calls=np.array(calls, dtype=np.int64),
            shadow=rows[:, histogram.SHADOW_COLUMNS].copy(),
        )
        first_nonfinite = ""
        scores = rows[:, histogram.FIRST_NONFINITE_COLUMN] if len(rows) else np.zeros(0)
        if len(scores) and scores.max() > 0:
            first = keys[int(np.argmax(scores))]
            first_nonfinite = f"{first.module or '(root)'} {first.op}"
        self._forward_ops = 0
        self._provenance.clear()
        with _signals.deferred():  # a step is recorded whole or not at all
            self._builder.add_step(
                records,
                loss=loss_value,
                loss_scale=scale_value,
                seconds=time.perf_counter() - self._step_started,
                index=index,
                first_nonfinite=first_nonfinite,
            )
            if self._blocks is not None:  # dropped with the records when the loss is not finite
                finite = loss_value is None or math.isfinite(loss_value)
                self._blocks.close_step(self._builder.last_index, self._builder.rank, finite)
        if self.origins is not None:
            self.origins.collect(self._builder.last_index, scale_value)
        self._clock.forget()
        self._step_started = time.perf_counter()
        return StepSummary(
            step=self._builder.last_index,
            loss=loss_value,
            loss_finite=loss_value is None or math.isfinite(loss_value),
            nonfinite_grads=records.nonfinite(KIND_GRAD),
            records=len(keys),
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

    def step_rows(self) -> dict[str, list[Any]]:
        """The steps table of the captured steps so far, column by column."""
        return self._builder.step_rows()

    def build_report(self, steps: dict[str, Any] | None = None) -> Report:
        """The report; ``steps`` replaces its steps table (see ``Report.from_builder``)."""
        # pandas and pyarrow: only once a report is built
        from fpaudit.report.store import Report, run_metadata

        report = Report.from_builder(self._builder, run_metadata(self.model), steps)
        # fp64 values beyond fp32's range, binned as zero or inf (see fpaudit.kernels.histogram)
        report.update_info(out_of_range=sum(int(t.out_of_range) for t in self._tables.values()))
        if self._compiled_runs or self._not_covered or self._fused_away:
            report.update_info(
                compiled={
                    "inductor": self._inductor or self._compiled_runs > 0,
                    "observed_backward_runs": self._compiled_runs,
                    "fused_away": {m: sorted(ops) for m, ops in sorted(self._fused_away.items())},
                    "not_covered": list(self._not_covered),
                }
            )
        if self.origins is not None:
            from fpaudit.rules.origins import table_from_columns

            report.origins = table_from_columns(self.origins.columns())
        if self._blocks is not None:
            from fpaudit.report.schema import BLOCKS_SCHEMA, frame

            report.blocks = frame(self._blocks.columns(), BLOCKS_SCHEMA)
            report.update_info(recipes=tuple(r.name for r in self._blocks.recipes))
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
    values it lost (see :class:`_BackwardMode`); ``origins`` notes, per op call in
    ``forward_pass`` and backward, whether it made inf/NaN (``fpaudit.capture.origin_probe``);
    ``recipes`` (names or :class:`~fpaudit.numerics.recipes.Recipe`) adds exact block-scaled
    statistics of every recorded tensor under each (see :mod:`fpaudit.kernels.blockstats`).
    """,
)
