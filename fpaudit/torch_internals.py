"""The one place fpaudit reads private torch: every name below may move between releases.

Everything else in fpaudit uses public torch only; ``tests/test_torch_seam.py``
fails when a module other than this one (and ``torch_internals_compile`` for
``torch.compile``'s internals, where present) reads a private torch name, and
checks on the running release that every name listed here still resolves and
behaves as used. ``make test-release RELEASE=X`` runs that test, with the capture,
oracle, patch, transparency and CLI tests, on each supported release.

Checked on torch 2.10.0, 2.11.0, 2.12.1, 2.13.0, 2.14.1 and 2.15.0 (the releases
``pyproject.toml`` admits). No name needs a per-release branch in that range:
each is read the same way on all six; the branches that exist are for a name
going missing in a future release, and say what is lost then.

**Autograd engine** (the capture, ``capture``):

* ``torch.autograd._engine_run_backward``: the Python entry of every engine run
  (``backward`` and ``autograd.grad``). fpaudit wraps it so that its dispatch
  mode is on only while the engine runs. Missing: :func:`wrap_engine_entry` returns
  None and the capture keeps its mode on throughout (forward pays dispatch).
* the C engine's parameter names behind its ``*args, **kwargs`` (``grad_tensors``,
  ``keep_graph``, ``create_graph``, ``inputs``, ``allow_unreachable``,
  ``accumulate_grad``), to find ``create_graph`` however the entry is called.
* ``torch._C._current_autograd_node()``: the node the engine runs on this thread.
* ``torch._C._autograd._get_sequence_nr()`` and ``Node._sequence_nr()``: the
  sequence number the next node will get, and a node's own; they tie a backward
  node to the module whose forward made it.
* ``torch.utils._python_dispatch.TorchDispatchMode``: the dispatch mode base class.
* ``torch._ops.OpOverload`` (a type) and ``OpOverload._schema`` (``is_mutable``,
  ``arguments[i].alias_info.is_write``): which arguments an op writes;
  ``arguments[i].type`` (printed as ``Tensor``, ``Optional[Tensor]``, ``List[Tensor]``,
  ``List[Optional[Tensor]]``): which positions can hold the op's input tensors.
* ``OpOverload._op``: the C function ``OpOverload.__call__`` calls with the very
  arguments it was given (on each release above); the dispatch mode calls it directly,
  one Python frame less per op.
* ``nn.Module._parameters``: a module's own parameters by attribute name, the dict
  ``getattr(module, name)`` finds a parameter in (:data:`parameters_of`): closing a step
  checks that each parameter is still its owner's without ``Module.__getattr__``.
* FSDP1's ``FullyShardedDataParallel._flat_param`` and ``FlatParameter._is_flat_param``:
  the flat parameter whose gradient FSDP divides and reduces.
* ``"torch._dynamo" in sys.modules``: whether Dynamo is loaded (its import costs
  ~150 MB, so fpaudit never imports it itself).

**``fpaudit run``'s reads of torch state** (``torch_patches``, ``steps``):

* ``torch._C.TensorBase.__dict__["grad"]``: the C getset descriptor behind
  ``Tensor.grad``; the patched property and fpaudit's own reads go through it.
* ``GradScaler._scale`` (the scale in force, a 0-dim device tensor: reading it does
  not sync the host, ``get_scale()`` would), ``GradScaler._init_scale`` (no public
  getter), ``GradScaler._per_optimizer_states[id(opt)]["found_inf_per_device"]``
  (the step's inf checks as device tensors).
* ``LRScheduler._step_count``: 0 during the scheduler's constructor, whose own
  ``step()`` is not the script's.
* ``torch._foreach_norm``: the largest ``|grad|`` of many tensors in one kernel.
* ``torch.nn.modules.module._has_any_global_hook`` and the global hook dicts it reads
  (``_global_forward_pre_hooks``, ``_global_forward_hooks``,
  ``_global_forward_hooks_always_called``, ``_global_forward_hooks_with_kwargs``,
  ``_global_backward_pre_hooks``, ``_global_backward_hooks``): ``OptimizedModule.__call__``
  (its one caller) warns on the script's stderr when any global module hook exists;
  while ``fpaudit run`` watches, it counts the script's own hooks only
  (:func:`own_global_hooks_hidden`). Missing: the warning shows, as torch words it.

**Lightning's private names** (``integrations.lightning``; checked on Lightning 2.6.6,
the release the tests install, and read with ``getattr`` so that a release without them
falls back to public state):

* ``LightningModule._compiler_ctx``: the dict Lightning keeps for a module it unwrapped
  from ``torch.compile`` (``compiler``, ``dynamo_ctx``, ``original_forward``,
  ``original_training_step``). Missing: a compiled model is audited as an eager one.
* ``_FitLoop._should_accumulate()``: Lightning's own rule for whether more
  micro-batches accumulate before the optimizer steps. Missing: the callback derives
  it from the public batch progress and ``accumulate_grad_batches``.

**Kernel build** (``kernels``): ``torch.utils.cpp_extension._get_build_directory``,
where torch keeps a built extension (to tell whether a build is cached).

**Semantics that moved** (no fpaudit count depends on them; the tests that use
torch as an oracle say which release does what): an eager cast to
``float8_e4m3fn`` of a value past 464 gives NaN on torch 2.10.0, 2.11.0 and 2.12.1
and saturates to 448 on 2.13.0, 2.14.1 and 2.15.0 (pytorch/pytorch#178817;
``tests/numerics/test_formats.py`` pins both). fpaudit's FP8 counts come from its own
integer arithmetic (``formats.fate``) and count either result as overflow; its one
cast to ``float8_e4m3fn`` (the NVFP4 block scale) is of a value already clamped to
E4M3's range.
"""

from __future__ import annotations

import functools
import inspect
import operator
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "ENGINE_ENTRY",
    "OpOverload",
    "TorchDispatchMode",
    "autograd_sequence_number",
    "create_graph",
    "current_autograd_node",
    "dynamo_loaded",
    "extension_build_directory",
    "foreach_amax",
    "fsdp_flat_param",
    "grad_descriptor",
    "is_flat_param",
    "is_mutable",
    "node_sequence_number",
    "op_caller",
    "parameters_of",
    "scaler_found_inf",
    "scaler_init_scale",
    "scaler_scale",
    "scheduler_step_count",
    "sequence_number_now",
    "tensor_argument_positions",
    "wrap_engine_entry",
    "written_arguments",
]

# -- the autograd engine ----------------------------------------------------------
ENGINE_ENTRY = "_engine_run_backward"

# What ``_engine_run_backward(t_outputs, *args, **kwargs)`` passes on to the C engine
# (``Variable._execution_engine.run_backward``), by the engine's own keyword names.
_ENGINE_ARGUMENTS = (
    ("grad_tensors", inspect.Parameter.empty),
    ("keep_graph", inspect.Parameter.empty),
    ("create_graph", inspect.Parameter.empty),
    ("inputs", ()),
    ("allow_unreachable", False),
    ("accumulate_grad", True),
)


def engine_signature(original: Callable[..., Any]) -> inspect.Signature:
    """The signature of a call of the engine entry ``original``: its own parameters, its
    ``*args, **kwargs`` spelled out as the C engine's parameters (the ones it passes on)."""
    signature = inspect.signature(original)
    named = [
        p
        for p in signature.parameters.values()
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if "create_graph" in signature.parameters or len(named) == len(signature.parameters):
        return signature  # spelled out already
    known = {p.name for p in named}
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    named += [
        inspect.Parameter(name, kind, default=default)
        for name, default in _ENGINE_ARGUMENTS
        if name not in known
    ]
    return signature.replace(parameters=named)


def create_graph(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """Whether an engine call builds a graph of the backward (``create_graph``)."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:  # not a call the engine takes: it raises its own error
        return bool(kwargs.get("create_graph", False))
    return bool(bound.arguments.get("create_graph", False))


def wrap_engine_entry(
    make: Callable[[Callable[..., Any], inspect.Signature], Callable[..., Any]],
) -> Callable[[], None] | None:
    """Replace the engine entry by ``make(original, signature)`` (which must keep the
    original's behaviour); return the undo, or None when this torch has no such entry.

    The replacement gets the original's name, docstring and signature
    (``functools.wraps``); the undo puts the original back only if the replacement is
    still the one in place."""
    original = getattr(torch.autograd, ENGINE_ENTRY, None)
    if original is None or not callable(original):
        return None
    replacement = functools.wraps(original)(make(original, engine_signature(original)))
    setattr(torch.autograd, ENGINE_ENTRY, replacement)

    def restore() -> None:
        if getattr(torch.autograd, ENGINE_ENTRY, None) is replacement:
            setattr(torch.autograd, ENGINE_ENTRY, original)

    return restore


current_autograd_node: Callable[[], torch.autograd.graph.Node | None] = (
    torch._C._current_autograd_node
)
"""The autograd node the engine is executing on this thread, or None outside backward
(the C function itself: the dispatch mode asks for every op)."""


def autograd_sequence_number() -> int:
    """The sequence number autograd will give the next node created on this thread."""
    return int(torch._C._autograd._get_sequence_nr())


sequence_number_now: Callable[[], int] = torch._C._autograd._get_sequence_nr
"""``autograd_sequence_number`` without its Python frame (the C function itself: the
module clock asks at every module's entry and exit in forward)."""


node_sequence_number: Callable[[Any], int] = operator.methodcaller("_sequence_nr")
"""The sequence number of autograd node ``node`` (2**64 - 1 for ``AccumulateGrad``):
``node._sequence_nr()``, called at C speed (the module clock asks for each node)."""


# -- op schemas ---------------------------------------------------------------------
def is_mutable(func: OpOverload) -> bool:
    """Whether the op's schema says it writes any of its arguments."""
    return bool(func._schema.is_mutable)


def op_caller(func: OpOverload) -> Callable[..., Any]:
    """What calling ``func`` calls: ``func._op(*args, **kwargs)`` is ``func(*args, **kwargs)``
    without ``OpOverload.__call__``'s Python frame."""
    caller: Callable[..., Any] = func._op
    return caller


_TENSOR_TYPES = frozenset({"Tensor", "Optional[Tensor]"})
_TENSOR_LIST_TYPES = frozenset({"List[Tensor]", "List[Optional[Tensor]]"})


def tensor_argument_positions(func: OpOverload) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """From the op's schema: the positions of its ``Tensor`` and ``Tensor?`` arguments,
    and of its ``Tensor[]`` and ``Tensor?[]`` ones; None where an argument may hold
    tensors in another form (a tuple, ``Any``): read those calls' arguments whole.
    A position typed Tensor may still hold a Python number at a call (``add.Tensor``'s
    ``other``): the caller checks what it finds there."""
    single: list[int] = []
    lists: list[int] = []
    for i, argument in enumerate(func._schema.arguments):
        kind = str(argument.type)
        if kind in _TENSOR_TYPES:
            single.append(i)
        elif kind in _TENSOR_LIST_TYPES:
            lists.append(i)
        elif "Tensor" in kind or kind == "Any":
            return None
    return tuple(single), tuple(lists)


def written_arguments(func: OpOverload) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument the op's schema marks as written."""
    return tuple(
        (i, a.name)
        for i, a in enumerate(func._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )


# -- modules ---------------------------------------------------------------------------
parameters_of: Callable[[torch.nn.Module], dict[str, torch.nn.Parameter | None]] = (
    operator.attrgetter("_parameters")
)
"""A module's own parameters by attribute name (``module._parameters``; its values may be
None), read at C speed: closing a step asks it of every parameter's owner."""


# -- FSDP1 ---------------------------------------------------------------------------
def fsdp_flat_param(module: torch.nn.Module) -> torch.Tensor | None:
    """FSDP1's flat parameter of a ``FullyShardedDataParallel`` unit, if it has one."""
    flat = getattr(module, "_flat_param", None)
    return flat if isinstance(flat, torch.Tensor) else None


def is_flat_param(tensor: Any) -> bool:
    """Whether ``tensor`` is FSDP1's flat parameter."""
    return bool(getattr(tensor, "_is_flat_param", False))


def dynamo_loaded() -> bool:
    """Whether something has imported Dynamo (fpaudit never does so itself)."""
    return "torch._dynamo" in sys.modules


# -- torch state read by ``fpaudit run`` ---------------------------------------------
_GLOBAL_HOOK_DICTS = (
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs",
)


def own_global_hooks_hidden(own: frozenset[int]) -> Callable[[], None] | None:
    """Make ``_has_any_global_hook`` (which ``torch.compile``'s ``OptimizedModule``
    reads to warn that global module hooks fire once more for it) see only global
    module hooks whose handle ids are not in ``own``: the script's warning, not
    fpaudit's. Returns the call that puts it back; None where torch lacks the names."""
    from torch.nn.modules import module as modules

    original = getattr(modules, "_has_any_global_hook", None)
    dicts = [getattr(modules, name, None) for name in _GLOBAL_HOOK_DICTS]
    if original is None or any(not isinstance(d, dict) for d in dicts):
        return None

    @functools.wraps(original)
    def has_any_global_hook() -> bool:
        return any(key not in own for hooks in dicts for key in hooks)  # type: ignore[union-attr]

    modules._has_any_global_hook = has_any_global_hook

    def restore() -> None:
        modules._has_any_global_hook = original

    return restore


def grad_descriptor() -> Any:
    """The C getset descriptor behind ``Tensor.grad``."""
    return vars(torch._C.TensorBase)["grad"]


def scaler_scale(scaler: Any) -> torch.Tensor | None:
    """The scale in force as a 0-dim device tensor (no host sync); None before first use."""
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, torch.Tensor) else None


def scaler_init_scale(scaler: Any) -> float:
    """The scaler's configured initial scale."""
    return float(scaler._init_scale)


def scaler_found_inf(scaler: Any, optimizer: Any) -> list[torch.Tensor]:
    """The inf checks of ``scaler.step(optimizer)``, one 0-dim tensor per device (empty
    if the step did not check)."""
    state = scaler._per_optimizer_states.get(id(optimizer), {})
    found = state.get("found_inf_per_device")
    return list(found.values()) if found else []


def scheduler_step_count(scheduler: Any) -> int:
    """How many times the scheduler has stepped (0 inside its constructor's own step)."""
    return int(getattr(scheduler, "_step_count", 1))


def foreach_amax(group: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``max |t|`` of each tensor of ``group`` (one device), in one kernel."""
    return list(torch._foreach_norm(list(group), float("inf")))


# -- torch.utils.cpp_extension -----------------------------------------------------------
def extension_build_directory(name: str) -> str:
    """Where torch keeps the build of C++ extension ``name``."""
    from torch.utils.cpp_extension import _get_build_directory

    return str(_get_build_directory(name, verbose=False))


@dataclass(frozen=True)
class LightningCompiled:
    """What Lightning kept of the ``torch.compile`` it unwrapped from a module: the
    compile's Dynamo context (its options) and the module's eager methods."""

    dynamo_context: Any
    forward: Callable[..., Any]
    training_step: Callable[..., Any]


def lightning_compiled(pl_module: Any) -> LightningCompiled | None:
    """Lightning's record of a ``torch.compile`` (Dynamo) it unwrapped from
    ``pl_module``, or None (not compiled, another compiler, or no such record)."""
    context = getattr(pl_module, "_compiler_ctx", None)
    if not isinstance(context, dict) or context.get("compiler") != "dynamo":
        return None
    return LightningCompiled(
        context.get("dynamo_ctx"), context["original_forward"], context["original_training_step"]
    )


def lightning_should_accumulate(fit_loop: Any) -> bool | None:
    """Lightning's own answer to "do more micro-batches accumulate before the optimizer
    steps?", or None when this release has no such method."""
    should_accumulate = getattr(fit_loop, "_should_accumulate", None)
    return bool(should_accumulate()) if callable(should_accumulate) else None
