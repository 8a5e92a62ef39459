"""Sample model file: a tiny GPT-2 language model from Hugging Face transformers.

Built from a config in code (nothing is downloaded): 2 layers, 2 heads,
width 64, a 256-token vocabulary, on seeded random token ids. The report names
modules as the model does (``transformer.h.0.attn.c_attn``, ``lm_head``).
Needs ``pip install transformers``.

    fpaudit scan sample_configs/hf_gpt2.py --steps 8
"""

import torch

try:
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError as error:
    raise ImportError(
        "this sample needs Hugging Face transformers: pip install transformers"
    ) from error

VOCAB, LAYERS, HEADS, WIDTH, POSITIONS, BATCH, SEQ = 256, 2, 2, 64, 64, 8, 32


def model() -> GPT2LMHeadModel:
    config = GPT2Config(
        n_layer=LAYERS,
        n_head=HEADS,
        n_embd=WIDTH,
        vocab_size=VOCAB,
        n_positions=POSITIONS,
        bos_token_id=VOCAB - 1,  # GPT-2's own 50256 is outside this vocabulary
        eos_token_id=VOCAB - 1,
    )
    lm = GPT2LMHeadModel(config)
    lm.loss_type = "ForCausalLM"  # what transformers falls back to, without its warning
    return lm


def batches():
    generator = torch.Generator().manual_seed(0)
    for _ in range(32):
        yield torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def loss(model: GPT2LMHeadModel, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def optimizer(params):
    return torch.optim.AdamW(params, lr=3e-4)
