"""A tiny Hugging Face GPT-2 (from a config, nothing downloaded) whose layer-1 MLP
overflows fp16, fed a padded batch so that every attention builds its ``-inf`` mask.

Layer 1's ``mlp.c_fc`` weights are scaled x25 and ``mlp.c_proj`` x4e5: in fp32 the
down-projection's output reaches ~3.2e5 (> 65504), so under fp16 autocast its
``aten.addmm`` makes the first computed inf (its largest input, a weight, ~1.4e4, is
finite). The padding mask is ``where(mask, 0, -inf)`` in fp16: each attention's
``aten.scalar_tensor`` writes a ``-inf`` by design, which is not an origin.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 128


def model() -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        n_layer=3, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
    )  # fmt: skip
    torch.manual_seed(4)
    lm = transformers.GPT2LMHeadModel(config)
    lm.loss_type = "ForCausalLM"
    with torch.no_grad():
        lm.transformer.h[1].mlp.c_fc.weight.mul_(25.0)
        lm.transformer.h[1].mlp.c_proj.weight.mul_(4.0e5)
    return lm.train()


def batches():
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (2, 16), generator=generator) for _ in range(2)]


def loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0  # the first sequence ends in padding
    return model(input_ids=ids, attention_mask=mask, labels=ids).loss
