"""The module clock: which module of the model was innermost in forward when autograd
made each node (:class:`ModuleClock`, read by the autograd sequence number each node
carries; ``fpaudit.capture.audit`` explains it), and the names reports give modules
(``model_name``)."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from fpaudit import torch_internals as _internals
from fpaudit import torch_internals_compile as _compile_internals
from fpaudit.capture import compiled
from fpaudit.errors import MonitorFailure
from fpaudit.report.records import LOSS_MODULE

_ACCUMULATE_GRAD_SEQUENCE = 2**64 - 1  # AccumulateGrad nodes have no sequence number
sequence_now = _internals.sequence_number_now
sequence_of = _internals.node_sequence_number
# A span entry is one int, (sequence number << _SHIFT) | the module's index: one append
# (atomic, so readers never see half an entry) of an object the garbage collector does
# not track, where a (sequence, module) tuple per hook was 800 tracked objects a step of
# a 400-module model, a collection of the youngest generation each step.
_SHIFT = 32
_INDEX = (1 << _SHIFT) - 1

# Modules that wrappers insert between a model's modules hold the wrapped module under
# these names: FSDP1's FullyShardedDataParallel, activation checkpointing's
# CheckpointWrapper, torch.compile's OptimizedModule (``_orig_mod``) and Lightning
# Fabric's _FabricModule (``_forward_module``; ``_original_module`` is the same module
# again, or the one under a DDP or FSDP wrapper). Reports name modules as the model
# itself does.
_WRAPPER_NAMES = frozenset(
    {
        "_fsdp_wrapped_module",
        "_checkpoint_wrapped_module",
        "_orig_mod",
        "_forward_module",
        "_original_module",
    }
)
# Wrappers whose attribute is a public word a model may use itself: that name is a
# wrapper's only under an instance of the class (DistributedDataParallel, DataParallel).
_WRAPPED_BY_CLASS = {"DistributedDataParallel": "module", "DataParallel": "module"}


def wrapped_paths(model: nn.Module) -> frozenset[str]:
    """The qualified names (as in ``named_modules()``) of the modules that a wrapper of
    ``_WRAPPED_BY_CLASS`` holds in ``model``: ``module`` for ``DDP(model)``."""
    found = set()
    for name, module in model.named_modules():
        attribute = _WRAPPED_BY_CLASS.get(type(module).__name__)
        if attribute is not None and attribute in dict(module.named_children()):
            found.add(f"{name}.{attribute}" if name else attribute)
    return frozenset(found)


def model_name(qualified: str, wrapped: frozenset[str] = frozenset()) -> str:
    """``qualified`` (as in ``named_modules()``) without wrapper segments:
    ``_fsdp_wrapped_module.blocks.0._checkpoint_wrapped_module.attn`` is ``blocks.0.attn``,
    and with ``wrapped`` (:func:`wrapped_paths`) ``module.fc`` of ``DDP(model)`` is ``fc``.
    A wrapper and the module it wraps share the name."""
    if (
        not wrapped
        and not any(part in qualified for part in ("_wrapped_module", "_orig"))
        and ("_forward_module" not in qualified)
    ):
        return qualified
    parts = qualified.split(".")
    kept = [
        part
        for i, part in enumerate(parts)
        if part not in _WRAPPER_NAMES and not (wrapped and ".".join(parts[: i + 1]) in wrapped)
    ]
    return ".".join(kept)


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


def compiled_modules(model: nn.Module) -> set[int]:
    """The ids of modules ``torch.compile``d with Inductor in ``model`` and of every module
    inside them. (Other backends keep their hooks: each a graph break, and the aten ops
    of ``aot_eager``'s backward attributed as in eager.)"""
    found: set[int] = set()
    for wrapper in compiled_wrappers(model):
        found.update(id(m) for m in wrapper.modules())
    return found


def compiled_wrappers(model: nn.Module) -> list[nn.Module]:
    """The outermost ``torch.compile`` wrappers (Inductor's) in ``model``: their hooks run
    before Dynamo's frame starts, so a hook there changes nothing Dynamo compiles."""
    found: set[int] = set()
    wrappers = []
    for module in model.modules():  # (parents before children)
        parts = _compile_internals.compiled_module_parts(module)
        if id(module) not in found and parts is not None and parts[0] in compiled.INDUCTORS:
            found.update(id(m) for m in module.modules())
            wrappers.append(module)
    return wrappers


class _Frames(threading.local):
    """The modules running forward on each thread, innermost last: a list on every thread
    from its first look (a missing attribute of a ``threading.local`` costs several
    times a present one, and the dispatch mode asks for every backward op)."""

    def __init__(self) -> None:
        self.frames: list[str] = []


class ModuleClock:
    """Remembers, by autograd sequence number, which module was innermost in forward."""

    def __init__(self, model: nn.Module) -> None:
        self.names: dict[int, str] = {}  # as reported (model_name)
        self._qualified: dict[int, str] = {}  # as in named_modules()
        self.param_owner: dict[int, tuple[str, str]] = {}
        self.wrapped = wrapped_paths(model)
        for name, module in model.named_modules():
            self._qualified.setdefault(id(module), name)
            self.names.setdefault(id(module), model_name(name, self.wrapped))
            for param_name, param in module.named_parameters(recurse=False):
                self.param_owner.setdefault(id(param), (model_name(name, self.wrapped), param_name))
            if type(module).__name__ == "FullyShardedDataParallel":
                # FSDP1 with use_orig_params registers the original parameters only; its
                # flat parameter (whose gradient FSDP divides and reduces) is the unit's.
                flat = _internals.fsdp_flat_param(module)
                if flat is not None:
                    self.param_owner.setdefault(
                        id(flat), (model_name(name, self.wrapped), "_flat_param")
                    )
        self.known_names = frozenset(self.names.values())
        self.forward_frames = _Frames()  # read by the dispatch mode for every backward op
        # the innermost module at each module's entry and exit, in order: one int each
        # (see _SHIFT), the module as its index in _modules (LOSS_MODULE is 0)
        self._spans: list[int] = []
        self._modules: list[str] = [LOSS_MODULE]
        self._index_of: dict[str, int] = {LOSS_MODULE: 0}
        self._new_name = threading.Lock()
        self._cache: dict[int, str] = {}
        self._observed: dict[int, int] = {}  # module id -> index in _modules (observe)
        self._compiled_runs: dict[int, str] = {}  # sequence number -> module (note_compiled_run)

    def current_module(self) -> str:
        """The innermost module running forward on this thread, or the loss pseudo-module."""
        frames = self.forward_frames.frames
        return frames[-1] if frames else LOSS_MODULE

    def in_forward(self) -> bool:
        """True while a module of the model runs forward on this thread (also recomputation)."""
        return bool(self.forward_frames.frames)

    # enter and exit run twice per module call in forward: each one frame, the hooks
    # (``_hooks``) the same work inlined
    def enter(self, name: str) -> None:
        self.forward_frames.frames.append(name)
        self._spans.append(sequence_now() << _SHIFT | self._index(name))

    def exit(self) -> None:
        frames = self.forward_frames.frames
        if frames:
            frames.pop()
        self._spans.append(sequence_now() << _SHIFT | (self._index(frames[-1]) if frames else 0))

    def _index(self, name: str) -> int:
        """``name``'s index in ``_modules`` (added on first sight, under a lock: rare)."""
        index = self._index_of.get(name)
        if index is None:
            with self._new_name:
                index = self._index_of.get(name)
                if index is None:
                    self._modules.append(name)  # before its index is seen
                    index = self._index_of[name] = len(self._modules) - 1
        return index

    def _stamped(self, model: nn.Module) -> list[tuple[nn.Module, str]]:
        """The modules whose forward the clock notes, with their names as reported."""
        compiled = compiled_modules(model)
        wrappers = {id(m) for m in compiled_wrappers(model)}
        found = []
        for name, module in model.named_modules():
            if self._qualified.get(id(module)) != name:
                continue  # a shared module keeps its first name
            if id(module) in compiled and id(module) not in wrappers:
                # Inside torch.compile: a hook would break the graph and recompile it at
                # every open; the compiled backward is attributed by its graph instead.
                # The wrapper's own hooks run outside Dynamo: what Dynamo leaves to eager
                # (a graph break, an LSTM) is the compiled module's, not the loss's.
                continue
            found.append((module, self.names[id(module)]))
        return found

    def observe(self, model: nn.Module) -> None:
        """Note forward through :meth:`module_entered` / :meth:`module_exited`, called by
        the owner's global module hooks (``fpaudit run``): nothing is put on the model's
        modules, so ``torch.save(model)``, ``copy.deepcopy`` and ``pickle`` never meet a
        hook of fpaudit's. Forward traced by Dynamo is not noted (its graph attributes
        its backward), so an ``aot_eager`` module's backward is its wrapper's."""
        self._observed = {id(module): self._index(name) for module, name in self._stamped(model)}

    def module_entered(self, module: nn.Module) -> None:
        """``module`` starts forward (a global forward pre-hook; see :meth:`observe`)."""
        own = self._observed.get(id(module))
        if own is not None:
            self.forward_frames.frames.append(self._modules[own])
            self._spans.append(sequence_now() << _SHIFT | own)

    def module_exited(self, module: nn.Module) -> None:
        """``module`` finished forward (a global forward hook; see :meth:`observe`)."""
        if id(module) in self._observed:
            self.exit()

    def install(self, model: nn.Module, stack: ExitStack, on_modules: bool = True) -> None:
        """Hooks on ``model``'s modules until ``stack`` closes; ``on_modules=False``: none,
        the owner's global hooks tell the clock instead (:meth:`observe`)."""
        if not on_modules:
            self.observe(model)
            return
        for module, name in self._stamped(model):
            enter, exit_ = self._hooks(name)
            stack.enter_context(module.register_forward_pre_hook(_untraced(enter)))
            stack.enter_context(module.register_forward_hook(_untraced(exit_), always_call=True))

    def _hooks(self, name: str) -> tuple[Callable[..., None], Callable[..., None]]:
        """A module's forward pre-hook and hook: ``enter(name)`` and ``exit()`` inlined,
        their errors fpaudit's (``torch_patches.guarded``'s rule, without its extra
        frames)."""
        local, append, index_of = self.forward_frames, self._spans.append, self._index_of
        own = self._index(name)

        def pre_hook(_module: nn.Module, _args: Any) -> None:
            try:
                local.frames.append(name)
                append(sequence_now() << _SHIFT | own)
            except Exception as error:
                raise MonitorFailure("module clock", error) from error

        def hook(_module: nn.Module, _args: Any, _output: Any) -> None:
            try:
                frames = local.frames
                if frames:
                    frames.pop()
                    if frames:  # every hook's name has its index (own, above)
                        append(sequence_now() << _SHIFT | index_of[frames[-1]])
                        return
                append(sequence_now() << _SHIFT)  # the loss pseudo-module, index 0
            except Exception as error:
                raise MonitorFailure("module clock", error) from error

        return pre_hook, hook

    def module_of(self, node: torch.autograd.graph.Node) -> str:
        sequence = sequence_of(node)
        if sequence == _ACCUMULATE_GRAD_SEQUENCE:
            variable = getattr(node, "variable", None)
            owner = self.param_owner.get(id(variable)) if variable is not None else None
            return owner[0] if owner is not None else LOSS_MODULE
        cached = self._cache.get(sequence)
        if cached is not None:
            return cached
        spans = self._spans
        position = bisect.bisect_right(spans, sequence << _SHIFT | _INDEX) - 1
        name = self._modules[spans[position] & _INDEX] if position >= 0 else LOSS_MODULE
        self._cache[sequence] = name
        return name

    def compiled_run_starts(self, name: str) -> Callable[[], None]:
        """A compiled frame of module ``name`` starts forward: no hook runs inside a
        compiled module, so the frame's run says which module it is. The returned
        function, called when the run ends, notes the autograd nodes it made (the
        compiled backward's own) as ``name``'s (:meth:`compiled_run_now`)."""
        first = sequence_now()

        def ends() -> None:
            for sequence in range(first, sequence_now()):
                self._compiled_runs[sequence] = name

        return ends

    def compiled_run_now(self) -> str | None:
        """The module whose compiled frame made the autograd node running backward on
        this thread (:meth:`compiled_run_starts`), or None."""
        if not self._compiled_runs:
            return None
        node = _internals.current_autograd_node()
        return self._compiled_runs.get(sequence_of(node)) if node is not None else None

    def forget(self) -> None:
        """Drop what forward remembered (called when a step closes)."""
        self._spans.clear()
        self._cache.clear()
        self._compiled_runs.clear()
