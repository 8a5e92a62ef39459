"""Which threads the model's code started: torch's own workers are not the model's.

``fpaudit scan`` exits without waiting for non-daemon threads the model file left
running (a prefetcher that never ends would hang it), and says so. Inductor starts a
pool of compile workers (a ``ThreadPoolExecutor``) from inside the model's backward;
they end at interpreter exit and are not the user's doing. :func:`watching` remembers the
threads alive when the command started and, for each thread started after, the module
that started it (the innermost caller outside ``threading`` and ``concurrent.futures``);
:func:`left_by_model` is the non-daemon threads still alive that neither existed before
nor were started by torch (or Triton).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import weakref
from collections.abc import Iterator
from types import FrameType

__all__ = ["left_by_model", "watching"]

# Packages whose own threads are theirs: a torch.compile worker pool, Triton's launchers
_LIBRARIES = ("torch", "triton")
_PLUMBING = ("threading", "concurrent.futures", __name__)

_before: set[int] = set()
_started_by: weakref.WeakKeyDictionary[threading.Thread, str] = weakref.WeakKeyDictionary()
_original_start = threading.Thread.start


def _caller_module(frame: FrameType | None) -> str:
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        if not any(name == p or name.startswith(p + ".") for p in _PLUMBING):
            return name
        frame = frame.f_back
    return ""


@functools.wraps(_original_start)
def _start(self: threading.Thread) -> None:
    _started_by[self] = _caller_module(sys._getframe(1))
    _original_start(self)


@contextlib.contextmanager
def watching() -> Iterator[None]:
    """Inside the block, remember who starts each thread (the console command runs in it);
    threads alive when it opens are nobody's."""
    _before.update(id(t) for t in threading.enumerate())
    threading.Thread.start = _start  # type: ignore[method-assign]
    try:
        yield
    finally:
        threading.Thread.start = _original_start  # type: ignore[method-assign]


def _library_thread(thread: threading.Thread) -> bool:
    started = _started_by.get(thread, "")
    return any(started == p or started.startswith(p + ".") for p in _LIBRARIES)


def left_by_model() -> list[threading.Thread]:
    """The non-daemon threads still running that the model's code started."""
    return [
        t
        for t in threading.enumerate()
        if t is not threading.main_thread()
        and not t.daemon
        and t.is_alive()
        and id(t) not in _before
        and not _library_thread(t)
    ]
