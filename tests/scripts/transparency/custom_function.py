"""A custom autograd.Function (straight-through clamp) and torch.autograd.backward
called with keywords."""

import torch
from _finish import finish
from torch import nn


class StraightThroughClamp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, limit):
        ctx.save_for_backward(x)
        return x.clamp(-limit, limit)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (1.0 + 0.1 * torch.sign(x)), None


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1))
optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**5)

for step in range(8):
    optimizer.zero_grad()
    hidden = StraightThroughClamp.apply(model[0](torch.randn(8, 8)), 0.5)
    loss = model[1](hidden).pow(2).mean()
    torch.autograd.backward(tensors=scaler.scale(loss), grad_tensors=None)
    scaler.step(optimizer)
    scaler.update()
    print(f"step {step} loss {loss.item():.6f}")

finish(model=model)
