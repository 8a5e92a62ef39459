"""The compiled zoo: small nets whose backward runs one family of ops each (pooling, a
ResNet-shaped block, upsampling and norms, sparse and index ops, dropout and in-place
activations, an LSTM, a wrapped ``forward``, a model with ops of its own, a pre-norm
transformer encoder layer, a mixture of experts), compiled with fpaudit and compared with plain eager twins
and with plain ``torch.compile`` (tests/capture/test_compiled_zoo.py).

Index ops take their indices from constants built in ``forward`` (``arange``), so the
compiled graph holds them; each op sits in a module of its own so the report names it.

As a model file (``fpaudit scan tests/models/compiled_zoo.py``) it returns the
ResNet-shaped net ``torch.compile``d: the family every ResNet belongs to (conv, BN,
ReLU in place, MaxPool, a residual block), whose MaxPool backward (a scatter into
zeros) once crashed the compiled audit."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Op(nn.Module):
    """One tensor function as a module of its own, so the report names it."""

    def __init__(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function(x)


class Pools(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.avgpool = nn.AvgPool2d(2)
        self.adaptive = nn.AdaptiveAvgPool2d(1)
        self.adaptive_max = nn.AdaptiveMaxPool2d(2)
        self.fc = nn.Linear(8 + 8 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.maxpool(self.conv(x))
        pooled = self.adaptive(self.avgpool(y)).flatten(1)
        return self.fc(torch.cat([pooled, self.adaptive_max(y).flatten(1)], 1))


class BasicBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + x)


class ResNetShaped(nn.Module):
    """torchvision's resnet18 stem and first block, at 8 channels."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = BasicBlock(8)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(self.avgpool(self.layer1(x)), 1))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.deconv = nn.ConvTranspose2d(3, 8, 2, stride=2)
        self.nearest = nn.Upsample(scale_factor=2, mode="nearest")
        self.bilinear = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.group_norm = nn.GroupNorm(2, 8)
        self.instance_norm = nn.InstanceNorm2d(8, affine=True)
        self.out = nn.Conv2d(8, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group_norm(self.nearest(self.deconv(x)))
        return self.out(self.instance_norm(self.bilinear(y)))


def _gather(h: torch.Tensor) -> torch.Tensor:  # (b, 8, 16): rows 0..7 of 8, by index
    index = (torch.arange(8) % h.shape[1]).view(1, 8, 1).expand(h.shape[0], 8, h.shape[2])
    return h.gather(1, index)


def _scatter_add(h: torch.Tensor) -> torch.Tensor:  # (b, 8, 16) -> (b, 4, 16): rows i % 4
    index = (torch.arange(8) % 4).view(1, 8, 1).expand(h.shape[0], 8, h.shape[2])
    return torch.zeros(h.shape[0], 4, h.shape[2]).scatter_add(1, index, h)


def _index_put(h: torch.Tensor) -> torch.Tensor:  # (b, 4, 16) -> (b, 6, 16), rows 0, 2, 2, 5
    rows = torch.arange(h.shape[0]).view(-1, 1)
    target = torch.zeros(h.shape[0], 6, h.shape[2])
    return target.index_put((rows, torch.tensor([0, 2, 2, 5])), h, accumulate=True)


class Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, 16)
        self.bag = nn.EmbeddingBag(50, 16, mode="mean")
        self.proj = nn.Linear(16, 16)
        self.gather = Op(_gather)
        self.scatter_add = Op(_scatter_add)
        self.index_put = Op(_index_put)
        self.topk = Op(lambda h: h.topk(2, dim=1).values)
        self.sort = Op(lambda h: h.sort(dim=-1).values)
        self.cumsum = Op(lambda h: h.cumsum(-1))
        self.masked_fill = Op(lambda h: h.masked_fill(h < 0, 0.0))
        self.where = Op(lambda h: torch.where(h > 0.1, h, h * 0.5))
        self.head = nn.Linear(16, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.gather(self.proj(self.embedding(ids)))
        t = self.topk(self.index_put(self.scatter_add(h)))
        t = self.where(self.masked_fill(self.cumsum(self.sort(t))))
        return self.head(t.mean(1) + self.bag(ids))


class Regularised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.leaky = nn.LeakyReLU(0.1, inplace=True)
        self.dropout = nn.Dropout(0.25)
        self.fc2 = nn.Linear(32, 32)
        self.relu = nn.ReLU(inplace=True)
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.relu(self.fc2(self.dropout(self.leaky(self.fc1(x))))))


class Tagger(nn.Module):
    """An LSTM tagger: Dynamo does not trace ``nn.LSTM`` (a graph break by design)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(40, 16)
        self.norm = nn.LayerNorm(16)
        self.lstm = nn.LSTM(16, 16, batch_first=True)
        self.head = nn.Linear(16, 6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.norm(self.embedding(ids)))
        return self.head(torch.tanh(out))


def passthrough(function: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator of the shape ``transformers``' ``deprecate_kwarg`` has: Dynamo traces
    ``wrapped(*args, **kwargs)``, and names the module ``L['args'][0]``."""

    @functools.wraps(function)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    return wrapped


class WrappedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)

    @passthrough
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.fc2(self.act(self.fc1(x))))


class OwnOps(nn.Module):
    """Ops of the model's own ``forward``, in no submodule: a broadcast sum of two
    embeddings, a product of a value with its own row sum (two uses: a gradient sum),
    a mean over tokens. Eager files their backward under the model itself ``""``."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(20, 8)
        self.positions = nn.Embedding(8, 8)
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.fc(self.tokens(ids) + self.positions(torch.arange(ids.shape[1])))
        return self.head((h * h.sum(-1, keepdim=True)).mean(1))


class EncoderLayer(nn.Module):
    """A pre-norm ``nn.TransformerEncoderLayer`` without dropout and a Linear head: adding
    the stored buffers to its backward graph's outputs once changed how Inductor summed
    ``in_proj_bias``'s gradient (one ulp off plain ``torch.compile``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            16, 2, dim_feedforward=32, dropout=0.0, batch_first=True, norm_first=True
        )
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x))


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Mixture(nn.Module):
    """A top-2 mixture of 4 experts: ``torch.where(idx == e)`` has a data-dependent shape,
    so Dynamo runs this ``forward`` eagerly and compiles ``Expert.forward`` as a frame
    of its own, once for expert 0's row count and once with a dynamic row count, which
    the later experts run (the graph compiled for expert 1 runs for experts 2 and 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.experts = nn.ModuleList(Expert() for _ in range(4))
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.topk(self.router(x).softmax(-1), 2, dim=-1)
        mixed = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            mixed = mixed.index_add(0, rows, expert(x[rows]) * weights[rows, slot, None])
        return self.out(mixed)


def images(size: int) -> torch.Tensor:
    return torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(1))


def token_ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (4, 8), generator=torch.Generator().manual_seed(1))


def features() -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(1))


def tokens() -> torch.Tensor:  # 8 tokens: the mixture's experts get 4, 2, 7 and 3 of them
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(5))


def sequences(seed: int = 1) -> torch.Tensor:
    return torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(seed))


# name -> (the net's class, its batch)
ZOO: dict[str, tuple[type[nn.Module], Callable[[], torch.Tensor]]] = {
    "pools": (Pools, lambda: images(16)),
    "resnet_shaped": (ResNetShaped, lambda: images(32)),
    "decoder": (Decoder, lambda: images(8)),
    "sparse": (Sparse, lambda: token_ids(50)),
    "regularised": (Regularised, features),
    "lstm_tagger": (Tagger, lambda: token_ids(40)),
    "wrapped_forward": (WrappedForward, features),
    "own_ops": (OwnOps, lambda: token_ids(20)),
    "encoder_layer": (EncoderLayer, sequences),
}


# -- as a model file: the ResNet-shaped net, compiled -----------------------------------
def model() -> nn.Module:
    return torch.compile(ResNetShaped())  # type: ignore[return-value]


def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    for _ in range(8):
        x = torch.randn(4, 3, 32, 32, generator=generator)
        yield x, torch.randint(0, 10, (4,), generator=generator)


def loss(net: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(net(x), y)
