"""Tiny Hugging Face Llama, GPT-2 and BERT language models built from configs (nothing
downloaded), as a user would scan them: ``FPAUDIT_ARCH`` (read when the file is
imported) picks ``llama`` (2 layers, ``gradient_checkpointing_enable()``), ``gpt2``
(tied LM head, ``Conv1D`` projections) or ``bert`` (masked LM).
"""

from __future__ import annotations

import os

import torch
from torch import nn

ARCH = os.environ.get("FPAUDIT_ARCH", "llama")
VOCAB = 128


def build(arch: str = ARCH) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    if arch == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
            attn_implementation="eager",
        )  # fmt: skip
        net: nn.Module = transformers.LlamaForCausalLM(config)
        net.gradient_checkpointing_enable()
    elif arch == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_head=2, n_embd=64, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
        )  # fmt: skip
        net = transformers.GPT2LMHeadModel(config)
    elif arch == "bert":
        config = transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128, max_position_embeddings=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, attn_implementation="eager",
        )  # fmt: skip
        net = transformers.BertForMaskedLM(config)
    else:
        raise ValueError(f"FPAUDIT_ARCH must be llama, gpt2 or bert, got {arch!r}")
    return net.train()


def model() -> nn.Module:
    return build()


def batches():
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (2, 16), generator=generator) for _ in range(4)]


def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss
