"""The library API under FSDP2 (fully_shard) on torchrun: each rank records its shards.

torchrun --standalone --nproc-per-node 2 tests/scripts/fsdp_audit.py OUT
"""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import fpaudit
from fpaudit.distributed import write_report

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer)
fully_shard(model)
audit = fpaudit.audit(model)
torch.manual_seed(1 + rank)
for _step in range(2):
    with audit:
        model.zero_grad()
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        audit.step(loss=loss)
write_report(audit.report, sys.argv[1])
dist.destroy_process_group()
