"""Sample model file: a small GPT-style transformer language model on random tokens.

Four pre-norm blocks, d_model 256, 8 heads, batch 16 x 128 tokens: the
reference model of the benchmarks (benchmarks/overhead.py builds it too).

    fpaudit scan sample_configs/transformer.py --steps 8
"""

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, D_MODEL, HEADS, LAYERS, BATCH, SEQ = 1024, 256, 8, 4, 16, 128


class Attention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(x).split(d_model, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, d_model))


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TransformerLM(nn.Module):
    def __init__(
        self,
        vocab: int = VOCAB,
        d_model: int = D_MODEL,
        heads: int = HEADS,
        layers: int = LAYERS,
        seq: int = SEQ,
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tokens(ids) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


model = TransformerLM


def token_batches(count: int = 64, batch: int = BATCH, seq: int = SEQ, vocab: int = VOCAB):
    generator = torch.Generator().manual_seed(0)
    for _ in range(count):
        yield torch.randint(0, vocab, (batch, seq + 1), generator=generator)


batches = token_batches


def loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def optimizer(params):
    return torch.optim.AdamW(params, lr=3e-4)
