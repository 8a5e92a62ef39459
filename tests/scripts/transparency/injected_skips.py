"""Overflows injected by construction (issue 54): a custom autograd Function that
multiplies its gradient by 2**20 at step 3, a NaN made in one layer's forward at steps 5
and 6, an inf loss at step 8; GradScaler("cpu") under fp16 autocast skips those steps,
and fpaudit run captures the step after each skip with its forward."""

import torch
from _finish import finish
from torch import nn


class Boost(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


torch.manual_seed(0)
inner, outer = nn.Linear(8, 16), nn.Linear(16, 1)
model = nn.Sequential(inner, nn.Tanh(), outer)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)

for step in range(10):
    optimizer.zero_grad()
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.float16):
        hidden = inner(x)
        if step == 3:
            hidden = Boost.apply(hidden, 2.0**20)
        hidden = torch.tanh(hidden)
        if step in (5, 6):
            hidden = hidden * float("nan")
        loss = outer(hidden).float().pow(2).mean()
    if step == 8:
        loss = loss * float("inf")
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    print(f"step {step} loss {loss.item():.6f} scale {scaler.get_scale():g}")

finish(model=model)
