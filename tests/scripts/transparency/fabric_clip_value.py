"""Lightning Fabric's language-model example in miniature: bf16-mixed on the CPU,
fabric.setup (the model becomes a _FabricModule), fabric.backward and
clip_gradients(clip_val=...) (clip_grad_value_ every step)."""

import torch
from _finish import finish
from lightning.fabric import Fabric
from torch import nn

fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
fabric.seed_everything(0, verbose=False)
net = nn.Sequential(nn.Embedding(12, 8), nn.Flatten(), nn.Linear(24, 12))
optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
model, optimizer = fabric.setup(net, optimizer)
data = torch.randint(0, 12, (6, 4, 4))

for step, batch in enumerate(data):
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(batch[:, :3]), batch[:, 3])
    fabric.backward(loss)
    fabric.clip_gradients(model, optimizer, clip_val=0.25)
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")

finish(model=net)
