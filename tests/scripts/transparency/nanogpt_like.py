"""nanoGPT's train.py in miniature: gradient accumulation with the loss divided by the
micro-steps, fp16 autocast and a GradScaler, unscale_ then clip_grad_norm_,
zero_grad(set_to_none=True) after the step, torch.compile of the model, an
estimate_loss() under no_grad and a checkpoint (state dicts) saved at each evaluation."""

import os

import torch
from _finish import finish, saves
from torch import nn
from torch.nn import functional as F


class GPT(nn.Module):
    def __init__(self, vocab=16, width=16, block=8):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(block, width)
        self.ln = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        x = x + self.mlp(self.ln(x))
        logits = self.lm_head(x)
        loss = (
            None
            if targets is None
            else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        )
        return logits, loss


torch.manual_seed(1337)
data = torch.randint(0, 16, (400,))
folder = saves()


def get_batch():
    ix = torch.randint(len(data) - 9, (4,))
    x = torch.stack([data[i : i + 8] for i in ix])
    y = torch.stack([data[i + 1 : i + 9] for i in ix])
    return x, y


raw_model = GPT()
optimizer = torch.optim.AdamW(raw_model.parameters(), lr=1e-3, betas=(0.9, 0.95))
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
model = torch.compile(raw_model, backend=os.environ.get("FPAUDIT_ZOO_BACKEND", "aot_eager"))
ctx = torch.autocast("cpu", dtype=torch.float16)
accumulation = 2


@torch.no_grad()
def estimate_loss():
    model.eval()
    with ctx:
        losses = [model(*get_batch())[1].item() for _ in range(2)]
    model.train()
    return sum(losses) / len(losses)


X, Y = get_batch()
for iter_num in range(6):
    if iter_num % 3 == 0:
        print(f"eval {iter_num} val loss {estimate_loss():.4f}")
        checkpoint = {
            "model": raw_model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "iter_num": iter_num,
        }
        torch.save(checkpoint, os.path.join(folder, "ckpt.pt"))
    for _micro_step in range(accumulation):
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / accumulation
        X, Y = get_batch()
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {iter_num} loss {loss.item() * accumulation:.4f} scale {scaler.get_scale():g}")

finish(model=raw_model)
