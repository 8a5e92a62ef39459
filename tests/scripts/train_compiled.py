"""A plain training loop over a torch.compile'd model (Inductor, the default), for
`fpaudit run`: tests/capture/test_compiled.py checks the compiled backward is audited from the
first step on, under the model's own names. --params PATH saves the parameters after
the last step (bit identity with and without fpaudit)."""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--params")
args = parser.parse_args()

torch.manual_seed(0)
net = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
model = torch.compile(net)
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
data = torch.randn(args.steps, 4, 8)
target = torch.randn(args.steps, 4, 1)

for step in range(args.steps):
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(data[step]), target[step])
    loss.backward()
    optimizer.step()
if args.params:
    torch.save([p.detach() for p in net.parameters()], args.params)
