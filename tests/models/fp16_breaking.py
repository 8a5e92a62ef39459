"""Small Llama decoders (from configs, nothing downloaded) that break in fp16 like real ones.

``FP16_CASE`` (environment variable, read when the file is imported) picks one:

``forward``
    Layer 1's MLP is scaled (gate and up x40, down x3200): its down-projection
    output reaches ~9e4 > 65504 in forward, so under fp16 autocast the first
    inf is made by ``model.layers.1.mlp.down_proj``'s ``aten.mm``.
``backward``
    The LM head's weights are scaled x40: forward stays below ~350 (the logits),
    but at the GradScaler's starting scale 2^16 the gradient that flows back
    through ``lm_head`` overflows: the first inf is made in backward by
    ``lm_head``'s ``aten.mm``.
``attention``
    Unscaled: at S = 1 the gradients inside attention's backward are tiny and
    many round to zero in fp16 (underflow, no overflow).
"""

from __future__ import annotations

import os

import torch
from torch import nn

CASE = os.environ.get("FP16_CASE", "forward")
VOCAB = 128


def build(case: str = CASE) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    net = LlamaForCausalLM(config)
    with torch.no_grad():
        if case == "forward":
            mlp = net.model.layers[1].mlp
            mlp.gate_proj.weight.mul_(40)
            mlp.up_proj.weight.mul_(40)
            mlp.down_proj.weight.mul_(3200)
        elif case == "backward":
            net.lm_head.weight.mul_(40)
        elif case != "attention":
            raise ValueError(f"FP16_CASE must be forward, backward or attention, got {case!r}")
    return net


def model() -> nn.Module:
    return build()


def batches():
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (2, 16), generator=generator) for _ in range(4)]


def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def optimizer(params):
    return torch.optim.SGD(params, lr=1e-3)
