"""Model file whose parameter gradient is exactly half 1.0, half 2**-20 (64 values).

loss = sum(w * c) with w = 0, so dloss/dw = c (times the loss scale, 1). With
FPAUDIT_PAIR=sorted the two magnitudes are sorted into separate 32-blocks;
otherwise they alternate (interleaved). tests/cli/test_blocks_cli.py scans it with
--recipe mxfp8-e4m3 and --recipe fp8-tensor-e4m3.
"""

import os

import torch
from torch import nn

PAIR = torch.ones(64)
PAIR[1::2] = 2.0**-20
if os.environ.get("FPAUDIT_PAIR") == "sorted":
    PAIR = PAIR.sort().values


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(64))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w * c).sum()


model = Pair
batches = [PAIR.clone()]


def loss(model: nn.Module, c: torch.Tensor) -> torch.Tensor:
    return model(c)
