"""A tiny Hugging Face Llama from a config (nothing is downloaded), as issue 24 tried it:
2 layers, gradient checkpointing on, seeded random token ids. Its RMSNorm backward
holds ``rsqrt(var + eps) ** 3`` (RsqrtBackward0's ``aten.pow.Tensor_Scalar``), a value
computed from forward values alone: it does not scale with the loss."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, LAYERS, HEADS, HIDDEN, BATCH, SEQ = 256, 2, 4, 64, 4, 32


def model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=SEQ,
    )
    lm = LlamaForCausalLM(config)
    lm.gradient_checkpointing_enable()
    lm.loss_type = "ForCausalLM"
    return lm


def batches():
    generator = torch.Generator().manual_seed(0)
    for _ in range(32):
        yield torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def loss(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss
