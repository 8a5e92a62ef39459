"""FpauditTrainerCallback under torchrun: the Trainer's DDP on 2 CPU processes, one report.

torchrun --standalone --nproc-per-node 2 tests/scripts/hf_ddp.py OUT
"""

import gc
import sys
import warnings

import torch
import transformers

from fpaudit.integrations.huggingface import FpauditTrainerCallback
from fpaudit.run.distributed import shutdown

out = sys.argv[1]
config = transformers.GPT2Config(
    n_layer=2,
    n_head=2,
    n_embd=32,
    vocab_size=128,
    n_positions=32,
    bos_token_id=127,
    eos_token_id=127,
)
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(config)
model.loss_type = "ForCausalLM"
ids = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(0))
data = [{"input_ids": row, "labels": row} for row in ids]  # the Trainer shards it per rank
args = transformers.TrainingArguments(
    output_dir=f"{out}-trainer",
    per_device_train_batch_size=4,
    max_steps=3,
    report_to=[],
    use_cpu=True,
    save_strategy="no",
    disable_tqdm=True,
    ddp_backend="gloo",
)
audit = FpauditTrainerCallback(out=out)
trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[audit])
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
        trainer.train()
    finally:
        audit.finish()
# The Trainer's DDP reducer goes before its process group (gloo aborts the other way
# round), then every rank meets and leaves the group while Python is whole.
del trainer
gc.collect()
shutdown()
