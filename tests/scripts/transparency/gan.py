"""A GAN: two models, two optimizers, two GradScalers, detached fakes."""

import torch
from _finish import finish
from torch import nn

torch.manual_seed(0)
generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
critic = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
g_opt = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
d_opt = torch.optim.Adam(critic.parameters(), lr=2e-4, betas=(0.5, 0.999))
g_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**6)
d_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**9)
bce = nn.BCEWithLogitsLoss()

for step in range(8):
    real = torch.randn(16, 8) + 2.0
    fake = generator(torch.randn(16, 4))
    d_opt.zero_grad()
    d_loss = bce(critic(real), torch.ones(16, 1)) + bce(critic(fake.detach()), torch.zeros(16, 1))
    d_scaler.scale(d_loss).backward()
    d_scaler.step(d_opt)
    d_scaler.update()
    g_opt.zero_grad()
    g_loss = bce(critic(fake), torch.ones(16, 1))
    g_scaler.scale(g_loss).backward()
    g_scaler.step(g_opt)
    g_scaler.update()
    print(f"step {step} d {d_loss.item():.6f} g {g_loss.item():.6f}")

finish(generator=generator, critic=critic)
