"""A plain training loop whose weight gradients flush under MXFP8, for `fpaudit run --recipe`.

The inputs' 64 features alternate magnitudes 1 and 2**-20, so each 32-block of
the first layer's weight gradient (rows of [32, 64]) holds both: under MXFP8-E4M3
the block scale follows the large half and the small half flushes. With
--grads DIR the script saves every parameter's gradient of every step (after
backward, before the optimizer step, where fpaudit records them) as
DIR/step<N>.pt, so a test can quantize the same tensors with torchao.
"""

import argparse
from pathlib import Path

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--grads")
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
magnitude = torch.ones(64)
magnitude[1::2] = 2.0**-20
data = torch.randn(args.steps, 8, 64) * magnitude
target = torch.randn(args.steps, 8, 1)

for step in range(args.steps):
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(data[step]), target[step])
    loss.backward()
    if args.grads:
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        torch.save(grads, Path(args.grads) / f"step{step}.pt")
    optimizer.step()
    print(f"step {step} loss {loss.item():.4f}")
