"""Ends with raise SystemExit(3) after training (a script signalling failure):
fpaudit run exits 3 too, after writing the report."""

import torch
from _finish import finish
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)

for step in range(6):
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(8, 6)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    print(f"step {step} loss {loss.item():.6f}")

finish(model=model)
raise SystemExit(3)
