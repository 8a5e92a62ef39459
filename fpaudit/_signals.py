"""Keep Ctrl-C and SIGTERM out of the few places where state must change all at once."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

_STOPPING = (signal.SIGINT, signal.SIGTERM)


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
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "pthread_sigmask"
    ):
        yield
        return
    pending: list[int] = []

    def remember(signum: int, frame: Any) -> None:
        if signum not in pending:
            pending.append(signum)

    previous: dict[int, Any] = {}
    for number in _STOPPING:
        handler = signal.getsignal(number)
        if handler is not signal.SIG_IGN and handler is not None:
            previous[number] = signal.signal(number, remember)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPPING)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # blocked ones arrive here
        for signum in pending:
            signal.raise_signal(signum)
