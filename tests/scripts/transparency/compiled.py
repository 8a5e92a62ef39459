"""torch.compile of one submodule (aot_eager: compiled forward and backward graphs)."""

import torch
from _finish import finish
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.block = torch.compile(nn.Sequential(nn.Linear(16, 16), nn.GELU()), backend="aot_eager")
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.block(torch.relu(self.stem(x))))


torch.manual_seed(0)
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

for step in range(6):
    optimizer.zero_grad()
    loss = model(torch.randn(8, 8)).pow(2).mean()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")

finish(model=model)
