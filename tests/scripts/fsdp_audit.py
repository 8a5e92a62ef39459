"""The library API under FSDP on torchrun, CPU: each rank records its shards.

torchrun --standalone --nproc-per-node 2 tests/scripts/fsdp_audit.py OUT [fsdp2|flat|orig]

fsdp2: fully_shard on each Linear and the model (the default); flat: FSDP1
(FullyShardedDataParallel) with its flat parameter; orig: FSDP1 with use_orig_params.
"""

import gc
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

import fpaudit
from fpaudit.run.distributed import write_report

mode = sys.argv[2] if len(sys.argv) > 2 else "fsdp2"
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
if mode == "fsdp2":
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
else:
    model = FullyShardedDataParallel(
        model, device_id=torch.device("cpu"), use_orig_params=mode == "orig"
    )
audit = fpaudit.audit(model)
torch.manual_seed(1 + rank)
for _step in range(2):
    with audit:
        model.zero_grad()
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        audit.step(loss=loss)
write_report(audit.report, sys.argv[1])
# The wrapper and the audit before the process group, as ddp_audit.py does: what FSDP
# holds of the group's work is freed while Python is whole, not at interpreter exit.
del audit, model
gc.collect()
dist.barrier()  # no rank leaves while a peer still reads the last collective
dist.destroy_process_group()
