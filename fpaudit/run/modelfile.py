"""Load a user's model file and check it against the contract.

A model file is plain Python that defines:

``model``
    an ``nn.Module``, or a zero-argument callable returning one;
``batches``
    an iterable of batches, or a zero-argument callable returning one;
``loss(model, batch)``
    returns a scalar floating-point tensor;
``optimizer(params)`` (optional)
    returns a ``torch.optim.Optimizer``; then every step also takes a real
    optimizer step, so the gradient distribution evolves as in training.

Every problem becomes a one-line :class:`~fpaudit.errors.ModelFileError`
naming the file (and the line, for exceptions raised by the user's code).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.machinery
import importlib.util
import inspect
import itertools
import operator
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from fpaudit._process import Owner
from fpaudit.errors import FpauditError, MissingTool, ModelExit, ModelFileError
from fpaudit.torch_internals_compile import is_missing_compiler

CONTRACT = {
    "model": "model = MyModel()  (an nn.Module, or a zero-argument callable returning one)",
    "batches": "batches = [...]  (an iterable of batches, or a zero-argument callable "
    "returning one)",
    "loss": "def loss(model, batch): return <scalar tensor>",
}

_END = object()

SCRIPTED = (
    "the model is a torch.jit.ScriptModule, whose modules cannot be hooked; "
    "audit the eager module (the one you passed to torch.jit.script)"
)


def where(error: BaseException, path: Path) -> str:
    """``file:line`` of the innermost frame of ``error`` inside ``path`` (else the last frame)."""
    if isinstance(error, SyntaxError):
        # Python names importlib's frame, not the file, for some errors (null bytes).
        named = error.filename and Path(error.filename).resolve() == path.resolve()
        return f"{error.filename}:{error.lineno}" if named else str(path)
    frames = traceback.extract_tb(error.__traceback__)
    resolved = str(path.resolve())
    inside = [f for f in frames if f.filename and Path(f.filename).resolve().as_posix() == resolved]
    candidates = inside or frames
    if not candidates:
        return str(path)
    return f"{candidates[-1].filename}:{candidates[-1].lineno}"


def a_type(value: object) -> str:
    """'an int', 'a float': the type of ``value`` with its article."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def describe(error: BaseException) -> str:
    message = str(error).strip().splitlines()
    text = message[0] if message else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


@contextmanager
def user_code(path: Path, what: str) -> Iterator[None]:
    """Turn any exception from the user's code into a one-line ModelFileError.

    ``sys.exit(n)`` (and ``os._exit(n)`` under :func:`exits_caught`) is an error too:
    model code cannot end an audit with a quiet success.
    """
    try:
        yield
    except (FpauditError, KeyboardInterrupt):
        raise
    except SystemExit as error:
        call = "os._exit" if isinstance(error, HardExit) else "sys.exit"
        raise ModelExit(
            f"{where(error, path)}: {what} called {call}({error.code!r}); model code must "
            "not end the process"
        ) from None
    except Exception as error:
        if is_missing_compiler(error):  # the machine's fault, not the model's
            raise MissingTool(
                "no C++ compiler found: torch.compile (Inductor) needs one to compile the "
                f"model ({describe(error)[:200]}); install one or point CXX at it"
            ) from None
        raise ModelFileError(f"{where(error, path)}: {what} raised {describe(error)}") from error


class HardExit(SystemExit):
    """``os._exit`` called by user code in the audit's own process (see ``exits_caught``)."""


@contextmanager
def exits_caught() -> Iterator[None]:
    """Make ``os._exit(n)`` from user code raise :class:`HardExit` in this process.

    ``os._exit`` ends a process at once: no exception, no ``finally``, no atexit, so
    nothing in-process can keep a report after it. Inside this block the audit's own
    process gets an exception instead, which the caller reports (and keeps the
    completed steps). A forked child (a DataLoader worker, a script's own
    ``os.fork``) still exits for real: its pid differs from the one recorded here.
    A C extension calling ``_exit(2)`` directly cannot be intercepted.
    """
    owner, real = Owner(), os._exit
    signature = inspect.signature(real)  # (status): by position or keyword, as os._exit takes it

    @functools.wraps(real)
    def fake_exit(*args: Any, **kwargs: Any) -> NoReturn:
        try:
            status = signature.bind(*args, **kwargs).arguments["status"]
        except TypeError:
            real(*args, **kwargs)  # os._exit's own TypeError: a call it rejects never exits
        if not owner.here():
            real(*args, **kwargs)  # a forked child exits for real
        raise HardExit(operator.index(status))  # os._exit's TypeError for a non-integer

    os._exit = fake_exit
    try:
        yield
    finally:
        os._exit = real


@dataclass
class ModelFile:
    """A loaded model file. ``batches()`` gives a fresh iterator each call."""

    path: Path
    model: nn.Module
    loss: Callable[[nn.Module, Any], Any]
    make_batches: Callable[[], Iterable[Any]]
    reiterable: bool
    make_optimizer: Callable[[Any], torch.optim.Optimizer] | None

    def optimizer(self, params: Iterable[Any]) -> torch.optim.Optimizer | None:
        """The file's ``optimizer(params)``, checked; None when the file defines none."""
        if self.make_optimizer is None:
            return None
        with user_code(self.path, "optimizer(params)"):
            optimizer = self.make_optimizer(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ModelFileError(
                f"{self.path}: optimizer(params) returned {a_type(optimizer)}; "
                "expected a torch.optim.Optimizer"
            )
        return optimizer

    def batches(self, steps: int) -> Iterator[Any]:
        """Batches for ``steps`` steps, restarting the source when it can be restarted."""
        produced = 0
        for epoch in itertools.count():
            with user_code(self.path, "iterating `batches`"):
                iterator = iter(self.make_batches())
            empty = True
            while produced < steps:
                with user_code(self.path, "iterating `batches`"):
                    batch = next(iterator, _END)
                if batch is _END:
                    break
                empty = False
                produced += 1
                yield batch
            if produced >= steps:
                return
            if empty and epoch == 0:
                raise ModelFileError(f"{self.path}: `batches` yielded no batches")
            if empty or not self.reiterable:
                return


def _import(path: Path) -> Any:
    if not path.exists():
        raise ModelFileError(f"model file {path} does not exist")
    if not path.is_file():
        raise ModelFileError(f"model file {path} is not a file")
    try:
        path.open("rb").close()
    except OSError as error:
        raise ModelFileError(f"cannot read model file {path}: {error.strerror}") from None
    name = f"_fpaudit_model_{abs(hash(path.resolve()))}"
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(name, loader)
    if spec is None:  # pragma: no cover - SourceFileLoader always gives a spec
        raise ModelFileError(f"cannot import model file {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up here
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        loader.exec_module(module)
    except SyntaxError as error:
        sys.modules.pop(name, None)
        raise ModelFileError(f"{where(error, path)}: syntax error: {error.msg}") from None
    except (FpauditError, KeyboardInterrupt):
        sys.modules.pop(name, None)
        raise
    except BaseException as error:
        sys.modules.pop(name, None)
        if isinstance(error, SystemExit):
            call = "os._exit" if isinstance(error, HardExit) else "sys.exit"
            raise ModelExit(
                f"{path}: importing the model file called {call}({error.code})"
            ) from None
        raise ModelFileError(
            f"{where(error, path)}: importing the model file raised {describe(error)}"
        ) from error
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    return module


def _require(module: Any, path: Path, name: str) -> Any:
    if not hasattr(module, name):
        raise ModelFileError(f"{path} does not define `{name}`; expected: {CONTRACT[name]}")
    return getattr(module, name)


def load(path: str | Path) -> ModelFile:
    """Import ``path`` and check the contract; raise ModelFileError on any problem."""
    path = Path(path)
    module = _import(path)
    model = _require(module, path, "model")
    batches = _require(module, path, "batches")
    loss = _require(module, path, "loss")
    optimizer = getattr(module, "optimizer", None)

    if not isinstance(model, nn.Module):
        if not callable(model):
            raise ModelFileError(
                f"{path}: `model` is {a_type(model)}; expected {CONTRACT['model']}"
            )
        with user_code(path, "model()"):
            model = model()
        if not isinstance(model, nn.Module):
            raise ModelFileError(f"{path}: model() returned {a_type(model)}; expected an nn.Module")
    if isinstance(model, torch.jit.ScriptModule):
        raise ModelFileError(f"{path}: {SCRIPTED}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelFileError(f"{path}: the model has no parameters that require grad")

    if isinstance(batches, Iterable):
        source = batches
        reiterable = iter(source) is not source
        make_batches: Callable[[], Iterable[Any]] = lambda: source  # noqa: E731
    elif callable(batches):
        factory = batches
        reiterable = True

        def make_batches() -> Iterable[Any]:
            produced = factory()
            if not isinstance(produced, Iterable):
                raise ModelFileError(
                    f"{path}: batches() returned {a_type(produced)}; expected an iterable"
                )
            return produced

    else:
        raise ModelFileError(
            f"{path}: `batches` is {a_type(batches)}; expected {CONTRACT['batches']}"
        )

    if not callable(loss):
        raise ModelFileError(f"{path}: `loss` is {a_type(loss)}; expected {CONTRACT['loss']}")
    if optimizer is not None and not callable(optimizer):
        raise ModelFileError(
            f"{path}: `optimizer` is {a_type(optimizer)}; "
            "expected def optimizer(params): return torch.optim.SGD(params, lr=...)"
        )
    return ModelFile(path, model, loss, make_batches, reiterable, optimizer)


def check_loss(value: Any, path: Path) -> torch.Tensor:
    """The loss must be a floating-point tensor with one element that requires grad."""
    if not isinstance(value, torch.Tensor):
        raise ModelFileError(
            f"{path}: loss(model, batch) returned {a_type(value)}; expected a scalar tensor"
        )
    if value.numel() != 1:
        shape = list(value.shape)
        raise ModelFileError(
            f"{path}: loss(model, batch) returned a tensor of shape {shape}; expected a scalar "
            "(reduce it, e.g. with .mean())"
        )
    if not value.is_floating_point():
        raise ModelFileError(
            f"{path}: loss(model, batch) returned a {value.dtype} tensor; "
            "expected a floating-point one"
        )
    if not value.requires_grad:
        raise ModelFileError(
            f"{path}: the loss does not require grad; it must be computed from the model's "
            "parameters with autograd enabled"
        )
    return value.reshape(())


def move_to(batch: Any, device: torch.device) -> Any:
    """Move the tensors in ``batch`` to ``device``: in any ``Mapping`` (``dict``,
    ``defaultdict``, ``OrderedDict``, Hugging Face's ``BatchEncoding``), list, tuple,
    named tuple or dataclass, and objects with a ``.to()``. Containers keep their type
    (a mapping its default factory and key order) where they can be copied."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        moved = {k: move_to(v, device) for k, v in batch.items()}
        if isinstance(batch, MutableMapping):
            try:
                copied = copy.copy(batch)
                copied.update(moved)
                return copied
            except Exception:  # a mapping that cannot be copied: a plain dict will do
                pass
        return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_to(v, device) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(move_to(v, device) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = {
            f.name: move_to(getattr(batch, f.name), device)
            for f in dataclasses.fields(batch)
            if f.init
        }
        return dataclasses.replace(batch, **fields)
    to = getattr(batch, "to", None)
    if callable(to):
        return to(device)
    return batch
