"""Awkward models for the capture tests (in the spirit of torchinfo's test zoo)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ReturnsLoss(nn.Module):
    """Hugging Face style: forward computes and returns the loss itself."""

    def __init__(self) -> None:
        super().__init__()
        self.body = MLP()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.body(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


class SharedAndTied(nn.Module):
    """One module used twice, and an embedding tied to the output head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = self.mix(torch.relu(self.mix(h)))
        return self.head(h)


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * 2 * x


class CustomFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.square = SquareModule()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.square(self.fc(x))


class SquareModule(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Square.apply(x)


class DictOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 2)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"a": self.a(x), "b": self.b(x)}


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = MLP()
        self.out = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(checkpoint(self.inner, x, use_reentrant=False))


class RMSNorm(nn.Module):
    """LLaMA-style norm written out: its backward has intermediates from forward values only."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class WithRMSNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = RMSNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x) * 100)


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.trained = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trained(self.frozen(x))
