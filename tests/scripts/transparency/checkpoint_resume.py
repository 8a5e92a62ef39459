"""Save a checkpoint mid-run (model, optimizer, scaler state), build the model and the
optimizer anew, reload it and go on; copy.deepcopy (an EMA twin) between backward and
step, while the capture is open; torch.jit.trace at the end."""

import copy
import os

import torch
from _finish import finish, saves
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 12), nn.ReLU())
        self.head = nn.Linear(12, 1)

    def forward(self, x):
        return self.head(self.body(x))


def build():
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


torch.manual_seed(0)
folder = saves()
checkpoint = os.path.join(folder, "checkpoint.pt")
model, optimizer = build()
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
x, y = torch.randn(32, 6), torch.randn(32, 1)
ema = None

for step in range(6):
    if step == 3:
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(),
                    "scaler": scaler.state_dict(), "step": step}, checkpoint)  # fmt: skip
        model, optimizer = build()
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        scaler.load_state_dict(state["scaler"])
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    ema = copy.deepcopy(model)  # between backward and step: the capture is open
    scaler.step(optimizer)
    scaler.update()
    print(f"step {step} loss {loss.item():.6f} scale {scaler.get_scale():g}")

traced = torch.jit.trace(model, x[:2])
print(f"traced {traced(x[:2]).shape} ema {ema.head.weight.shape}")
torch.save(model.state_dict(), os.path.join(folder, "final.pt"))
finish(model=model)
