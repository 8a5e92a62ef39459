"""Audit ``torch.compile``d training: what Inductor's compiled backward stores.

A compiled backward runs fused kernels, not aten ops, so the capture's dispatch mode
cannot see its values. :func:`compile` (and :func:`observed`, for a module already
``torch.compile``d with the default backend) compiles with Inductor through
fpaudit's backend, which changes nothing Inductor computes: while an audit is open,
every buffer the backward graph writes to memory is handed to it, and it histograms
the buffer in the dtype it was stored in, exactly as an eager value. In plain words:

* Inductor's scheduler decides which values a kernel stores and which it keeps in
  registers. fpaudit compiles each backward graph once, exactly as ``torch.compile``
  does, and reads which buffers the scheduler stores and which FX node each holds; a
  twin of the generated wrapper function runs the same kernels and hands each stored
  buffer to the open audit at the last moment it holds its value (before it is freed,
  before its memory is reused, or at return). The graph is not changed: an added graph
  output would change Inductor's fusions and reductions, and the gradients.
  Values a fused kernel keeps in registers are never rounded to a stored dtype and are
  not counted; the ops they came from are the module's *fused away* ops in the report.
* Each stored value belongs to the module whose forward it differentiates: the
  backward graph's node metadata (``fwd_nn_module_stack``, or ``nn_module_stack`` for
  recomputed forward work) names it, as the model names it. A path below the compiled
  frame's own module (``L['self']``) is below the instance that ran the frame: a frame
  compiled once runs for every instance of its class that passes its guards (each
  expert of a mixture whose routing breaks the graph), so each run says which one it is
  by the parameters Dynamo calls it with.
* A stored value scales with the loss when it depends on a tangent (the gradient
  flowing in); a value computed from saved activations alone does not.
* With no audit open the compiled backward runs as Inductor compiled it (the plain
  wrapper); with one open, the twin runs the same kernels on the same buffers. Either
  way the gradients are bit-identical to plain ``torch.compile``'s: the tests compare
  them, and check that there is one graph, no graph break and no recompilation.

Known limitations:

* Only Inductor's backward is observed. A graph compiled with another backend, or run
  under CUDA graphs (``mode="reduce-overhead"``), is not: the report says so in one
  line (``compiled.not_covered``), and ``gate`` finds a compiled report that observed
  nothing to have measured nothing.
* The compiled forward is not observed (``--forward`` covers eager forward only).
* A backward graph Inductor loads from its FX graph cache runs no scheduler, so it
  cannot say what it stores: what fpaudit learned of it when it was compiled is kept
  beside the cache (:mod:`fpaudit.capture.compiled_plans`). A graph cached by a plain
  ``torch.compile`` run and never compiled under fpaudit is compiled once more by the
  first fpaudit run that meets it; every later run loads it.
* A buffer is histogrammed while the backward runs, before it is freed: memory is
  what the compiled backward uses, plus the histogram's own work.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import fx, nn

from fpaudit import torch_internals_compile as _compile_internals
from fpaudit.capture import compiled_plans
from fpaudit.capture.compiled_plans import BackwardPlan, CompiledSite, GraphModulePath

__all__ = [
    "COMPILED_NODE",
    "CompiledSite",
    "GraphModulePath",
    "InPlace",
    "compile",
    "compiled_backend",
    "compiles_observed",
    "eager_module",
    "inside_observed_backward",
    "observe_in_place",
    "observed",
]

BACKEND_NAME = "fpaudit_inductor"
"""The name of fpaudit's backend (``compiled_backend``), as ``torch.compile`` sees it."""
INDUCTORS = frozenset({"inductor", BACKEND_NAME})

COMPILED_NODE = "CompiledFunctionBackward"
"""The node name of records made from a compiled backward's stored values (the name of
the autograd node that runs a compiled backward)."""

# Ops that only view or reshape: a stored buffer's origins include them, but they
# compute nothing that could be "fused away".
_VIEWS = frozenset(
    {
        "aten.view.default",
        "aten.reshape.default",
        "aten._unsafe_view.default",
        "aten.permute.default",
        "aten.expand.default",
        "aten.t.default",
        "aten.transpose.int",
        "aten.squeeze.dim",
        "aten.unsqueeze.default",
        "aten.slice.Tensor",
        "aten.select.int",
        "aten.alias.default",
        "aten.as_strided.default",
    }
)


_OWN = GraphModulePath("", True)  # the traced frame's module itself


@dataclass(frozen=True)
class FrameParameter:
    """A parameter of the module whose frame Dynamo compiled, among the compiled frame's
    inputs: its position, the path of the module that holds it (below the frame's
    module) and its name. Each run's own parameter there says which instance ran."""

    position: int
    module: str
    name: str


@dataclass(frozen=True)
class CompiledGraph:
    """What fpaudit observes of one compiled backward graph."""

    root: weakref.ref[nn.Module] | None  # the module torch.compile was given
    sites: dict[str, CompiledSite]  # Inductor's buffer name -> what its value is
    fused_away: dict[GraphModulePath, tuple[str, ...]]  # module -> ops kept in registers


class Receiver(Protocol):
    def record_compiled(self, graph: CompiledGraph, site: CompiledSite, value: Any) -> None: ...
    def compiled_run(self, graph: CompiledGraph) -> None: ...
    def note_not_covered(self, line: str) -> None: ...
    def frame_starts(
        self, parameters: Sequence[tuple[FrameParameter, Any]]
    ) -> Callable[[], None] | None: ...


_receivers: list[Receiver] = []
_not_covered: list[str] = []  # compile-time reasons, handed to every audit that opens
_state = threading.local()


def add_receiver(receiver: Receiver) -> None:
    _receivers.append(receiver)
    for line in _not_covered:
        receiver.note_not_covered(line)


def remove_receiver(receiver: Receiver) -> None:
    if receiver in _receivers:
        _receivers.remove(receiver)


def _not_covered_line(line: str) -> None:
    if line not in _not_covered:
        _not_covered.append(line)
    for receiver in list(_receivers):
        receiver.note_not_covered(line)


def inside_observed_backward() -> bool:
    """True while an observed compiled backward runs on this thread: the aten ops it
    hands back (``mm.out``) are its stored values, recorded from its outputs instead."""
    return bool(getattr(_state, "depth", 0))


@contextmanager
def _observing() -> Iterator[None]:
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


# The traced frame's module: a local or global, with any subscripts after it
# (``L['self']``, ``L['args'][0]`` for a ``wrapped(*args, **kwargs)`` forward,
# ``L['kwargs']['model']``, ``G['net']``)
_ROOT = re.compile(r"^(?:L|G)\[['\"][^'\"]*['\"]\](?:\[[^\]]*\])*")
_SELF = re.compile(r"^L\[['\"]self['\"]\]$")  # the frame's own module (a method's self)
# A parameter of the frame's module, as Dynamo reads it (``L['self']._modules['up']
# ._parameters['weight']``)
_SELF_PARAMETER = re.compile(
    r"^(?P<module>L\[['\"]self['\"]\].*?)\._parameters\[['\"](?P<name>[^'\"]+)['\"]\]$"
)
_FRAME_PARAMETERS = 4  # tried in turn at each run (a tied parameter names another module)
_MODULES = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]")
_INDEX = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]")


def module_path(path: str) -> str:
    """A module path as Dynamo writes it (``L['self'].blocks.0.fc1``,
    ``L['self']._modules['blocks']._modules['0']``, ``L['args'][0].model.layers.0``) as
    ``named_modules()`` names it (``blocks.0.fc1``), relative to the module Dynamo traced."""
    path = _ROOT.sub("", path)
    path = _MODULES.sub(r".\1", path)
    path = _INDEX.sub(r".\1", path)
    return path.strip(".")


def frame_parameters(sources: Sequence[str | None]) -> tuple[FrameParameter, ...]:
    """The first few parameters of the frame's own module (``L['self']``) among a compiled
    frame's inputs (``sources``: where Dynamo reads each input from)."""
    found = []
    for position, source in enumerate(sources):
        matched = _SELF_PARAMETER.match(source or "")
        if matched is not None:
            found.append(FrameParameter(position, module_path(matched["module"]), matched["name"]))
    return tuple(found[:_FRAME_PARAMETERS])


def _module_of(node: fx.Node) -> GraphModulePath | None:
    """The module whose forward made ``node``: the innermost of its module stack; the
    traced frame's module itself (``""``) for an op of its own forward (a stack recorded
    empty); None for a node with no stack at all (a gradient sum AOTAutograd added)."""
    recorded = False
    for key in ("fwd_nn_module_stack", "nn_module_stack"):
        if key not in node.meta:
            continue
        recorded = True
        stack = node.meta[key]
        if stack:
            last = list(stack.values())[-1]
            path = str(last[0] if isinstance(last, tuple) else last)
            root = _ROOT.match(path)
            frame = root is not None and _SELF.match(root.group(0)) is not None
            return GraphModulePath(module_path(path), frame)
    return _OWN if recorded else None


def _modules(graph: fx.Graph) -> dict[str, GraphModulePath]:
    """Each node's module; a node without metadata (a gradient sum AOTAutograd added)
    takes the module of its first input that has one."""
    found: dict[str, GraphModulePath] = {}
    for node in graph.nodes:
        module = _module_of(node)
        if module is None:
            module = next((found[a.name] for a in node.all_input_nodes if a.name in found), None)
        if module is not None:
            found[node.name] = module
    return found


def _scaled(graph: fx.Graph) -> set[str]:
    """The nodes that depend on a tangent (the incoming gradient): they scale with the loss."""
    scaled: set[str] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name.startswith("tangents"):
                scaled.add(node.name)
        elif any(a.name in scaled for a in node.all_input_nodes):
            scaled.add(node.name)
    return scaled


def plan_graph(
    gm: fx.GraphModule, stored: list[_compile_internals.StoredBuffer]
) -> tuple[list[str], list[CompiledSite], dict[GraphModulePath, tuple[str, ...]]]:
    """The buffers to observe (the stored values, by Inductor's buffer names), their
    sites, and per module the ops whose values stayed in registers."""
    nodes = {n.name: n for n in gm.graph.nodes}
    modules = _modules(gm.graph)
    scaled = _scaled(gm.graph)
    names: list[str] = []
    sites: list[CompiledSite] = []
    in_memory: set[str] = set()  # the FX nodes whose values are observed
    computed: set[str] = set()
    for buffer in stored:
        computed.update(buffer.origins)
        node = nodes.get(buffer.node) if buffer.node is not None else None
        if node is None or node.op != "call_function" or buffer.node in in_memory:
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dtype != buffer.dtype:
            continue
        if not value.is_floating_point():
            continue
        names.append(buffer.name)
        in_memory.add(node.name)
        sites.append(
            CompiledSite(modules.get(node.name, _OWN), str(node.target), node.name in scaled)
        )
    fused: dict[GraphModulePath, set[str]] = {}
    for name in computed - in_memory:
        node = nodes.get(name)
        if node is None or node.op != "call_function" or str(node.target) in _VIEWS:
            continue
        fused.setdefault(modules.get(name, _OWN), set()).add(str(node.target))
    return names, sites, {m: tuple(sorted(ops)) for m, ops in fused.items()}


def _observer(graph_holder: list[CompiledGraph]) -> _compile_internals.Wrap:
    """Runs the compiled backward: as Inductor compiled it (``plain``) while no audit is
    open; its observed twin (the same kernels, each stored buffer handed to the open
    audits before it is freed or reused) while one is."""

    def wrap(
        plain: Callable[[list[Any]], Any], observed: Callable[[list[Any]], Any]
    ) -> Callable[[list[Any]], Any]:
        def run(args: list[Any]) -> Any:
            if not (_receivers and graph_holder):
                return plain(args)
            with _observing():
                result = observed(args)
            for receiver in list(_receivers):
                receiver.compiled_run(graph_holder[-1])
            return result

        run._boxed_call = True  # type: ignore[attr-defined]  # AOTAutograd's list convention
        return run

    return wrap


def _observe(graph_holder: list[CompiledGraph]) -> _compile_internals.Observe:
    """Hands one stored buffer of the observed twin to every open audit."""

    def observe(name: str, value: Any) -> None:
        if not graph_holder or not isinstance(value, torch.Tensor):
            return
        graph = graph_holder[-1]
        site = graph.sites.get(name)
        if site is not None:
            for receiver in list(_receivers):
                receiver.record_compiled(graph, site, value)

    return observe


def compiled_backend(
    root: nn.Module | None = None, options: dict[str, Any] | None = None
) -> Callable[[fx.GraphModule, Sequence[Any]], Any]:
    """A ``torch.compile`` backend: Inductor (with ``options``, an Inductor mode's
    settings) whose backward's stored values an open audit records. ``root`` is the
    module ``torch.compile`` is given (its modules' names start there)."""
    reference = weakref.ref(root) if root is not None else None

    def frame(
        dynamo_graph: fx.GraphModule,
    ) -> tuple[_compile_internals.BackwardCompiler, Callable[[Callable[..., Any]], Any]]:
        parameters = frame_parameters(_compile_internals.graph_input_sources(dynamo_graph))
        return backward, functools.partial(_frame_runs, parameters)

    def backward(gm: fx.GraphModule, example_inputs: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if _compile_internals.cudagraphs_requested(kwargs):
            _not_covered_line(
                "a compiled backward runs under CUDA graphs (mode='reduce-overhead'): "
                "its values are not observed"
            )
            return _compile_internals.plain_backward(gm, example_inputs, kwargs)
        holder: list[CompiledGraph] = []
        stacks = compiled_plans.module_stacks(gm)  # (before Inductor's passes change gm)

        def use(found: BackwardPlan) -> list[str]:
            sites = dict(zip(found.names, found.sites, strict=True))
            holder.append(CompiledGraph(reference, sites, found.fused_away))
            for line in found.unreadable:
                _not_covered_line(line)
            return list(found.names)

        def plan(
            post_grad: fx.GraphModule,
            stored: list[Any],
            cached: _compile_internals.CachedGraph | None,
        ) -> list[str]:
            names, sites, fused = plan_graph(post_grad, stored)
            unreadable = tuple(
                f"a compiled backward's buffer {buffer.name} could not be read "
                f"({buffer.unreadable}): its values are not observed"
                for buffer in stored
                if buffer.unreadable is not None
            )
            found = BackwardPlan(tuple(names), tuple(sites), fused, unreadable)
            if cached is not None:  # a later run that loads this graph from the cache
                compiled_plans.remember(cached, stacks, found)
            return use(found)

        def recall(cached: _compile_internals.CachedGraph) -> list[str] | None:
            found = compiled_plans.recall(cached, stacks)
            return None if found is None else use(found)

        spare = copy.deepcopy(gm)  # Inductor's passes change the graph they compile
        with _observing():  # compiling (lazily, inside backward) is not the model's work
            try:
                return _compile_internals.inductor_backward(
                    gm, example_inputs, kwargs, plan, _observe(holder), _observer(holder), recall
                )
            except Exception as error:
                if _compile_internals.is_missing_compiler(error):
                    raise  # the machine's fault, said as such (not a graph fpaudit skipped)
                first = (str(error).splitlines() or [""])[0][:160]
                _not_covered_line(
                    "a compiled backward graph's stored values could not be observed "
                    f"({type(error).__name__}: {first}): it runs as Inductor compiles it, "
                    "unobserved"
                )
                return _compile_internals.plain_backward(spare, example_inputs, kwargs)

    return _compile_internals.compile_backend(frame, dict(options or {}), BACKEND_NAME)


def _frame_runs(
    parameters: tuple[FrameParameter, ...], run: Callable[..., Any]
) -> Callable[..., Any]:
    """``run`` (a compiled frame's callable) telling each open audit, around every call,
    which parameters of the frame's module it was called with: a frame Dynamo compiled
    once runs for every instance of its module that passes its guards (each expert of a
    mixture), and its backward belongs to the instance that ran it."""
    if not parameters:
        return run

    def frame_run(*args: Any) -> Any:
        if not _receivers:
            return run(*args)
        inputs = args[0] if len(args) == 1 and isinstance(args[0], list) else args  # (boxed)
        given = [(p, inputs[p.position]) for p in parameters if p.position < len(inputs)]
        ends = [receiver.frame_starts(given) for receiver in list(_receivers)]
        try:
            return run(*args)
        finally:
            for end in ends:
                if end is not None:
                    end()

    return frame_run


def not_covered_modules(model: nn.Module) -> list[str]:
    """One line per module of ``model`` compiled so that fpaudit cannot observe its
    backward's stored values: another backend, or Inductor outside fpaudit's backend."""
    lines = []
    for name, module in model.named_modules():
        parts = _compile_internals.compiled_module_parts(module)
        if parts is None or parts[0] == BACKEND_NAME:
            continue
        shown = (
            repr(name.replace("_orig_mod.", "").replace("._orig_mod", "")) if name else "the model"
        )
        if parts[0] == "inductor":
            lines.append(
                f"{shown} is compiled with Inductor outside fpaudit.compile: its compiled "
                "backward's stored values are not observed, only the ops it hands back to "
                "aten, under the module that calls it"
            )
        else:
            lines.append(
                f"{shown} is compiled with backend {parts[0]!r}: fpaudit observes Inductor's "
                "compiled backward only; this backend's aten ops are recorded as in eager "
                "(each module hook a graph break)"
            )
    return lines


def compile(model: nn.Module, **kwargs: Any) -> nn.Module:
    """``torch.compile(model, **kwargs)`` with Inductor through fpaudit's backend: an
    open audit records what its compiled backward stores. ``mode`` and ``options`` are
    Inductor's; ``fullgraph``, ``dynamic`` and the rest go to ``torch.compile``."""
    mode = kwargs.pop("mode", None)
    options = dict(kwargs.pop("options", None) or {})
    backend = kwargs.pop("backend", "inductor")
    if backend != "inductor":
        raise ValueError(f"fpaudit observes Inductor's backward only, got backend={backend!r}")
    if mode is not None:
        options = {**_compile_internals.mode_options(mode), **options}
    compiled: nn.Module = torch.compile(model, backend=compiled_backend(model, options), **kwargs)  # type: ignore[assignment]
    return compiled


def eager_module(model: nn.Module) -> nn.Module | None:
    """The eager module a ``torch.compile``d module wraps, or None for any other module."""
    return _compile_internals.eager_module(model)


def observed(model: nn.Module) -> tuple[nn.Module, str | None]:
    """``model`` as fpaudit audits it: a module ``torch.compile``d with Inductor is
    compiled again (from its eager module, with the same mode) through fpaudit's
    backend; any other module is returned as it is. The second value is the line that
    says what is not covered, or None."""
    options = inductor_options(model)
    if options is None:  # not compiled, or another backend (or already fpaudit's): the
        return model, None  # audit says what it does not cover
    eager = _compile_internals.eager_module(model)
    assert eager is not None
    if options.get("triton.cudagraphs"):
        return model, (
            "the model runs under CUDA graphs (mode='reduce-overhead'): its compiled "
            "backward's values are not observed"
        )
    compiled: nn.Module = torch.compile(eager, backend=compiled_backend(eager, options))  # type: ignore[assignment]
    return compiled, None


def inductor_options(compiled_by: Any) -> dict[str, Any] | None:
    """The Inductor options (its mode's settings) of a ``torch.compile``d module, or of a
    ``torch.compile`` context (the one Lightning keeps of a compiled ``LightningModule``);
    None for another backend (fpaudit's included) or a module not compiled."""
    parts = (
        _compile_internals.compiled_module_parts(compiled_by)
        if isinstance(compiled_by, nn.Module)
        else _compile_internals.context_backend(compiled_by)
    )
    return parts[1] if parts is not None and parts[0] == "inductor" else None


def mode_options(mode: str | None) -> dict[str, Any]:
    """The Inductor options ``torch.compile(mode=mode)`` sets (none for the default mode)."""
    return _compile_internals.mode_options(mode) if mode is not None else {}


@dataclass
class InPlace:
    """Methods of a module rebound in place to compile through fpaudit's backend
    (:func:`observe_in_place`); :meth:`restore` puts back what was there."""

    module: nn.Module
    view: nn.Module  # the module as an audit is given it: compiled by fpaudit (never called)
    replaced: tuple[str, ...]
    saved: dict[str, Any] = field(default_factory=dict)  # name -> the instance attribute it hid

    def restore(self) -> None:
        for name in self.replaced:
            if name in self.saved:
                setattr(self.module, name, self.saved[name])
            elif name in vars(self.module):
                delattr(self.module, name)


def observe_in_place(
    module: nn.Module, methods: Mapping[str, Callable[..., Any]], options: dict[str, Any]
) -> InPlace:
    """Compile each of ``methods`` (name -> the eager callable, e.g. ``forward``, or a
    ``LightningModule``'s ``training_step``) with Inductor (``options``: its mode's
    settings) through fpaudit's backend, and bind it to ``module`` under its name: a
    training framework that calls the module, or a ``torch.compile`` wrapper of it
    (whose frame calls ``module.__call__``, which looks ``forward`` up at each call),
    runs fpaudit's compiled code, so an open audit of :attr:`InPlace.view` records what
    its backward stores under the module's own names. With no audit open it computes
    what Inductor computes (the tests compare parameters bit for bit).

    Known limitation: a wrapper that Dynamo traces *through* ``module.__call__``
    (``torch.compile`` of a ``torch.nn`` container such as ``nn.Sequential``) compiles
    the module with its own backend; the audit then observes no stored value, and
    ``gate`` finds it to have measured nothing."""
    backend = compiled_backend(module, options)
    own = vars(module)
    saved = {name: own[name] for name in methods if name in own}
    for name, method in methods.items():
        setattr(module, name, torch.compile(method, backend=backend))
    view: nn.Module = torch.compile(module, backend=backend)  # type: ignore[assignment]
    return InPlace(module, view, tuple(methods), saved)


@contextmanager
def compiles_observed() -> Iterator[None]:
    """``torch.compile`` with Inductor (its default) compiles through fpaudit's backend
    inside this block (``fpaudit run``): a script's compiled backward is observed. Any
    other backend, or ``disable=True``, is ``torch.compile`` as it is. The wrapper takes
    ``torch.compile``'s signature and hands it the very arguments it was given, with
    Inductor's ``mode`` and ``options`` folded into the backend."""
    original = torch.compile
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compile_(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        given = dict(bound.arguments)
        if given.get("backend", "inductor") != "inductor" or given.get("disable"):
            return original(*args, **kwargs)
        target = given.pop("model", None)
        if target is None:  # @torch.compile(mode=...): a decorator
            return functools.partial(compile_, **{k: v for k, v in given.items()})
        mode = given.pop("mode", None)
        options = dict(given.pop("options", None) or {})
        given.pop("backend", None)
        if mode is not None:
            options = {**_compile_internals.mode_options(mode), **options}
        owner = target if isinstance(target, nn.Module) else getattr(target, "__self__", None)
        root = owner if isinstance(owner, nn.Module) else None
        return original(target, backend=compiled_backend(root, options), **given)

    torch.compile = compile_
    try:
        yield
    finally:
        torch.compile = original
