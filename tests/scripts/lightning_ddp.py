"""FpauditCallback under torchrun: Lightning's DDP on 2 CPU processes, one report of 2 ranks.

torchrun --standalone --nproc-per-node 2 tests/scripts/lightning_ddp.py OUT [FAIL_ON_RANK]
"""

import gc
import sys
import warnings

import lightning as L
import torch
from torch import nn

from fpaudit.integrations.lightning import FpauditCallback
from fpaudit.run.distributed import shutdown

out = sys.argv[1]
fail_on_rank = int(sys.argv[2]) if len(sys.argv) > 2 else None


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        if batch_idx == 2 and self.global_rank == fail_on_rank:
            raise RuntimeError("boom")
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
loader = torch.utils.data.DataLoader(data, batch_size=8)  # Lightning shards it per rank
trainer = L.Trainer(
    max_steps=3,
    accelerator="cpu",
    devices=2,
    strategy="ddp",  # torchrun started both processes; Lightning joins them
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    callbacks=[FpauditCallback(out=out)],
)
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Tiny(), loader)
except BaseException:
    shutdown(wait=False)  # this rank failed alone: leave the group without a barrier
    raise
# The trainer's DDP reducer goes before its process group (gloo aborts the other way
# round), then every rank meets and leaves the group while Python is whole.
del trainer
gc.collect()
shutdown()
