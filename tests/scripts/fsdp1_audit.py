"""The library API under FSDP1 (FullyShardedDataParallel) on torchrun, CPU.

torchrun --standalone --nproc-per-node 2 tests/scripts/fsdp1_audit.py OUT flat|orig

flat: gradients of the flat parameter (use_orig_params=False); orig: of the original
parameters' shards (use_orig_params=True).
"""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

import fpaudit
from fpaudit.distributed import write_report

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
wrapped = FSDP(model, device_id=torch.device("cpu"), use_orig_params=sys.argv[2] == "orig")
audit = fpaudit.audit(wrapped)
torch.manual_seed(1 + rank)
for _step in range(2):
    with audit:
        wrapped.zero_grad()
        loss = wrapped(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        audit.step(loss=loss)
write_report(audit.report, sys.argv[1])
dist.destroy_process_group()
