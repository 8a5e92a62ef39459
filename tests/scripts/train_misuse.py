"""One mixed-precision mistake per --bug, for `fpaudit run` tests (CPU GradScaler).

--bug unscale-twice   unscale_, update, then unscale_ again on the same gradients
--bug mixed-scale     accumulate 2 micro-batches but step and update the scaler on each;
                      an overflow in between halves the scale inside one batch
--bug grad-read       log the gradient norm before unscale_
--bug no-unscale      optimizer.step() instead of scaler.step(optimizer)
--bug nan             every loss is NaN: the scale falls every step
--bug raise           raise at step 2
--bug exit            sys.exit(3) at step 2
--bug none            the correct loop
"""

import argparse
import sys

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--bug", default="none")
parser.add_argument("--steps", type=int, default=8)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)


def loss_at(step):
    x = torch.randn(4, 4)
    loss = model(x).pow(2).mean()
    if args.bug == "nan":
        loss = loss * float("nan")
    return loss


for step in range(args.steps):
    if args.bug == "raise" and step == 2:
        raise ValueError("the data loader ran dry")  # mark: raise
    if args.bug == "exit" and step == 2:
        sys.exit(3)  # mark: exit
    if args.bug == "mixed-scale":
        if step % 2 == 0:
            optimizer.zero_grad()
        loss = loss_at(step) * (1e38 if step == 2 else 1.0)
        scaler.scale(loss).backward()  # mark: mixed-backward
        scaler.step(optimizer)
        scaler.update()  # mark: mixed-update
        continue
    optimizer.zero_grad()
    scaler.scale(loss_at(step)).backward()
    if args.bug == "unscale-twice":
        scaler.unscale_(optimizer)
        scaler.update()
        scaler.unscale_(optimizer)  # mark: unscale-again
    if args.bug == "grad-read":
        norm = sum(p.grad.norm() ** 2 for p in model.parameters())  # mark: grad-read
    if args.bug == "no-unscale":
        optimizer.step()  # mark: no-unscale
        continue
    scaler.step(optimizer)
    scaler.update()  # mark: update
