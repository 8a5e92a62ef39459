"""Keep Ctrl-C and SIGTERM out of the few places where state must change all at once."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_STOPPING = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Block SIGINT and SIGTERM inside the block; they are delivered right after it.

    A KeyboardInterrupt can otherwise be raised between any two bytecodes, for
    instance half-way through recording a step. Only the main thread receives
    Python signals; elsewhere (and where the platform lacks pthread_sigmask)
    this does nothing.
    """
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "pthread_sigmask"
    ):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPPING)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
