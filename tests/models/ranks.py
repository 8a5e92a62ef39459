"""A tiny model for torchrun fault tests: what each rank does comes from FAULT (and RANK).

FAULT=uneven   a one-shot generator: 12 batches on rank 0 (6 steps of its shard), 4 on
               rank 1 (2 steps)
FAULT=raise    rank 1's loss raises ValueError at its third call (after 2 steps)
FAULT=differ   rank 1 builds a wider model than rank 0
FAULT=slow     every step sleeps (rank 0 longer), 400 batches: stopped from outside; with
               STARTED=path, rank 1 touches it once its steps run, and with KILL=path it
               SIGKILLs itself once that file exists
"""

import os
import signal
import time

import torch
from torch import nn

torch.manual_seed(0)
FAULT = os.environ.get("FAULT", "")
RANK = int(os.environ.get("RANK", "0"))
WIDTH = 12 if FAULT == "differ" and RANK == 1 else 8
model = nn.Sequential(nn.Linear(4, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))
calls = [0]


def _one_shot():
    for _ in range(12 if RANK == 0 else 4):
        yield torch.randn(3, 4)


batches = _one_shot() if FAULT == "uneven" else [torch.randn(3, 4) for _ in range(400)]


def loss(model, batch):
    calls[0] += 1
    if FAULT == "raise" and RANK == 1 and calls[0] == 3:
        raise ValueError("bad batch on rank 1")
    if FAULT == "slow":
        time.sleep(0.2 if RANK == 0 else 0.05)
        if RANK == 1 and os.environ.get("STARTED"):
            open(os.environ["STARTED"], "w").close()
        if RANK == 1 and os.environ.get("KILL") and os.path.exists(os.environ["KILL"]):
            os.kill(os.getpid(), signal.SIGKILL)
    return model(batch).pow(2).mean()
