"""Sample model file: a 4-layer MLP classifier on synthetic data.

The fpaudit model-file contract: define ``model``, ``batches`` and
``loss(model, batch)``; ``optimizer(params)`` is optional.

    fpaudit scan sample_configs/mlp.py --steps 8
"""

import torch
from torch import nn
from torch.nn import functional as F

FEATURES, CLASSES, BATCH = 64, 10, 128


def model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, CLASSES),
    )


def batches():
    generator = torch.Generator().manual_seed(0)
    for _ in range(32):
        x = torch.randn(BATCH, FEATURES, generator=generator)
        y = torch.randint(0, CLASSES, (BATCH,), generator=generator)
        yield x, y


def loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)
