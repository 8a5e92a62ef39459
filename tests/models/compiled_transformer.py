"""A 2-block pre-norm transformer with SDPA attention, as a model file returns it
compiled: ``model()`` is ``torch.compile(net)`` (the default backend, Inductor).
FPAUDIT_COMPILED=eager returns the eager net instead: its twin. tests/capture/test_compiled.py
scans both."""

import os

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, TOKENS, BATCH = 16, 8, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        # no bias: the key bias's gradient is zero in exact arithmetic (softmax ignores a
        # shift shared by all keys), so eager and compiled kernels round it to different
        # tiny values or zeros, and the twins' counts could not be compared exactly
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def model() -> nn.Module:
    torch.manual_seed(0)
    net = Net()
    return net if os.environ.get("FPAUDIT_COMPILED") == "eager" else torch.compile(net)


_generator = torch.Generator().manual_seed(1)
batches = [torch.randn(BATCH, TOKENS, 4, generator=_generator) for _ in range(3)]


def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()
