"""A model whose backward values are about 1e-8: below fp16's round-to-zero edge.

The model returns its own loss, ``1e-8 * sum(linear(x))`` computed in fp32. Under
fp16 autocast the Linear runs in fp16 and its output is cast to fp32: in backward
that cast (``ToCopyBackward0``) turns the gradient 1e-8 into fp16, where anything
at or below 2**-25 (about 2.98e-8) is zero, and the Linear's own gradient ops only
see zeros (they inherit them). In fp32 the values are, by hand:

* the scale's gradient, 1e-8: underflows fp16 at S = 1;
* the weight's gradient, sum over 8 rows of 0.1 * 1e-8 = 8e-9: underflows;
* the bias's gradient, 8 * 1e-8 = 8e-8: does not (8e-8 > 2**-25).
"""

import torch
from torch import nn


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).float().sum() * 1e-8


model = Model
batches = [torch.full((8, 16), 0.1)]


def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def optimizer(params):
    # Adam normalises its steps: a 1e-8 gradient still moves the weights in fp32, and a
    # gradient that underflowed to zero does not. (An SGD step of that size would be
    # below half an ulp of the weights, even in fp32.)
    return torch.optim.Adam(params, lr=1e-3)
