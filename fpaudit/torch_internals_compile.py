"""``torch.compile``'s internals, read in this one place: every name below may move.

``fpaudit.capture.compiled`` observes what Inductor's compiled backward stores. It needs to
know which buffers Inductor's scheduler really writes to memory (the rest stay in a
fused kernel's registers) and to read each of them while it holds its value, without
changing the graph Inductor compiles (an added graph output changes its fusions and
reductions, and so the gradients).
Nothing here is public torch; ``tests/test_torch_seam.py`` allows private reads in
this module and in ``torch_internals`` only, and checks that this docstring names
each private name read below.

Checked on torch 2.13.0 (the pinned release); ``make test-release`` runs the compile
tests on 2.10.0 and 2.15.0.

* ``torch._inductor.compile_fx.compile_fx`` and ``compile_fx_inner``: Inductor's entry
  (AOTAutograd around it) and its per-graph compiler; ``compile_fx(..., inner_compile=)``
  lets fpaudit compile the backward graph its own way, with ``is_backward`` and
  ``cudagraphs`` among the keyword arguments it is called with.
* ``torch._inductor.graph.GraphLowering.codegen``: wrapped for one compile (a lock
  keeps other threads' compiles out) to read, after the scheduler ran,
  ``GraphLowering.buffers`` (``get_name``, ``get_dtype``, ``layout``,
  ``get_origins``, ``get_origin_node``/``origin_node``), ``removed_buffers``,
  ``torch._inductor.ir.MultiOutputLayout`` (a buffer that is a tuple of others) and
  ``torch._inductor.ir.NoneLayout`` (an op that writes into another buffer, as a
  ``scatter_add`` fallback into the zeros MaxPool's backward starts from: it stores
  nothing of its own, and the buffer it mutates is read as any other).
* ``GraphLowering.module``: the graph Inductor lowers (the post-grad graph, whose node
  metadata names modules), read in the same ``codegen`` call.
* ``torch._inductor.config.fx_graph_cache``: Inductor's FX graph cache stays as the user
  has it, so a backward graph cached by a plain ``torch.compile`` run (or an earlier
  fpaudit run) is loaded, not compiled; it is turned off only to compile once more a
  graph loaded from the cache whose stored buffers fpaudit has not recorded yet (a
  cached graph's scheduler does not run, so it cannot say which buffers it stores).
* ``CompiledFxGraph._fx_graph_cache_key`` and ``.source_code``: the FX graph cache's key
  of a compiled graph (set on a cache miss and on a hit) and its generated code, which
  key and check what fpaudit remembers of the graph's stored buffers.
* ``torch._functorch.config.enable_autograd_cache``: off while fpaudit compiles, so a
  cached forward/backward pair never skips fpaudit's backward compiler.
* ``CompiledFxGraph.current_callable``: the compiled backward's boxed callable,
  Inductor's generated wrapper ``call`` (a function, or a bound method of the generated
  module's ``Runner``): a straight-line Python function whose lines free a buffer
  (``del bufN``), hand its memory to another (``... bufN ...  # reuse``) or return.
  fpaudit compiles a twin of it from its source (``inspect.getsource``) with a call
  before each such line, in the generated module's globals (its kernels), and wraps
  the two: the plain one runs while no audit is open.
* ``torch._inductor.exc.InvalidCxxCompiler``: Inductor found no working C++ compiler
  (the machine's fault, said as such).
* ``OptimizedModule._orig_mod`` and ``OptimizedModule.dynamo_ctx.callback``'s
  ``_torchdynamo_orig_backend``: the eager module a ``torch.compile``d module wraps and
  the backend it was compiled with (``compiler_name`` and ``config`` of the
  ``inductor`` backend's wrapper: its mode's options); the same read of a context
  Lightning keeps (``LightningModule._compiler_ctx["dynamo_ctx"]``).
* ``torch._inductor.list_mode_options``: the options a ``torch.compile`` mode sets.
* ``OptimizedModule.dynamo_ctx.fullgraph`` and ``._dynamic``: what ``torch.compile`` was
  given besides the backend, kept when fpaudit compiles the module again.
* ``torch._inductor.runtime.cache_dir_utils.cache_dir``: the folder Inductor caches
  compiled code in (importing ``torch._inductor`` creates it).
* Dynamo's graph inputs: each placeholder's ``meta["grapharg"].source.name`` (a property,
  or a method on older releases), the expression Dynamo reads the input from in the
  frame it compiled (``L['self']._modules['up']._parameters['weight']``), in the order
  the compiled frame's callable is called with them. A frame Dynamo compiles once runs
  for every instance of its module whose guards pass (each expert of a mixture), so the
  module a run belongs to is read from the parameters it is called with.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import re
import sys
import textwrap
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

__all__ = [
    "CachedGraph",
    "StoredBuffer",
    "compile_backend",
    "compiled_module_parts",
    "context_backend",
    "eager_module",
    "graph_input_sources",
    "inductor_backward",
]

_LOCK = threading.Lock()


@dataclass(frozen=True)
class StoredBuffer:
    """A buffer Inductor's compiled graph writes to memory: the FX node whose value it
    holds (None when it is part of another buffer, as a slice of a ``cat``, or writes into
    another buffer, as an in-place scatter), the dtype it is stored in (None when it has
    no storage of its own), and the names of every FX node whose computation it fused.
    ``unreadable`` says why a buffer could not be read (its value is then not observed)."""

    name: str
    dtype: torch.dtype | None
    node: str | None
    origins: tuple[str, ...]
    unreadable: str | None = None


@dataclass(frozen=True)
class CachedGraph:
    """Where Inductor's FX graph cache keeps a compiled graph: its cache key and the
    SHA-256 of its generated code (two compiles under one key that made other code are
    told apart)."""

    key: str
    code: str


def eager_module(model: nn.Module) -> nn.Module | None:
    """The eager module a ``torch.compile``d module wraps, or None for any other module."""
    if not any(c.__name__ == "OptimizedModule" for c in type(model).__mro__):
        return None  # (the class is Dynamo's: importing it costs ~150 MB)
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else None


def compiled_module_parts(model: nn.Module) -> tuple[str, dict[str, Any]] | None:
    """For a ``torch.compile``d module: its backend's name (``inductor`` for the default)
    and, for Inductor, the options its mode set; None for any other module."""
    if eager_module(model) is None:
        return None
    return context_backend(getattr(model, "dynamo_ctx", None))


def context_backend(context: Any) -> tuple[str, dict[str, Any]]:
    """The backend of a ``torch.compile`` context (an ``OptimizedModule``'s ``dynamo_ctx``,
    or the one Lightning keeps of a compiled ``LightningModule``): its name and, for
    Inductor, the options its mode set."""
    callback = getattr(context, "callback", None)
    backend = callback
    for _ in range(8):  # Dynamo's wrappers each keep the one they wrap
        inner = getattr(backend, "_torchdynamo_orig_backend", None)
        if inner is None or inner is backend:
            break
        backend = inner
    name = getattr(backend, "compiler_name", None)
    if isinstance(name, str):
        options = getattr(backend, "config", None)
        return name, dict(options) if isinstance(options, dict) else {}
    return str(getattr(backend, "__name__", type(backend).__name__)), {}


def _stored(graph: Any) -> list[StoredBuffer]:
    removed = set(graph.removed_buffers)
    found = []
    for buffer in graph.buffers:
        name = buffer.get_name()
        if name not in removed:
            try:
                found.extend(_read_buffer(name, buffer))
            except Exception as error:  # a buffer kind this torch lays out in a new way
                reason = f"{type(buffer).__name__}: {type(error).__name__}: {error}"
                found.append(StoredBuffer(name, None, None, (), reason[:200]))
    return found


def _read_buffer(name: str, buffer: Any) -> list[StoredBuffer]:
    from torch._inductor import ir

    layout = getattr(buffer, "layout", None)
    if isinstance(layout, ir.MultiOutputLayout):
        return []  # a tuple of other buffers (get_layout() raises on it)
    origins = tuple(sorted(o.name for o in buffer.get_origins()))
    if isinstance(layout, ir.NoneLayout):  # writes into another buffer (get_dtype() raises)
        return [StoredBuffer(name, None, None, origins)]
    getter = getattr(buffer, "get_origin_node", None)
    node = getter() if getter is not None else getattr(buffer, "origin_node", None)
    return [
        StoredBuffer(name, buffer.get_dtype(), node.name if node is not None else None, origins)
    ]


@contextlib.contextmanager
def _reading_stored(into: list[tuple[fx.GraphModule, list[StoredBuffer]]]) -> Iterator[None]:
    from torch._inductor.graph import GraphLowering

    original = GraphLowering.codegen

    def codegen(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        into.append((self.module, _stored(self)))
        return result

    with _LOCK:
        GraphLowering.codegen = codegen  # type: ignore[method-assign]
        try:
            yield
        finally:
            GraphLowering.codegen = original  # type: ignore[method-assign]


BufferPlan = Callable[[fx.GraphModule, list[StoredBuffer], CachedGraph | None], list[str]]
Recall = Callable[[CachedGraph], list[str] | None]
Observe = Callable[[str, Any], None]
Boxed = Callable[[list[Any]], Any]  # a compiled graph's callable: it takes its inputs as a list
Wrap = Callable[[Boxed, Boxed], Boxed]


def inductor_backward(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    kwargs: dict[str, Any],
    plan: BufferPlan,
    observe: Observe,
    wrap: Wrap,
    recall: Recall,
) -> Any:
    """Compile backward graph ``gm`` with Inductor exactly as ``torch.compile`` does (the
    same graph, so the same fusions, reductions and kernels; Inductor's FX graph cache
    as the user has it). Where the scheduler ran, ``plan(post_grad_graph, stored,
    cached)`` picks the buffer names to observe (``cached``: where the cache keeps the
    graph, None where it does not). A graph loaded from the cache ran no scheduler:
    ``recall(cached)`` gives the names fpaudit's plan picked for it before, and only
    where it has none is the graph compiled once more, with the cache off.
    A twin of the compiled wrapper function, run with the very kernels the compile made,
    calls ``observe(name, buffer)`` at the last moment each of those buffers holds its
    value (before it is freed, before its memory is reused, or before the function
    returns). ``wrap(plain, observed)`` builds the callable that runs, where the compiled
    graph kept ``plain``."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner

    lowered: list[tuple[fx.GraphModule, list[StoredBuffer]]] = []
    with _reading_stored(lowered):
        compiled = compile_fx_inner(gm, example_inputs, **kwargs)
    cached = _cached(compiled)
    names = None
    if not lowered:  # loaded from the cache: no scheduler ran
        names = recall(cached) if cached is not None else None
        if names is None:  # (a hit runs no pass on gm: it is the graph it was given)
            with config.patch(fx_graph_cache=False), _reading_stored(lowered):
                compiled = compile_fx_inner(gm, example_inputs, **kwargs)
            code = _code_digest(compiled)
            key = cached.key if cached is not None else None
            cached = CachedGraph(key, code) if key is not None and code is not None else None
    if names is None:
        names = plan(*lowered[-1], cached) if lowered else []
    if not names:
        return compiled
    plain = getattr(compiled, "current_callable", None)
    if plain is None:
        raise RuntimeError(
            f"fpaudit cannot observe this torch's compiled backward ({type(compiled).__name__}"
            " has no current_callable)"
        )
    compiled.current_callable = wrap(plain, _observed_twin(plain, names, observe))  # type: ignore[attr-defined]
    return compiled


def _code_digest(compiled: Any) -> str | None:
    """The SHA-256 of ``compiled``'s generated code, its ``# AOT ID: ['3_backward']``
    comment aside (a count of the process's compiles: a graph loaded from the cache
    keeps the number of the process that compiled it)."""
    source = getattr(compiled, "source_code", None)
    if not isinstance(source, str):
        return None
    code = "".join(
        line for line in source.splitlines(keepends=True) if not line.startswith("# AOT ID:")
    )
    return hashlib.sha256(code.encode()).hexdigest()


def _cached(compiled: Any) -> CachedGraph | None:
    """Where Inductor's FX graph cache keeps ``compiled`` (None: the cache is off, or
    the graph cannot be cached)."""
    key = getattr(compiled, "_fx_graph_cache_key", None)
    code = _code_digest(compiled)
    return CachedGraph(key, code) if isinstance(key, str) and code is not None else None


_DEL = re.compile(r"(?:^|;)\s*del\s+(\w+(?:\s*,\s*\w+)*)")
_REUSED = re.compile(r"^\s*\w+\s*=\s*(?:reinterpret_tensor\(\s*)?(\w+)\b.*#\s*reuse\s*$")
_ASSIGNED = re.compile(r"^\s*(\w+(?:\s*,\s*\w+)*)\s*,?\s*=(?!=)")
_RETURN = re.compile(r"^(\s*)return\b")


def _instrument(source: str, names: Sequence[str], hook: str) -> tuple[str, list[str]]:
    """``source`` (a compiled graph's straight-line wrapper function) with a call
    ``hook('bufN', bufN)`` before each line where a watched buffer's value is lost: its
    ``del``, the ``# reuse`` line that hands its memory to another buffer, and the
    ``return`` (every watched buffer still alive). Also the names it watches."""
    watched = set(names)
    seen: list[str] = []  # assigned so far, in order
    done: set[str] = set()
    lines = []
    for line in source.splitlines():
        indent = line[: len(line) - len(line.lstrip())]
        lost: list[str] = []
        returning = _RETURN.match(line)
        if returning:
            lost = [name for name in seen if name not in done]
        else:
            reused = _REUSED.match(line)
            if reused:
                lost.append(reused.group(1))
            for group in _DEL.findall(line):
                lost.extend(n.strip() for n in group.split(","))
        for name in dict.fromkeys(lost):
            if name in watched and name not in done and name in seen:
                lines.append(f"{indent}{hook}({name!r}, {name})")
                done.add(name)
        lines.append(line)
        assigned = _ASSIGNED.match(line)
        if assigned:
            for name in assigned.group(1).split(","):
                if name.strip() in watched and name.strip() not in seen:
                    seen.append(name.strip())
    return "\n".join(lines) + "\n", sorted(done)


def _observed_twin(
    plain: Callable[[list[Any]], Any], names: Sequence[str], observe: Observe
) -> Callable[[list[Any]], Any]:
    """The compiled graph's wrapper function ``plain`` (Inductor's ``call``, a function or
    a bound method of its ``Runner``), compiled again from its source with the observing
    calls of :func:`_instrument`, in its own module's globals (its kernels)."""
    function = getattr(plain, "__func__", plain)
    if not isinstance(function, types.FunctionType):
        raise RuntimeError(f"the compiled backward's callable is a {type(plain).__name__}")
    hook = f"fpaudit_observe_{id(observe):x}"
    source, watched = _instrument(textwrap.dedent(inspect.getsource(function)), names, hook)
    missing = sorted(set(names) - set(watched))
    if missing:
        raise RuntimeError(f"buffers {', '.join(missing)} are not named in its wrapper code")
    namespace: dict[str, Any] = {}
    code = compile(source, f"<fpaudit, observing {function.__code__.co_filename}>", "exec")
    function.__globals__[hook] = observe  # a name of its own: the plain function ignores it
    exec(code, function.__globals__, namespace)
    twin = namespace[function.__name__]
    bound = getattr(plain, "__self__", None)
    return types.MethodType(twin, bound) if bound is not None else twin


def graph_input_sources(gm: fx.GraphModule) -> list[str | None]:
    """Where Dynamo reads each input of graph ``gm`` from in the frame it compiled
    (``L['self']._modules['up']._parameters['weight']``, ``L['x']``), in the order the
    compiled frame is called with them; None where a graph input says nothing."""
    sources: list[str | None] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        source = getattr(node.meta.get("grapharg"), "source", None)
        name = getattr(source, "name", None)
        if callable(name):  # a method on older releases
            name = name()
        sources.append(name if isinstance(name, str) else None)
    return sources


BackwardCompiler = Callable[[fx.GraphModule, Sequence[Any], dict[str, Any]], Any]
FrameRun = Callable[..., Any]  # a compiled frame's callable, called with the frame's inputs


def compile_backend(
    frame: Callable[[fx.GraphModule], tuple[BackwardCompiler, Callable[[FrameRun], FrameRun]]],
    options: dict[str, Any],
    name: str,
) -> Callable[[fx.GraphModule, Sequence[Any]], Any]:
    """A ``torch.compile`` backend: Inductor (with ``options``, as its mode set them).
    For each graph Dynamo compiles, ``frame(gm)`` gives the compiler of its backward
    graphs, ``backward(gm, example_inputs, kwargs)``, and a wrapper of the compiled
    frame's callable (which Dynamo calls with the frame's inputs, then, as every
    backend's result, runs untraced)."""
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        backward, wrap = frame(gm)

        def inner(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
            if kwargs.get("is_backward"):
                return backward(gm, example_inputs, kwargs)
            return compile_fx_inner(gm, example_inputs, **kwargs)

        with functorch_config.patch(enable_autograd_cache=False):
            compiled = compile_fx(
                gm, example_inputs, inner_compile=inner, config_patches=options or None
            )
        if not callable(compiled):  # (an ahead-of-time compile's files)
            return compiled
        run = wrap(compiled)
        if run is not compiled:  # what AOTAutograd hangs on its callable (serialize, ...)
            for key, value in getattr(compiled, "__dict__", {}).items():
                if not key.startswith("_torchdynamo") and key != "__wrapped__":
                    setattr(run, key, value)
        return run

    backend.__name__ = backend.__qualname__ = name
    return backend


def plain_backward(
    gm: fx.GraphModule, example_inputs: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    """Compile backward graph ``gm`` as Inductor does, unobserved."""
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, example_inputs, **kwargs)


def mode_options(mode: str) -> dict[str, Any]:
    """The Inductor options a ``torch.compile`` mode sets."""
    import torch._inductor

    return dict(torch._inductor.list_mode_options(mode))


def cudagraphs_requested(kwargs: dict[str, Any]) -> bool:
    """Whether Inductor compiles this graph to run under CUDA graphs."""
    flag = kwargs.get("cudagraphs")
    return bool(getattr(flag, "value", flag))


def compile_arguments(model: nn.Module) -> tuple[bool, bool | None]:
    """What a ``torch.compile``d module was compiled with besides its backend:
    ``(fullgraph, dynamic)``, ``(False, None)`` being ``torch.compile``'s defaults."""
    context = getattr(model, "dynamo_ctx", None)
    fullgraph = getattr(context, "fullgraph", False) is True
    dynamic = getattr(context, "_dynamic", None)
    return fullgraph, dynamic if isinstance(dynamic, bool) else None


def inductor_cache_dir() -> str:
    """The folder Inductor caches compiled code in (``TORCHINDUCTOR_CACHE_DIR`` or its
    default); an OSError when it cannot be made."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return str(cache_dir())


def is_missing_compiler(error: BaseException) -> bool:
    """Whether Inductor failed because the machine has no working C++ compiler
    (``torch._inductor.exc.InvalidCxxCompiler``, raised or wrapped in an error it caused)."""
    if "torch._inductor.exc" not in sys.modules:
        return False  # Inductor never ran in this process
    from torch._inductor.exc import InvalidCxxCompiler

    seen: BaseException | None = error
    for _ in range(16):  # a chain of causes, not a loop
        if seen is None:
            return False
        if isinstance(seen, InvalidCxxCompiler) or "InvalidCxxCompiler" in str(seen)[:200]:
            return True
        seen = seen.__cause__ or seen.__context__
    return False
