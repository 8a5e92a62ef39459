"""The dispatch mode is on only while the autograd engine runs: fpaudit wraps the
engine's one private entry (``torch_internals.wrap_engine_entry``), so forward pays no
dispatch overhead. The wrapper also tells the mode whether grad mode in backward means
recomputation (no ``create_graph``) and when a backward runs inside a backward."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from fpaudit import torch_internals as _internals
from fpaudit.errors import MonitorFailure

if TYPE_CHECKING:
    from fpaudit.capture.context import CaptureContext
    from fpaudit.capture.mode import BackwardMode

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


def activate_during_backward(
    mode: BackwardMode, context: CaptureContext
) -> Callable[[], None] | None:
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
                    mode.enter_nested(_internals.current_autograd_node())
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
            context.backward_started(create_graph)
            try:
                with mode:
                    return original(*args, **kwargs)
            finally:
                depth.n = 0
                context.backward_ended()
                mode.forget_node()

        return run_backward

    return _internals.wrap_engine_entry(make)
