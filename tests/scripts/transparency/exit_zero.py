"""Ends with an explicit sys.exit(0) after training: exit 0, as a script that just ends."""

import sys

import torch
from _finish import finish
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

for step in range(6):
    optimizer.zero_grad()
    loss = model(torch.randn(8, 6)).pow(2).mean()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")

finish(model=model)
sys.exit(0)
