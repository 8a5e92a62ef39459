"""The library API under torchrun: DDP, fpaudit.audit on each rank, one report from all ranks.

torchrun --standalone --nproc-per-node 2 tests/scripts/ddp_audit.py OUT
"""

import sys

import torch
import torch.distributed as dist
from torch import nn

import fpaudit
from fpaudit.run.distributed import write_report

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
ddp = nn.parallel.DistributedDataParallel(model)
torch.manual_seed(1 + rank)  # each rank its own data
audit = fpaudit.audit(model)
for _step in range(3):
    with audit:
        ddp.zero_grad()
        loss = ddp(torch.randn(4, 8) * (rank + 1)).pow(2).mean()
        loss.backward()
        audit.step(loss=loss)
write_report(audit.report, sys.argv[1])
del ddp  # DDP's reducer before its process group: gloo aborts when torn down the other way
dist.barrier()
dist.destroy_process_group()
