"""Sample model file: a small conv net (conv, batch norm, ReLU) on synthetic 32x32 images.

fpaudit scan sample_configs/convnet.py --steps 8
"""

import torch
from torch import nn
from torch.nn import functional as F

BATCH, CLASSES = 32, 10


def block(channels_in: int, channels_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(channels_in, channels_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels_out),
        nn.ReLU(),
        nn.MaxPool2d(2),
    )


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(block(3, 16), block(16, 32), block(32, 64))
        self.head = nn.Linear(64 * 4 * 4, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).flatten(1))


model = ConvNet


def batches():
    generator = torch.Generator().manual_seed(0)
    for _ in range(32):
        images = torch.randn(BATCH, 3, 32, 32, generator=generator)
        labels = torch.randint(0, CLASSES, (BATCH,), generator=generator)
        yield images, labels


def loss(model: nn.Module, batch) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3)
