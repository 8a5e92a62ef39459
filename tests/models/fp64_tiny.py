"""An fp64 model whose backward values all lie below fp32's range.

``loss = 1e-50 * sum(linear(x))``: every backward value is 1e-50 times a weight, an
input (0.5) or 1, so below 1e-49 and far below fp32's smallest subnormal
2**-149 (about 1.4e-45). Cast to fp32 for binning, each becomes zero: the
histogram holds no nonzero value, and the report must say how many it lost.
"""

import torch
from torch import nn

model = nn.Linear(4, 4).double()
batches = [torch.full((2, 4), 0.5, dtype=torch.float64)]


def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sum() * 1e-50
