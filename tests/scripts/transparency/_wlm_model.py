"""The word-language-model zoo script's model, in its own module as pytorch/examples
keeps it (model.py): torch.save(model) pickles it by this module's name."""

from torch import nn


class RNNModel(nn.Module):
    def __init__(self, tokens: int, width: int) -> None:
        super().__init__()
        self.encoder = nn.Embedding(tokens, width)
        self.rnn = nn.GRU(width, width, batch_first=True)
        self.decoder = nn.Linear(width, tokens)

    def forward(self, x):
        output, _ = self.rnn(self.encoder(x))
        return self.decoder(output)
