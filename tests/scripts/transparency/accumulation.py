"""Gradient accumulation: 4 micro-batches per step under one scale, then unscale_,
clip and step once; a scheduler by LambdaLR warm-up."""

import torch
from _finish import finish
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
accumulate = 4

for step in range(8):
    for _micro in range(accumulate):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(4, 8)).float().pow(2).mean() / accumulate
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    print(f"step {step} loss {loss.item():.6f} scale {scaler.get_scale():g}")

finish(model=model)
