"""A model file that misbehaves at one known point, chosen by environment variables,
so that a test can send a real signal at exactly that moment (no timing guesses).

``FAULT_AT``
    one or more of, separated by commas: ``import``: at import; ``step:N``: in the N-th call of ``loss`` (0-based);
    ``write``: when fpaudit starts writing the report's tables (this file patches
    ``Report.write_tables``: model code runs in fpaudit's process; its marker is
    ``FAULT_MARKER`` with the suffix ``.write``);
    ``model``: in the ``model()`` factory.
``FAULT_DO``
    ``wait``: write ``FAULT_MARKER`` and sleep (the test signals meanwhile; the sleep
    ends early when ``FAULT_MARKER`` is deleted); ``exit:N``: ``sys.exit(N)``;
    ``_exit:N``: ``os._exit(N)``; ``print``: print to stdout; ``chdir:DIR``:
    ``os.chdir(DIR)``.
"""

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

AT = os.environ.get("FAULT_AT", "").split(",")
DO = os.environ.get("FAULT_DO", "wait")
MARKER = Path(os.environ.get("FAULT_MARKER", os.devnull))


def fault(marker: Path = MARKER) -> None:
    action, _, argument = DO.partition(":")
    if action == "wait":
        marker.write_text(str(os.getpid()))
        deadline = time.monotonic() + 60
        while marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # the test signals us here, then deletes the marker
    elif action == "exit":
        sys.exit(int(argument))
    elif action == "_exit":
        os._exit(int(argument))
    elif action == "print":
        print("model code says hello")
    elif action == "chdir":
        os.chdir(argument)


if "import" in AT:
    fault()
if "write" in AT:
    from fpaudit.report import store as _report

    _write_tables = _report.Report.write_tables

    def write_tables(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not getattr(write_tables, "done", False):
            write_tables.done = True  # type: ignore[attr-defined]
            fault(MARKER.with_suffix(".write"))
        return _write_tables(self, *args, **kwargs)

    _report.Report.write_tables = write_tables  # type: ignore[method-assign]

_calls = {"n": 0}


def model() -> nn.Module:
    if "model" in AT:
        fault()
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


batches = [torch.randn(16, 4, generator=torch.Generator().manual_seed(i)) for i in range(50)]


def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    if f"step:{_calls['n']}" in AT:
        fault()
    _calls["n"] += 1
    if "verify" in AT:
        fault()
    return model(batch).pow(2).mean()
