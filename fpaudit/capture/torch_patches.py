"""Every change ``fpaudit run`` makes to torch, and every private torch name it reads.

``fpaudit run`` watches an unmodified training script (see ``training``). This
module is the one room where that reaches into torch; ``training`` decides what
the calls mean and never touches torch's internals itself.

**Patched** while ``install`` is in force, each put back when its stack closes:

* ``torch.amp.GradScaler.scale``, ``.unscale_``, ``.step``, ``.update``
  (``torch.cuda.amp.GradScaler`` is a subclass): the loss scale in use, the
  unscale, the inf check of each step, the end of a step;
* ``torch.autograd.backward`` (what ``Tensor.backward`` calls): backward calls,
  the loss when no scaler sees it;
* ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` (in ``torch.nn.utils``
  and ``torch.nn.utils.clip_grad``) and ``torch.nn.utils.clip_grads_with_norm_``:
  clipping of still-scaled gradients, the norm;
* ``torch.optim.Optimizer.zero_grad`` and ``torch.nn.Module.zero_grad``: a new
  accumulated batch starts;
* ``step`` of ``LRScheduler`` and of every scheduler class in torch that defines
  its own: schedulers that step on a skipped step;
* ``torch.Tensor.grad`` (a property over the C descriptor): the script's reads of
  still-scaled gradients.

**Patched by a training framework's callback** (``fpaudit.integrations``) while one
step is audited (``step_targets``, held by a :class:`Patches`): ``torch.autograd.backward``
and the clip functions as above, and ``unscale_`` of the step's one scaler object.

Every wrapper (``wrap``) has the original's signature (``functools.wraps``), reads
its arguments through ``inspect.signature(original).bind`` with the defaults
applied, calls the original with the very arguments it was given and returns its
value unchanged. A call the original's signature does not accept goes straight to
the original, so the script sees torch's own ``TypeError``. An exception raised by
fpaudit's code around the call becomes ``MonitorFailure``, which the script cannot
catch as its own (a ``BaseException``) and ``run_script`` reports as fpaudit's.

**Global hooks** (public APIs, removed with the stack): optimizer step pre/post
hooks (``torch.optim.optimizer.register_optimizer_step_*_hook``) and module
forward pre/post hooks (``torch.nn.modules.module.register_module_forward_*``),
which ``torch.compile``'s compiled modules are told to overlook when they warn of
global hooks (``torch_internals.own_global_hooks_hidden``). Nothing is put on a
module of the script's: the capture's module clock is fed by these hooks too.

**Private names read**: none here. The scale in force, the configured initial
scale, a step's inf checks, a scheduler's step count, the ``Tensor.grad``
descriptor and ``torch._foreach_norm`` are read through ``torch_internals``, the
one module that reads private torch (its docstring lists each name).

Known limitations: a scaler subclass that overrides ``scale``/``unscale_``/``step``/
``update`` without calling ``GradScaler``'s is not seen; nor is an optimizer or
module class that overrides ``zero_grad`` without calling the base one.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Protocol

import torch
from torch import nn

from fpaudit import torch_internals as _internals
from fpaudit.errors import MonitorFailure
from fpaudit.report.runinfo import ScalerInfo

__all__ = [
    "Call",
    "MonitorFailure",
    "Patches",
    "Watcher",
    "amax",
    "found_inf",
    "gradient_maxima",
    "install",
    "raw_grad",
    "replace",
    "scaler_enabled",
    "scaler_scale",
    "scaler_settings",
    "scheduler_initial_step",
    "step_targets",
    "targets",
    "wrap",
]

_BASE_GRAD: Any = _internals.grad_descriptor()  # the C getset descriptor of Tensor.grad


@dataclass
class Call:
    """One call of a patched function, as its handler sees it."""

    name: str  # e.g. "GradScaler.scale"
    arguments: dict[str, Any]  # by the original's parameter names, defaults applied
    result: Any = None  # what the original returned (set before the handler resumes)
    extra: dict[str, Any] = field(default_factory=dict)


Handler = Callable[[Call], AbstractContextManager[Any]]


def wrap(original: Callable[..., Any], name: str, handler: Handler) -> Callable[..., Any]:
    """``original`` with ``handler`` around each call, and nothing else changed.

    ``handler(call)`` is a context manager entered before the original runs and
    exited after it (with the original's exception, if any): it observes, it never
    changes the arguments or the result."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # torch's own error for a wrong call
        bound.apply_defaults()
        call = Call(name, dict(bound.arguments))
        context = handler(call)
        try:
            context.__enter__()
        except Exception as error:
            raise MonitorFailure(f"before {name}()", error) from error
        try:
            result = original(*args, **kwargs)
        except BaseException as error:
            try:
                context.__exit__(type(error), error, error.__traceback__)
            except Exception as failure:
                if failure is not error:
                    raise MonitorFailure(f"after {name}() raised", failure) from failure
            raise
        call.result = result
        try:
            context.__exit__(None, None, None)
        except Exception as error:
            raise MonitorFailure(f"after {name}()", error) from error
        return result

    return wrapper


def guarded(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (fpaudit's hook) with its own errors reported as fpaudit's."""

    @functools.wraps(function)
    def hook(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except Exception as error:
            raise MonitorFailure(name, error) from error

    return hook


class Watcher(Protocol):
    """What ``install`` reports to: the training monitor."""

    def on_scale(self, call: Call) -> AbstractContextManager[Any]: ...
    def on_unscale(self, call: Call) -> AbstractContextManager[Any]: ...
    def on_scaler_step(self, call: Call) -> AbstractContextManager[Any]: ...
    def on_update(self, call: Call) -> AbstractContextManager[Any]: ...
    def on_backward(self, call: Call) -> AbstractContextManager[Any]: ...
    def on_clip(self, call: Call) -> AbstractContextManager[Any]: ...
    def on_zero_grad(self, call: Call) -> AbstractContextManager[Any]: ...
    def on_scheduler_step(self, call: Call) -> AbstractContextManager[Any]: ...
    def on_grad_read(self, caller: FrameType) -> None: ...
    def optimizer_pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None: ...
    def optimizer_post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None: ...
    def forward_pre_hook(self, module: nn.Module, args: Any) -> None: ...
    def forward_hook(self, module: nn.Module, args: Any, output: Any) -> None: ...


def targets() -> list[tuple[Any, str, str]]:
    """Every function or method ``install`` wraps: (owner, attribute, handler name)."""
    scaler = torch.amp.GradScaler
    found: list[tuple[Any, str, str]] = [
        (scaler, "scale", "on_scale"),
        (scaler, "unscale_", "on_unscale"),
        (scaler, "step", "on_scaler_step"),
        (scaler, "update", "on_update"),
        *_backward_and_clip(),
    ]
    found.append((torch.optim.Optimizer, "zero_grad", "on_zero_grad"))
    found.append((nn.Module, "zero_grad", "on_zero_grad"))
    found.extend((cls, "step", "on_scheduler_step") for cls in _scheduler_classes())
    return found


def step_targets(scaler: Any) -> list[tuple[Any, str, str]]:
    """What a framework callback wraps while one step is audited (owner, attribute,
    handler name): ``torch.autograd.backward`` and the clip functions as ``targets``
    lists them, and ``unscale_`` of ``scaler`` itself (an attribute of that one object)
    when it scales."""
    found = _backward_and_clip()
    if scaler_enabled(scaler) and callable(getattr(scaler, "unscale_", None)):
        found.append((scaler, "unscale_", "on_unscale"))
    return found


def _backward_and_clip() -> list[tuple[Any, str, str]]:
    found: list[tuple[Any, str, str]] = [(torch.autograd, "backward", "on_backward")]
    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        for name in ("clip_grad_norm_", "clip_grad_value_"):
            if getattr(module, name, None) is not None:
                found.append((module, name, "on_clip"))
    # torch >= 2.6's two-part clipping (get_total_norm, then clip_grads_with_norm_), as
    # accelerate >= 1.16 clips. Only the public name: clip_grad_norm_ calls the module's
    # private _clip_grads_with_norm_, so one clip is never seen twice.
    if getattr(torch.nn.utils, "clip_grads_with_norm_", None) is not None:
        found.append((torch.nn.utils, "clip_grads_with_norm_", "on_clip"))
    return found


def install(stack: ExitStack, watcher: Watcher, *, grad_reads: bool = True) -> None:
    """Patch torch for ``watcher`` until ``stack`` closes."""
    for owner, attribute, handler in targets():
        original = vars(owner)[attribute]
        wrapper = wrap(original, _label(owner, attribute), getattr(watcher, handler))
        stack.callback(replace(owner, attribute, wrapper))
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    pre, post = watcher.optimizer_pre_hook, watcher.optimizer_post_hook
    stack.enter_context(register_optimizer_step_pre_hook(guarded("optimizer step hook", pre)))
    stack.enter_context(register_optimizer_step_post_hook(guarded("optimizer step hook", post)))
    forward_pre = guarded("module forward hook", watcher.forward_pre_hook)
    pre_handle = stack.enter_context(register_module_forward_pre_hook(forward_pre))
    forward = guarded("module forward hook", watcher.forward_hook)
    handle = stack.enter_context(register_module_forward_hook(forward, always_call=True))
    # torch.compile warns of global module hooks at each compiled module's call: of the
    # script's own, not of these two (the script's stderr stays its own)
    restore = _internals.own_global_hooks_hidden(frozenset({pre_handle.id, handle.id}))
    if restore is not None:
        stack.callback(restore)
    if grad_reads:
        stack.enter_context(_watch_grad_reads(watcher))


@contextmanager
def _watch_grad_reads(watcher: Watcher) -> Iterator[None]:
    """``Tensor.grad`` as a property that tells ``watcher`` of each read (with the
    reader's frame) and otherwise behaves as the C descriptor."""
    import sys

    def get(tensor: torch.Tensor) -> torch.Tensor | None:
        grad: torch.Tensor | None = _BASE_GRAD.__get__(tensor)
        if grad is not None:
            try:
                watcher.on_grad_read(sys._getframe(1))
            except Exception as error:
                raise MonitorFailure("Tensor.grad", error) from error
        return grad

    def set_(tensor: torch.Tensor, value: torch.Tensor | None) -> None:
        _BASE_GRAD.__set__(tensor, value)

    def delete(tensor: torch.Tensor) -> None:
        _BASE_GRAD.__delete__(tensor)

    torch.Tensor.grad = property(get, set_, delete, _BASE_GRAD.__doc__)  # type: ignore[assignment]  # typed as the tensor it gives, not the descriptor
    try:
        yield
    finally:
        del torch.Tensor.grad


# -- reads of torch's state -----------------------------------------------------
def raw_grad(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor.grad`` without the patched property (not a read by the script)."""
    grad: torch.Tensor | None = _BASE_GRAD.__get__(tensor)
    return grad


def scaler_enabled(scaler: Any) -> bool:
    """Is ``scaler`` a GradScaler that scales (False for None or a disabled one)?"""
    enabled = getattr(scaler, "is_enabled", None)
    return callable(enabled) and bool(enabled())


def scaler_scale(scaler: Any) -> torch.Tensor | None:
    """The scale in force as a 0-dim device tensor (no host sync); None before first use."""
    return _internals.scaler_scale(scaler)


def scaler_settings(scaler: Any) -> ScalerInfo:
    """The class and settings of the ``GradScaler`` ``scaler`` (meta.json's ``scaler``)."""
    return ScalerInfo(
        scaler_class=f"{type(scaler).__module__}.{type(scaler).__qualname__}",
        init_scale=_internals.scaler_init_scale(scaler),
        growth_factor=float(scaler.get_growth_factor()),
        backoff_factor=float(scaler.get_backoff_factor()),
        growth_interval=int(scaler.get_growth_interval()),
    )


def found_inf(scaler: Any, optimizer: Any) -> torch.Tensor | None:
    """The number of devices whose gradients held inf/NaN at ``scaler.step(optimizer)``,
    a 0-dim tensor (no sync); None if the step did not check."""
    values = _internals.scaler_found_inf(scaler, optimizer)
    if not values:
        return None
    total: torch.Tensor = values[0].reshape(()).float()
    for value in values[1:]:
        total = total + value.to(total.device, non_blocking=True).reshape(()).float()
    return total


def scheduler_initial_step(scheduler: Any) -> bool:
    """The scheduler's constructor is making its own first ``step()``."""
    return _internals.scheduler_step_count(scheduler) == 0


def gradient_maxima(grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """``max |g|`` of each strided floating gradient of ``grads`` as one float32 vector on
    the first one's device (one multi-tensor launch per device, no sync), and the
    positions in ``grads`` it covers; None if there is none."""
    kept = [i for i, g in enumerate(grads) if g.layout == torch.strided and g.is_floating_point()]
    if not kept:
        return None
    by_device: dict[torch.device, list[int]] = {}
    for i in kept:
        by_device.setdefault(grads[i].device, []).append(i)
    first = grads[kept[0]].device
    parts, order = [], []
    for device, positions in by_device.items():
        maxima = _internals.foreach_amax([grads[i] for i in positions])
        stacked = torch.stack([m.float() for m in maxima])
        parts.append(stacked if device == first else stacked.to(first, non_blocking=True))
        order += positions
    vector = parts[0] if len(parts) == 1 else torch.cat(parts)
    if len(by_device) > 1:  # back to the order of ``grads``
        back = sorted(range(len(order)), key=order.__getitem__)
        vector = vector[torch.tensor(back, device=first)]
    return vector, kept


def amax(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """The largest ``|g|`` over ``grads`` as a 0-dim tensor (no sync); None if none."""
    found = gradient_maxima(grads)
    return None if found is None else found[0].max()


# -- patching ---------------------------------------------------------------------
def _scheduler_classes() -> list[type]:
    """LRScheduler and every scheduler class in torch that defines its own ``step``."""
    from torch.optim import lr_scheduler

    base = lr_scheduler.LRScheduler
    found: list[type] = [base]
    for value in vars(lr_scheduler).values():
        subclass = isinstance(value, type) and issubclass(value, base) and value is not base
        if subclass and "step" in value.__dict__:
            found.append(value)
    return found


def _label(owner: Any, name: str) -> str:
    """How a wrapper names what it wraps in a failure (``GradScaler.step``); an object
    without a ``__name__`` (one scaler) by its class."""
    return f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"


def replace(owner: Any, name: str, value: Any, *, keep_newer: bool = False) -> Callable[[], None]:
    """Set ``owner.name = value``; return the call that puts back what ``owner`` held
    itself, or deletes the attribute when it was inherited (an instance attribute over
    its class's method). ``keep_newer``: put nothing back once ``owner.name`` holds
    something else (a newer replacement, or an outer patch already put back)."""
    held = getattr(owner, "__dict__", {})
    own = name in held
    previous = held.get(name)
    setattr(owner, name, value)

    def restore() -> None:
        if keep_newer and getattr(owner, name, None) is not value:
            return
        if own:
            setattr(owner, name, previous)
        else:
            delattr(owner, name)

    return restore


class Patches:
    """A framework callback's wrappers (``step_targets``), put back by :meth:`restore`
    when the audited step closes, each only if it still holds its wrapper (``keep_newer``:
    an outer patch of the same name, put back first, is not brought back)."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, handler: Handler) -> None:
        """Wrap ``owner.name`` (see :func:`wrap`) with ``handler`` until :meth:`restore`."""
        wrapper = wrap(getattr(owner, name), _label(owner, name), handler)
        self._undo.append(replace(owner, name, wrapper, keep_newer=True))

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()

    def __bool__(self) -> bool:
        return bool(self._undo)
