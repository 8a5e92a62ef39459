"""``torch.compile``'s internals, read in this one place: every name below may move.

``fpaudit.capture.compiled`` observes what Inductor's compiled backward stores. It needs to
know which buffers Inductor's scheduler really writes to memory (the rest stay in a
fused kernel's registers) and to add those values to the backward graph's outputs.
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
* ``torch._inductor.config``: ``post_grad_custom_post_pass`` (fpaudit's pass adds the
  stored values to the backward graph's outputs), ``fx_graph_cache`` (off, so a cached
  graph never skips the pass).
* ``torch._functorch.config.enable_autograd_cache``: off while fpaudit compiles, so a
  cached forward/backward pair never skips fpaudit's backward compiler.
* ``CompiledFxGraph.current_callable``: the compiled backward's boxed callable, which
  fpaudit wraps to take its extra outputs off.
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
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

__all__ = [
    "StoredBuffer",
    "compile_backend",
    "compiled_module_parts",
    "context_backend",
    "eager_module",
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
def _reading_stored(into: list[list[StoredBuffer]]) -> Iterator[None]:
    from torch._inductor.graph import GraphLowering

    original = GraphLowering.codegen

    def codegen(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        into.append(_stored(self))
        return result

    with _LOCK:
        GraphLowering.codegen = codegen  # type: ignore[method-assign]
        try:
            yield
        finally:
            GraphLowering.codegen = original  # type: ignore[method-assign]


BufferPlan = Callable[[fx.GraphModule, list[StoredBuffer]], list[str]]
Wrap = Callable[[Callable[[list[Any]], Any], int], Callable[[list[Any]], Any]]


def inductor_backward(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    kwargs: dict[str, Any],
    plan: BufferPlan,
    wrap: Wrap,
) -> Any:
    """Compile backward graph ``gm`` with Inductor so that every value it stores is also
    handed out: a first compile (of a copy) tells which FX nodes' values Inductor stores;
    ``plan(post_grad_graph, stored)`` picks the node names to observe; the second compile
    adds them to the graph's outputs, and ``wrap(callable, n)`` wraps the compiled
    callable, whose first ``n`` outputs are the graph's own."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner

    stored: list[list[StoredBuffer]] = []
    post_grad: list[fx.GraphModule] = []

    def keep(graph: fx.Graph) -> None:
        post_grad.append(copy.deepcopy(graph.owning_module))  # type: ignore[arg-type]

    with (
        config.patch(fx_graph_cache=False, post_grad_custom_post_pass=keep),
        _reading_stored(stored),
    ):
        compile_fx_inner(copy.deepcopy(gm), example_inputs, **kwargs)
    observed = plan(post_grad[-1], stored[-1]) if stored and post_grad else []
    original_outputs: list[int] = []

    def add_outputs(graph: fx.Graph) -> None:
        nodes = {n.name: n for n in graph.nodes}
        output = next(n for n in graph.nodes if n.op == "output")
        outputs = list(output.args[0])
        original_outputs.append(len(outputs))
        output.args = (outputs + [nodes[name] for name in observed if name in nodes],)

    with config.patch(fx_graph_cache=False, post_grad_custom_post_pass=add_outputs):
        compiled = compile_fx_inner(gm, example_inputs, **kwargs)
    if original_outputs and observed:
        callable_ = getattr(compiled, "current_callable", None)
        if callable_ is None:  # the extra outputs must not reach AOTAutograd
            raise RuntimeError(
                f"fpaudit cannot observe this torch's compiled backward ({type(compiled).__name__}"
                " has no current_callable)"
            )
        compiled.current_callable = wrap(callable_, original_outputs[-1])  # type: ignore[attr-defined]
    return compiled


def compile_backend(
    backward: Callable[[fx.GraphModule, Sequence[Any], dict[str, Any]], Any],
    options: dict[str, Any],
    name: str,
) -> Callable[[fx.GraphModule, Sequence[Any]], Any]:
    """A ``torch.compile`` backend: Inductor (with ``options``, as its mode set them),
    whose backward graphs ``backward(gm, example_inputs, kwargs)`` compiles."""
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        if kwargs.get("is_backward"):
            return backward(gm, example_inputs, kwargs)
        return compile_fx_inner(gm, example_inputs, **kwargs)

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        with functorch_config.patch(enable_autograd_cache=False):
            return compile_fx(
                gm, example_inputs, inner_compile=inner, config_patches=options or None
            )

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
