"""A mixed-precision training loop to try `fpaudit run` on: an ordinary script, no fpaudit in it.

    python sample_configs/train_loop.py --steps 200              # trains, prints the loss
    fpaudit run --out run-report -- sample_configs/train_loop.py --steps 200 --bugs

fp16 autocast with a GradScaler (on CUDA when there is one, else on the CPU). With --bugs it
makes three mistakes that are easy to make and hard to see: it clips the gradients before
unscale_, logs the gradient norm before unscale_, and steps the LR scheduler after skipped
steps. The initial scale is deliberately high, so the first steps overflow while the
scaler calibrates.
"""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--bugs", action="store_true", help="make the three mistakes")
args = parser.parse_args()

torch.manual_seed(0)
device = torch.device(args.device)
model = nn.Sequential(
    nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 1)
).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
scaler = torch.amp.GradScaler(device.type, init_scale=2.0**24, growth_interval=100)
weights = torch.randn(64, 1, device=device)

for step in range(args.steps):
    x = torch.randn(32, 64, device=device)
    y = torch.sin(x @ weights)
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    if args.bugs:
        norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()  # scaled!
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # clips S times the gradient
    else:
        scaler.unscale_(optimizer)
        norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    if args.bugs or scaler.get_scale() >= scale:  # the fix: no scheduler step on a skipped step
        scheduler.step()
    if step % 50 == 0:
        print(f"step {step}: loss {loss.item():.4f}, grad norm {norm.item():.3g}")
