"""Sample model file: the quadratic y = a * x**2, whose gradient is known exactly.

The parameter is x = 0.5; each batch is a coefficient a. The gradient is
dy/dx = 2 * a * x: slope 1 for a = 1, slope 2 for a = 2. Scanned with
``--loss-scale S`` (a power of two), the captured gradient is exactly
S * 2 * a * x, and dividing by S recovers 2 * a * x (the tests check it).
It shows the scaling identity only: nothing here is tiny or overflows.

    fpaudit scan sample_configs/quadratic.py --steps 2 --loss-scale 1024
"""

import torch
from torch import nn


class Quadratic(nn.Module):
    def __init__(self, x: float = 0.5) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.tensor(x))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return a * self.x**2


model = Quadratic
batches = [torch.tensor(1.0), torch.tensor(2.0)]


def loss(model: nn.Module, a: torch.Tensor) -> torch.Tensor:
    return model(a)
