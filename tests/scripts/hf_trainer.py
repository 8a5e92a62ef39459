"""A Hugging Face `Trainer` script as users write one: a model built from its config (a
tiny GPT-2, nothing downloaded), an in-memory dataset, `TrainingArguments` with
gradient accumulation, gradient clipping (the default `max_grad_norm`), a checkpoint
every 2 steps and a log line every step, then `trainer.train()` and
`trainer.save_model()`. Nothing reaches the network (`report_to="none"`, no hub).

python tests/scripts/hf_trainer.py OUTPUT_DIR
"""

import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

output_dir = sys.argv[1]

config = GPT2Config(
    n_layer=2,
    n_head=2,
    n_embd=32,
    vocab_size=64,
    n_positions=16,
    bos_token_id=63,
    eos_token_id=63,
)
torch.manual_seed(0)
model = GPT2LMHeadModel(config)
model.loss_type = "ForCausalLM"  # (the config names none: the Trainer would warn)

tokens = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))
train_dataset = [{"input_ids": row, "labels": row} for row in tokens]

args = TrainingArguments(
    output_dir=output_dir,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    learning_rate=1e-3,
    max_steps=4,
    logging_steps=1,
    save_strategy="steps",
    save_steps=2,
    report_to="none",
    use_cpu=True,
    disable_tqdm=True,
    seed=0,
)
trainer = Trainer(model=model, args=args, train_dataset=train_dataset)
result = trainer.train()
trainer.save_model()
print(f"trained {result.global_step} steps, final loss {result.training_loss:.6f}")
