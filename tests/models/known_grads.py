"""A model whose backward values are known exactly: the gradient of sum(w * c) is c.

The probe's only backward op output is ``grad * c`` with ``grad`` the seed S,
so at loss scale S the recorded values are exactly S * VALUES.
"""

import torch
from torch import nn

_edges = [2.0**-25, 2.0**-24, 2.0**-14, 65504.0, 65520.0, 448.0, 464.0, 480.0,
          2.0**-10, 2.0**-9, 2.0**-6, 57344.0, 61440.0, 2.0**-17, 2.0**-16,
          2.0**-134, 2.0**-126, 2.0**-149, 3 * 2.0**-149, (2 - 2.0**-23) * 2.0**-127]  # fmt: skip
_values = [0.0, -0.0, 1.0, 1e-3, -7.5e-6, 3e-9]
for _edge in _edges:
    _e = torch.tensor(_edge, dtype=torch.float32)
    _values += [_edge, torch.nextafter(_e, torch.tensor(0.0)).item(),
                torch.nextafter(_e, torch.tensor(1e30)).item()]  # fmt: skip
_values += [
    (1 + f / 2**23) * 2.0**-20 for f in (0x80, 0x81, 0x680000, 0x680001, 0x7FF000, 0x7FFFFF)
]
VALUES = torch.tensor(_values + [-v for v in _values], dtype=torch.float32)


class Probe(nn.Module):
    def __init__(self, size: int = len(VALUES)) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.weight * c).sum()


class Model(nn.Module):
    def __init__(self, size: int = len(VALUES)) -> None:
        super().__init__()
        self.probe = Probe(size)

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return self.probe(c)


model = Model
batches = [VALUES]


def loss(model: nn.Module, c: torch.Tensor) -> torch.Tensor:
    return model(c)
