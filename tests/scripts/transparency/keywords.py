"""Keywords everywhere, in the right order: bf16 autocast, a GradScaler, clipping
of unscaled gradients, a scheduler."""

import torch
from _finish import finish
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(params=model.parameters(), lr=0.05, momentum=0.9)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer=optimizer, step_size=4, gamma=0.5)
scaler = torch.amp.GradScaler(device="cpu", init_scale=2.0**10, growth_interval=3)

for step in range(12):
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(input=model(x).float(), target=y)
    scaler.scale(outputs=loss).backward(retain_graph=False)  # mark: backward
    scaler.unscale_(optimizer=optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0, norm_type=2.0)
    torch.nn.utils.clip_grad_value_(parameters=model.parameters(), clip_value=0.5, foreach=None)
    scaler.step(optimizer=optimizer)
    scaler.update(new_scale=None)
    scheduler.step()
    print(f"step {step} loss {loss.item():.6f} norm {norm.item():.6f}")

finish(model=model)
