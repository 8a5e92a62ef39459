"""The compiled histogram kernels: C++ for the CPU (built once per machine and torch
version, then cached) and Triton for GPUs.

``_histogram_kernel.cpp`` bins fp32 values in one pass (about 20x faster than
the pure-torch path on 2 cores). It is compiled with
``torch.utils.cpp_extension`` the first time it is needed (about a minute,
needs a C++ compiler) and cached in torch's extension directory
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``).

The same module computes block-scaled statistics (``block_stats``, every scale rule;
see :mod:`fpaudit.kernels.blockstats`, whose pure-torch paths are the
reference they are tested against).

On CUDA devices ``_triton_kernel.py`` bins in one read of every value when Triton
is installed (CUDA builds of torch bring it); Triton compiles it on first use.
``_triton_blocks.py`` computes block-scaled statistics there for the recipes whose
scale depends on its block alone (MX floor and round-up, pow2-floor); the others
keep the pure-torch path. Each Triton kernel that fails falls back alone, once.

``FPAUDIT_KERNEL`` chooses: ``auto`` (default: each compiled kernel where it
builds, otherwise the pure-torch path), ``cpp`` (the CPU kernel or an error),
``triton`` (the GPU kernel or an error) or ``torch`` (always the pure-torch path).
All paths give identical results; the tests prove it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

from fpaudit.errors import UsageError

ENV = "FPAUDIT_KERNEL"
MODES = ("auto", "cpp", "triton", "torch")
SOURCE = Path(__file__).with_name("_histogram_kernel.cpp")

_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None


def mode() -> str:
    raw = os.environ.get(ENV)
    if raw is None:  # asked once per histogram call: the common case first
        return "auto"
    value = raw.strip().lower() or "auto"
    if value not in MODES:
        raise UsageError(f"{ENV}={value!r} is not one of {', '.join(MODES)}")
    return value


def _name() -> str:
    # One build per source, torch and install: two installs (two venvs, two checkouts)
    # that shared a name rebuilt the kernel each time the other had loaded it, since the
    # build records its source's path; the interpreter's version keys the ABI.
    key = [SOURCE.read_bytes(), torch.__version__.encode(), str(SOURCE).encode()]
    key.append(sys.version.encode())
    digest = hashlib.sha256(b"\0".join(key)).hexdigest()[:12]
    return f"fpaudit_histogram_{digest}"


def is_built() -> bool:
    """True when the kernel is loaded or its cached build exists (no compile needed)."""
    if _module is not None:
        return True
    return any(_build_directory().glob(f"{_name()}*.so"))


def _build_directory() -> Path:
    from fpaudit.torch_internals import extension_build_directory

    return Path(extension_build_directory(_name()))


WAIT_ENV = "FPAUDIT_KERNEL_WAIT"  # seconds to wait for another process's build [600]


SETTLE = 5.0  # seconds for a lock with no compiler running to go (a load holds it briefly)


@contextlib.contextmanager
def _build_guard() -> Iterator[str | None]:
    """Hold ``fpaudit.flock`` in the build directory while torch loads or builds the kernel.

    torch's own build lock (``lock``, a file created with O_EXCL) has no owner: a build
    killed half-way leaves it behind, and every later ``load`` waits for it forever.
    Every fpaudit process loads under this flock, which the kernel releases when its
    holder dies. While we hold the flock, a ``lock`` is checked for an owner: a
    compiler running in the build directory (torch runs ninja there; an older
    fpaudit builds without the flock) is waited for; a lock that stays ``SETTLE``
    seconds with none was left by a killed build or load (a Ctrl-C during the first
    import): every process that loads from this directory holds the flock we hold, so
    its creator is gone, and the lock is removed and the load goes ahead (torch's
    ninja rebuilds whatever a killed build left half-done). Only a lock that cannot
    be removed sends this run to the pure-torch path (identical results, slower),
    said once. A build by another process is waited for up to
    ``FPAUDIT_KERNEL_WAIT`` seconds (default 600), then this run takes the pure-torch
    path. Yields None to go ahead, else why not (for :func:`failure`).
    """
    directory = _build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / "fpaudit.flock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        wait = float(os.environ.get(WAIT_ENV, "600"))
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield (
                        f"another process has been building it for over {wait:g} s "
                        f"({directory}); {WAIT_ENV} sets how long to wait"
                    )
                    return
                time.sleep(0.2)
        yield _stale_lock(directory / "lock", deadline, wait)
    finally:
        os.close(fd)


def _stale_lock(baton: Path, deadline: float, wait: float) -> str | None:
    """Why torch's build lock ``baton`` blocks the load, or None when it is gone or removed."""
    settle = time.monotonic() + SETTLE
    while baton.exists():
        now = time.monotonic()
        if _building_in(baton.parent):
            if now >= deadline:
                return (
                    f"another process has been building it for over {wait:g} s "
                    f"({baton.parent}); {WAIT_ENV} sets how long to wait"
                )
            settle = now + SETTLE
        elif now >= settle:
            break
        time.sleep(0.2)
    try:
        baton.unlink()
    except FileNotFoundError:
        return None
    except OSError as error:
        return (
            f"the build lock {baton} is held by no fpaudit process (a build or load was "
            f"killed half-way) and cannot be removed ({error.strerror}); delete it"
        )
    return None


def _building_in(directory: Path) -> bool:
    """True when a process works in ``directory`` (torch runs its compiler there).

    Linux only (``/proc``); elsewhere False, and a lock is judged by ``SETTLE`` alone.
    """
    target = str(directory.resolve())
    try:
        entries = os.listdir("/proc")
    except OSError:
        return False
    for entry in entries:
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/cwd") == target:
                    return True
    return False


def failure() -> str | None:
    """Why the kernel could not be built, if it could not."""
    return _failure


def cpu_kernel(on_build: Callable[[], None] | None = None) -> ModuleType | None:
    """The compiled kernel, or None when the pure-torch path is to be used.

    ``on_build`` is called before a compile starts (so a CLI can say why it waits).
    """
    global _module, _failure
    chosen = mode()
    if chosen == "torch":
        return None
    if _module is not None:
        return _module
    with _lock:
        if _module is None and _failure is None:
            try:
                with _build_guard() as blocked:
                    if blocked is not None:
                        _failure = blocked
                    else:
                        if on_build is not None and not is_built():
                            on_build()
                        from torch.utils.cpp_extension import load

                        _module = load(
                            name=_name(),
                            sources=[str(SOURCE)],
                            extra_cflags=["-O3", "-fopenmp"],
                            extra_ldflags=["-fopenmp"],
                            verbose=False,
                        )
            except Exception as error:  # no compiler, no headers, ...
                lines = str(error).strip().splitlines()
                _failure = lines[-1] if lines else type(error).__name__
    if _module is None and chosen == "cpp":
        raise UsageError(f"{ENV}=cpp but the CPU histogram kernel could not be built: {_failure}")
    return _module


class _TritonKernel:
    """One Triton kernel module for CUDA tensors: imported once, on first use, and given
    up for the pure-torch path when it cannot be imported or fails (``FPAUDIT_KERNEL=
    triton`` makes either an error instead; ``torch`` never imports it)."""

    def __init__(self, module: str, what: str) -> None:
        self.name, self.what = module, what
        self.module: ModuleType | None = None
        self.failure: str | None = None

    def get(self) -> ModuleType | None:
        chosen = mode()
        if chosen == "torch":
            return None
        if self.module is None and self.failure is None:
            with _lock:
                if self.module is None and self.failure is None:
                    try:
                        self.module = importlib.import_module(self.name)
                    except Exception as error:  # not installed, or too old for the kernel
                        self.failure = _first_line(error)
        if self.module is None and chosen == "triton":
            raise UsageError(f"{ENV}=triton but the {self.what} is unavailable: {self.failure}")
        return self.module

    def failed(self, error: Exception) -> None:
        """It failed to compile or launch: the pure-torch path from now on."""
        self.module, self.failure = None, _first_line(error)
        if mode() == "triton":
            raise UsageError(f"{ENV}=triton but the {self.what} failed: {self.failure}")


def _first_line(error: Exception) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0]


_HISTOGRAM = _TritonKernel("fpaudit.kernels._triton_kernel", "GPU histogram kernel")
_BLOCKS = _TritonKernel("fpaudit.kernels._triton_blocks", "GPU block-statistics kernel")


def device_kernel() -> ModuleType | None:
    """The Triton histogram kernel module for CUDA tensors, or None for the pure-torch path."""
    return _HISTOGRAM.get()


def device_kernel_failed(error: Exception) -> None:
    """The Triton histogram kernel failed to compile or launch: the pure-torch path from
    now on (``FPAUDIT_KERNEL=triton`` makes that an error instead)."""
    _HISTOGRAM.failed(error)


def device_failure() -> str | None:
    """Why the Triton histogram kernel is not used, if it is not."""
    return _HISTOGRAM.failure


def device_block_kernel() -> ModuleType | None:
    """The Triton block-statistics module for CUDA tensors, or None for the torch path."""
    return _BLOCKS.get()


def device_block_kernel_failed(error: Exception) -> None:
    """The Triton block kernel failed to compile or launch: the pure-torch path from now
    on (``FPAUDIT_KERNEL=triton`` makes that an error instead)."""
    _BLOCKS.failed(error)


def device_block_failure() -> str | None:
    """Why the Triton block kernel is not used, if it is not."""
    return _BLOCKS.failure
