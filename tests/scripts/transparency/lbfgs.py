"""LBFGS steps with a closure that calls backward (several times per step)."""

import torch
from _finish import finish
from torch import nn

torch.manual_seed(0)
model = nn.Linear(6, 1)
x, y = torch.randn(32, 6), torch.randn(32, 1)
optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=5)


def closure():
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss


for step in range(5):
    loss = optimizer.step(closure=closure)
    print(f"step {step} loss {loss.item():.6f}")

finish(model=model)
