"""A model whose forward overflows at step 1: ``scale`` multiplies by 1e30, then ``square``
squares it past fp32's range (inf); the loss becomes inf."""

import torch
from torch import nn


class Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.square = Square()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.square(self.linear(x)).mean()


model = Model
batches = [torch.ones(2, 4), torch.full((2, 4), 1e30), torch.ones(2, 4)]


def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)
