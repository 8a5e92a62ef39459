"""Ends with sys.exit("text") after training: Python prints the text on stderr and
exits 1; so does fpaudit run, after writing the report."""

import sys

import torch
from _finish import finish
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

for step in range(6):
    optimizer.zero_grad(set_to_none=True)
    loss = model(torch.randn(8, 6)).pow(2).mean()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")

finish(model=model)
sys.exit(f"stopping: loss {loss.item():.3f} did not reach the target")
