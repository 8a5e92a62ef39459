"""foreach and fused AdamW, several parameter groups, zero_grad(set_to_none=False)."""

import torch
from _finish import finish
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
no_decay = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
groups = [
    {"params": decay, "weight_decay": 0.1},
    {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3},
]
foreach = torch.optim.AdamW(groups, lr=1e-3, foreach=True)
head = nn.Linear(4, 1)
fused = torch.optim.AdamW(head.parameters(), lr=1e-3, fused=True)

for step in range(10):
    foreach.zero_grad(set_to_none=False)
    head.zero_grad(set_to_none=False)
    loss = head(model(torch.randn(8, 8))).pow(2).mean()
    loss.backward()
    foreach.step()
    fused.step()
    print(f"step {step} loss {loss.item():.6f}")

finish(model=model, head=head)
