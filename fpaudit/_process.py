"""Which process acts for an audit: the one that started it, never a child forked from it.

Model code and training scripts fork (``os.fork``, DataLoader workers that return into
the loop, multiprocessing's fork start method). A forked child shares the audit's memory
and open descriptors and runs on, but it must not act for its parent: it never writes the
report, never releases the output lock, never probes, prints a summary or leaves the
process group. Each of those places asks an :class:`Owner` made where the work started.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Owner:
    """The process that made this object (its pid, taken at construction)."""

    pid: int = field(default_factory=os.getpid)

    def here(self) -> bool:
        """True in the process that made this Owner, False in a child forked from it."""
        return os.getpid() == self.pid
