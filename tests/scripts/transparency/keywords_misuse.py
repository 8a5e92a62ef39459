"""Keyword calls made in the wrong order: clipping before unscale_ (by keyword, and in
torch's two parts as accelerate >= 1.16 clips), then a .grad read while scaled;
fpaudit must name each line."""

import torch
from _finish import finish
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=100)

for step in range(6):
    optimizer.zero_grad()
    loss = model(torch.randn(16, 8)).pow(2).mean()
    scaler.scale(outputs=loss).backward()
    torch.nn.utils.clip_grad_norm_(parameters=model.parameters(), max_norm=1.0)  # mark: norm
    torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=0.5)  # mark: value
    grads = [p.grad for p in model.parameters()]  # mark: grads
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, total_norm=total)  # mark: parts
    peak = max(p.grad.abs().max().item() for p in model.parameters())  # mark: read
    scaler.step(optimizer=optimizer)
    scaler.update()
    print(f"step {step} loss {loss.item():.6f} peak {peak:.3f}")

finish(model=model)
