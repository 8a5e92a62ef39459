"""A training loop with the usual mixed-precision mistakes, for `fpaudit run` tests.

GradScaler("cpu") with a small growth interval; the loss is multiplied by 1e36
at the steps named by --overflow-at, so their scaled gradients overflow to inf
and GradScaler skips them. Clipping happens before unscale_ (a bug), and the
scheduler steps every iteration, also after skipped steps (a bug). The `# mark:`
comments let tests find the lines.
"""

import argparse
import json
import time

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--overflow-at", type=int, nargs="*", default=[3, 7])
parser.add_argument("--growth-interval", type=int, default=4)
parser.add_argument("--init-scale", type=float, default=2.0**10)
parser.add_argument("--unscale-first", action="store_true", help="the correct order")
parser.add_argument("--trace", help="write the scaler's own view of every step here (JSON)")
parser.add_argument("--hang-at", type=int, help="at this step, touch --marker and sleep")
parser.add_argument("--marker")
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.99)
scaler = torch.amp.GradScaler(
    "cpu", init_scale=args.init_scale, growth_interval=args.growth_interval
)
data = torch.randn(args.steps, 4, 8)
target = torch.randn(args.steps, 4, 1)

trace = []
for step in range(args.steps):
    if step == args.hang_at:
        open(args.marker, "w").close()
        time.sleep(600)  # until a signal arrives
    optimizer.zero_grad()
    before = scaler.get_scale()
    loss = nn.functional.mse_loss(model(data[step]), target[step])
    if step in args.overflow_at:
        loss = loss * 1e36  # scaled by 2**10 this is above fp32's max: inf gradients
    scaler.scale(loss).backward()  # mark: backward
    if args.unscale_first:
        scaler.unscale_(optimizer)  # mark: unscale
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # mark: clip
    scaler.step(optimizer)  # mark: step
    scaler.update()  # mark: update
    trace.append(
        {
            "scale": before,
            "scale_after": scaler.get_scale(),
            "loss": loss.item(),
            "norm": norm.item(),
        }
    )
    scheduler.step()  # mark: scheduler
    if args.trace:  # rewritten every step: a run stopped early leaves its steps
        with open(args.trace, "w") as handle:
            json.dump(trace, handle)
print("done", step + 1)
