"""A model file whose step ``STOP_AT`` signals the test (a marker file) and then waits,
so that a test can send SIGINT or SIGTERM after exactly STOP_AT completed steps."""

import os
import time
from pathlib import Path

import torch
from torch import nn

MARKER = Path(os.environ["FPAUDIT_TEST_MARKER"])
STOP_AT = int(os.environ.get("FPAUDIT_TEST_STOP_AT", "3"))
_calls = {"n": 0}

model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
batches = [torch.randn(16, 4) for _ in range(100)]


def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    if _calls["n"] == STOP_AT:
        MARKER.write_text("ready")
        time.sleep(60)  # the test interrupts us here
    _calls["n"] += 1
    return model(batch).pow(2).mean()
