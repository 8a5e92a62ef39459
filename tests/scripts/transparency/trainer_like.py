"""A small hand-written loop shaped like Hugging Face's Trainer: a training_step
method, accumulation, unscale_ then clip, warm-up and plateau schedulers, logging
of the unscaled gradient norm, and an evaluation pass without gradients."""

import math

import torch
from _finish import finish
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, vocab=32, width=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.out = nn.Linear(width, vocab)
        self.out.weight = self.embed.weight  # tied

    def forward(self, tokens, labels=None):
        logits = self.out(torch.tanh(self.mix(self.embed(tokens))))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


class Trainer:
    def __init__(self, model, steps, accumulation=2, max_grad_norm=1.0):
        self.model = model
        self.steps = steps
        self.accumulation = accumulation
        self.max_grad_norm = max_grad_norm
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
        self.warmup = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda=lambda s: min(1.0, (s + 1) / 4)
        )
        self.plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(self.optimizer, patience=1)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=4)

    def training_step(self, batch):
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            loss = self.model(**batch)["loss"].float() / self.accumulation
        self.scaler.scale(loss).backward()
        return loss.detach()

    def evaluate(self, batch):
        self.model.eval()
        with torch.no_grad():
            loss = self.model(**batch)["loss"]
        self.model.train()
        return loss.item()

    def train(self):
        generator = torch.Generator().manual_seed(1)
        for step in range(self.steps):
            total = 0.0
            for _ in range(self.accumulation):
                tokens = torch.randint(0, 32, (4, 6), generator=generator)
                total += self.training_step({"tokens": tokens, "labels": tokens.roll(1, 1)})
            self.scaler.unscale_(self.optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), max_norm=self.max_grad_norm
            )
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.warmup.step()
            self.optimizer.zero_grad(set_to_none=True)
            eval_loss = self.evaluate({"tokens": tokens, "labels": tokens})
            self.plateau.step(metrics=eval_loss)
            print(
                f"step {step} loss {float(total):.6f} grad_norm {grad_norm.item():.6f} "
                f"grads {len(grads)} eval {eval_loss:.6f} finite {math.isfinite(eval_loss)}"
            )


torch.manual_seed(0)
model = TinyLM()
Trainer(model, steps=8).train()
finish(model=model)
