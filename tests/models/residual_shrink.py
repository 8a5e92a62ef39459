"""A residual model of three blocks; with FPAUDIT_SHRINK=K block 1's output is multiplied
by 2**-K in forward (the multiplication is the block's own op in both versions: 2**0 = 1).

``x = x + block(x)``: the gradient reaching block 1's output is the one arriving at the
sum, so block 1's own backward values (its mul, tanh and linear ops, its parameter
gradients) are those of the model without the factor times exactly 2**-K (a power of two
scales fp32 values exactly), K binades down; but one: the sum where the gradient of the
block's input joins the residual path's (an aten.add autograd records under
blocks.1.linear) is mostly the residual's, and moves little. The residual path carries the
gradient past the block unchanged; the other modules move only as far as their forward
inputs do.
tests/rules/test_comparison.py scans it with K = 0 and K = 12 and diffs the two.
"""

import os

import torch
from torch import nn

SHRINK = 2.0 ** -int(os.environ.get("FPAUDIT_SHRINK", "0"))
WIDTH = 16


class Block(nn.Module):
    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * self.factor


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block(SHRINK), Block()])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).mean()


model = Model
batches = [torch.randn(32, WIDTH) for _ in range(2)]


def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)
