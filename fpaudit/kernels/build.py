"""The compiled histogram kernels: C++ for the CPU (built once per environment, then
cached) and Triton for GPUs.

``_histogram_kernel.cpp`` bins fp32, fp16, bf16 and fp8 values in their own dtype
(16-bit and 8-bit values by their bit pattern, fp32 by its top 16 bits or raw bins,
folded once per call;
``docs/performance.md`` has its cost against one read). It is compiled with
``torch.utils.cpp_extension`` the first time it is needed (about a minute,
needs a C++ compiler) and cached in torch's extension directory
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), under a name keyed
by everything that changes the build (the source and its path, torch, Python and its
prefix, the include paths, the compiler and the flags): each environment builds once,
and two environments sharing a checkout never rebuild each other's kernel.

A build records the library's size and SHA-256 beside it; a library that does not
match its record (cut short by a full disk or a partial cache restore: loading it
would die of SIGBUS) is never loaded: it is removed and rebuilt, said in one line. A
library that matches is imported directly, without torch's build step (no compiler
needed). With no C++ compiler, a kernel that is not built yet is not attempted: one
line says so and the pure-torch path runs.

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
import importlib.util
import json
import os
import shlex
import shutil
import sys
import sysconfig
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


CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)
BUILD_NOTE = "building fpaudit's CPU kernel, about a minute, once per environment"
"""The one line said before a build starts (``FPAUDIT_KERNEL=torch`` skips the kernel)."""
RECORD_SUFFIX = ".fpaudit-record"  # beside the library: its size and SHA-256 at build time


def compiler_command() -> str:
    """The C++ compiler torch's build runs: ``CXX``, else ``c++``."""
    return os.environ.get("CXX", "").strip() or "c++"


def compiler_path() -> str | None:
    """The compiler's resolved executable, or None when there is none on ``PATH``."""
    words = shlex.split(compiler_command()) or ["c++"]
    found = shutil.which(words[0])
    return os.path.realpath(found) if found is not None else None


def _compiler_key() -> bytes:
    """The compiler as a build depends on it: its command, resolved file, size and time
    (an upgraded compiler is another file or another time)."""
    path = compiler_path()
    if path is None:
        return compiler_command().encode()
    with contextlib.suppress(OSError):
        stat = os.stat(path)
        return f"{compiler_command()}\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    return path.encode()


def _key_parts() -> list[bytes]:
    """Everything that changes the build. Two installs (two venvs, two checkouts) that
    shared a name rebuilt the kernel each time the other had loaded it, since the build
    records its source's path, include paths and compiler."""
    from torch.utils.cpp_extension import include_paths

    return [
        SOURCE.read_bytes(),
        str(SOURCE).encode(),
        torch.__version__.encode(),
        sys.version.encode(),  # the interpreter keys the ABI
        sys.prefix.encode(),
        sys.base_prefix.encode(),
        "\0".join([*include_paths(), sysconfig.get_paths()["include"]]).encode(),
        _compiler_key(),
        "\0".join([*CFLAGS, "|", *LDFLAGS]).encode(),
    ]


def _name() -> str:
    """The kernel's build name: one per environment (:func:`_key_parts`)."""
    digest = hashlib.sha256(b"\1".join(_key_parts())).hexdigest()[:12]
    return f"fpaudit_histogram_{digest}"


def is_built() -> bool:
    """True when the kernel is loaded or its cached build exists and matches its record
    (no compile needed)."""
    if _module is not None:
        return True
    return any(_mismatch(library) is None for library in _libraries())


def _libraries() -> list[Path]:
    return sorted(_build_directory().glob(f"{_name()}*.so"))


def _digest(path: Path) -> tuple[int, str]:
    """A file's size and SHA-256."""
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            sha.update(block)
            size += len(block)
    return size, sha.hexdigest()


def _record_path(library: Path) -> Path:
    return library.with_name(library.name + RECORD_SUFFIX)


def _write_record(library: Path) -> None:
    """Record a library just built (its size and SHA-256), atomically: a record is whole
    or absent."""
    size, sha = _digest(library)
    record = _record_path(library)
    staged = record.with_name(f".{record.name}.{os.getpid()}")
    with open(staged, "w") as file:
        json.dump({"size": size, "sha256": sha}, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(staged, record)


def _mismatch(library: Path) -> str | None:
    """Why ``library`` does not match its build record, or None when it does."""
    try:
        recorded = json.loads(_record_path(library).read_text())
        size, sha = int(recorded["size"]), str(recorded["sha256"])
    except FileNotFoundError:
        return "it has no build record"
    except (OSError, ValueError, KeyError, TypeError):
        return "its build record is unreadable"
    try:
        found_size, found_sha = _digest(library)
    except OSError as error:
        return f"it cannot be read: {error.strerror}"
    if found_size != size:
        return f"{found_size} bytes, built {size}"
    if found_sha != sha:
        return "its SHA-256 differs from the build's"
    return None


def _verified() -> tuple[Path | None, str | None]:
    """The cached library that matches its build record, if any; and, when one did not
    match, what became of it. A library that does not match is removed (the caller
    rebuilds it); one that cannot be removed blocks the kernel (its line then starts
    with "cannot")."""
    said = None
    for library in _libraries():
        why = _mismatch(library)
        if why is None:
            return library, said
        try:
            library.unlink()
            _record_path(library).unlink(missing_ok=True)
        except OSError as error:
            return None, (
                f"cannot use the cached kernel {library}: it does not match its build "
                f"({why}) and cannot be removed ({error.strerror})"
            )
        said = f"the cached CPU kernel {library} does not match its build ({why}); rebuilding it"
    return None, said


def _import(library: Path) -> ModuleType:
    """Import a verified library as the module it was built as (its file name's stem):
    what torch's ``load`` does once its build step has nothing to do."""
    spec = importlib.util.spec_from_file_location(library.name.split(".")[0], library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_build_reason = BUILD_NOTE


def build_reason() -> str:
    """The line to say before the build that :func:`cpu_kernel` is about to start."""
    return _build_reason


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

    ``on_build`` is called before a compile starts (so a CLI can say why it waits:
    :func:`build_reason`); a library already built that matches its record is imported
    without a compile.
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
                        _module, _failure = _load_or_build(on_build)
            except Exception as error:  # no headers, a failed compile, ...
                lines = str(error).strip().splitlines()
                _failure = lines[-1] if lines else type(error).__name__
    if _module is None and chosen == "cpp":
        raise UsageError(f"{ENV}=cpp but the CPU histogram kernel could not be built: {_failure}")
    return _module


def _load_or_build(on_build: Callable[[], None] | None) -> tuple[ModuleType | None, str | None]:
    """Under the build guard: the verified library imported, else a build (said first
    through ``on_build``), recorded once it loaded; or None and why not."""
    global _build_reason
    library, said = _verified()
    if said is not None and said.startswith("cannot"):
        return None, said
    if library is not None:
        return _import(library), None
    if compiler_path() is None:
        return None, f"no C++ compiler found ({_no_compiler()})"
    _build_reason = f"{said}, about a minute" if said is not None else BUILD_NOTE
    if on_build is not None:
        on_build()
    from torch.utils.cpp_extension import load

    module = load(
        name=_name(),
        sources=[str(SOURCE)],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        verbose=False,
    )
    built = getattr(module, "__file__", None)
    if built is not None:
        _write_record(Path(built))
    return module, None


def _no_compiler() -> str:
    """Which compiler was looked for, in words."""
    if os.environ.get("CXX", "").strip():
        return f"CXX={compiler_command()} is not an executable on PATH"
    return "c++ is not on PATH and CXX is not set"


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
