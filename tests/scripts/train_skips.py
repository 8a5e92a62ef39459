"""A GradScaler loop (CPU autocast fp16) with overflows injected by construction, for
the origins of `fpaudit run`'s skipped steps.

--boost-at STEP K: the backward of the `boost` module (a custom autograd Function)
multiplies its gradient by 2**K at STEP: an fp16 backward op makes inf there, and the
gradients of the parameters before it (layer `inner`) hold inf; those after it stay finite.
--nan-at STEP: the `poison` module's forward makes a NaN at STEP (a forward problem).
--inf-loss-at STEP: the loss is multiplied by inf at STEP.
--grow K: from step 2 on, the boost is 2**(K*step): the gradients outgrow every scale.
--save FILE: the final weights, for transparency tests.
--probe FILE: per boosted step, the largest finite |output| of the boost's backward
multiply, and per step the parameters whose (scaled) gradients hold inf/NaN, as torch
computed them (oracles written beside the run, read by the tests).
"""

import argparse
import json
import math

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--boost-at", type=int, nargs=2, action="append", default=[])
parser.add_argument("--nan-at", type=int, nargs="*", default=[])
parser.add_argument("--inf-loss-at", type=int, nargs="*", default=[])
parser.add_argument("--grow", type=int, default=0)
parser.add_argument("--init-scale", type=float, default=2.0**8)
parser.add_argument("--save")
parser.add_argument("--probe")
args = parser.parse_args()
probe: dict[int, float] = {}
broken: dict[int, list[str]] = {}
made: dict[int, bool] = {}  # the boost's multiply made inf/NaN
current_step = 0


class Boost(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):  # type: ignore[no-untyped-def]
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        out = grad * ctx.factor
        if args.probe:
            finite = out[torch.isfinite(out)].abs()
            probe[current_step] = float(finite.max()) if finite.numel() else 0.0
            made[current_step] = bool(finite.numel() < out.numel())
        return out, None


class Booster(nn.Module):
    factor = 1.0

    def forward(self, x):  # type: ignore[no-untyped-def]
        return Boost.apply(x, self.factor) if self.factor != 1.0 else x


class Poison(nn.Module):
    active = False

    def forward(self, x):  # type: ignore[no-untyped-def]
        return x * float("nan") if self.active else x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 16)
        self.boost = Booster()
        self.act = nn.Tanh()
        self.poison = Poison()
        self.outer = nn.Linear(16, 1)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.outer(self.poison(self.act(self.boost(self.inner(x)))))


torch.manual_seed(0)
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=args.init_scale, growth_interval=1000)
data, target = torch.randn(args.steps, 4, 8), torch.randn(args.steps, 4, 1)
boosts = {step: 2.0**k for step, k in args.boost_at}
for step in range(args.steps):
    current_step = step
    model.boost.factor = boosts.get(
        step, 2.0 ** (args.grow * step) if args.grow and step >= 2 else 1.0
    )
    model.poison.active = step in args.nan_at
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(data[step]).float(), target[step])
    if step in args.inf_loss_at:
        loss = loss * float("inf")
    scaler.scale(loss).backward()
    if args.probe:
        grads = {name: p.grad for name, p in model.named_parameters()}
        broken[step] = [name for name, g in grads.items() if not torch.isfinite(g).all()]
    scaler.step(optimizer)
    scaler.update()
    print(f"step {step} scale {scaler.get_scale():g} loss {loss.item():.6f}")
if args.save:
    torch.save(model.state_dict(), args.save)
if args.probe:
    with open(args.probe, "w") as handle:
        amax = {str(k): v if math.isfinite(v) else None for k, v in probe.items()}
        nonfinite = {str(k): v for k, v in broken.items()}
        boost = {str(k): v for k, v in made.items()}
        json.dump({"amax": amax, "nonfinite": nonfinite, "boost_made_inf": boost}, handle)
