"""Keep Ctrl-C and SIGTERM out of the few places where state must change all at once."""

from __future__ import annotations

import contextlib
import importlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

_STOPPING = (int(signal.SIGINT), int(signal.SIGTERM))
# The C functions behind ``signal``'s: its wrappers convert every number, handler and
# mask to and from enums, most of what the block cost on every closed step (17 us a
# block through them, 3 us without). They take and return the same values as ints.
try:
    _c: Any = importlib.import_module("_signal")  # CPython's; typeshed has no stub for it
    _getsignal, _set, _sigmask = _c.getsignal, _c.signal, _c.pthread_sigmask
except (ImportError, AttributeError):  # another interpreter: the wrappers do the same
    _getsignal, _set = signal.getsignal, signal.signal
    _sigmask = getattr(signal, "pthread_sigmask", None)
_IGNORED = int(signal.SIG_IGN)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back inside the block; they are delivered right after it.

    A KeyboardInterrupt can otherwise be raised between any two bytecodes, for
    instance half-way through recording a step or writing a report. Inside the
    block the two signals are blocked in this thread and, because the kernel may
    hand a process-directed signal to any thread that does not block it (torch's
    and pyarrow's worker threads), their Python handlers are also replaced by
    ones that only remember the signal. On the way out the previous handlers come
    back and every remembered signal is raised again, once: a second Ctrl-C
    during the block does not abort it, and the first is not lost. Only the main
    thread can do this; elsewhere (and where the platform lacks pthread_sigmask)
    this does nothing.
    """
    if _sigmask is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def remember(signum: int, frame: Any) -> None:
        if signum not in pending:
            pending.append(signum)

    previous: dict[int, Any] = {}
    for number in _STOPPING:
        handler = _getsignal(number)
        if handler is not None and handler != _IGNORED:
            previous[number] = _set(number, remember)
    mask = _sigmask(signal.SIG_BLOCK, _STOPPING)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            _set(signum, handler)
        _sigmask(signal.SIG_SETMASK, mask)  # blocked ones arrive here
        for signum in pending:
            signal.raise_signal(signum)
