"""Sample model file: a tiny BERT masked language model from Hugging Face transformers.

Built from a config in code (nothing is downloaded): 2 layers, 2 heads,
hidden size 64, a 256-token vocabulary; 15% of the seeded random tokens are
masked and only those are predicted (the other labels are -100). The report
names modules as the model does (``bert.encoder.layer.0.attention.self.query``,
``cls.predictions.transform.dense``). Needs ``pip install transformers``.

    fpaudit scan sample_configs/hf_bert.py --steps 8
"""

import torch

try:
    from transformers import BertConfig, BertForMaskedLM
except ImportError as error:
    raise ImportError(
        "this sample needs Hugging Face transformers: pip install transformers"
    ) from error

VOCAB, LAYERS, HEADS, HIDDEN, POSITIONS, BATCH, SEQ = 256, 2, 2, 64, 64, 8, 32
MASK_ID, MASK_RATE = 4, 0.15  # token 4 plays [MASK]; ids 0-4 are never drawn as text


def model() -> BertForMaskedLM:
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=4 * HIDDEN,
        max_position_embeddings=POSITIONS,
    )
    return BertForMaskedLM(config)


def batches():
    generator = torch.Generator().manual_seed(0)
    for _ in range(32):
        ids = torch.randint(5, VOCAB, (BATCH, SEQ), generator=generator)
        masked = torch.rand((BATCH, SEQ), generator=generator) < MASK_RATE
        masked[:, 0] = True  # at least one prediction per sequence
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        yield {"input_ids": ids.masked_fill(masked, MASK_ID), "labels": labels}


def loss(model: BertForMaskedLM, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def optimizer(params):
    return torch.optim.AdamW(params, lr=3e-4)
