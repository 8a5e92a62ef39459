"""bf16 autocast with clipping by value (clip_grad_value_, as Lightning Fabric's
clip_gradients(clip_val=...) and gradient_clip_algorithm="value" call it)."""

import torch
from _finish import finish
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

for step in range(6):
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(16, 8)).float().pow(2).mean()
    loss.backward()
    torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=0.05)
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")

finish(model=model)
