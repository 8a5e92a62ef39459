"""pytorch/examples' word_language_model in miniature: no torch.optim (the default
update is p.data.add_(p.grad, alpha=-lr) after clip_grad_norm_), model.zero_grad()
per batch, an evaluation and torch.save(model) every epoch, the best model reloaded
at the end; copy.deepcopy and pickle.dumps of the model between steps."""

import copy
import os
import pickle

import torch
from _finish import finish, saves
from _wlm_model import RNNModel
from torch import nn

torch.manual_seed(0)
tokens, lr = 12, 2.0
model = RNNModel(tokens, 8)
data = torch.randint(0, tokens, (6, 5, 7))  # batches x sequences x length
criterion = nn.CrossEntropyLoss()
folder = saves()


def evaluate():
    model.eval()
    with torch.no_grad():
        out = model(data[-1, :, :-1])
        return criterion(out.reshape(-1, tokens), data[-1, :, 1:].reshape(-1)).item()


step = 0
for epoch in range(2):
    model.train()
    for batch in data[:-1]:
        model.zero_grad()
        output = model(batch[:, :-1])
        loss = criterion(output.reshape(-1, tokens), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        print(f"step {step} loss {loss.item():.6f}")
        step += 1
    print(f"epoch {epoch} valid loss {evaluate():.6f}")
    with open(os.path.join(folder, f"model-{epoch}.pt"), "wb") as file:
        torch.save(model, file)
    twin = copy.deepcopy(model)
    print(f"copy and pickle: {len(pickle.dumps(model)) > 0} {type(twin).__name__}")

with open(os.path.join(folder, "model-1.pt"), "rb") as file:
    model = torch.load(file, weights_only=False)
print(f"reloaded valid loss {evaluate():.6f}")
finish(model=model)
