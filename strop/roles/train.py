"""The train-step role: every rank computes advantages and the loss on its share and steps the optimizer."""

from __future__ import annotations

from strop.config import Config
from strop.roles.placement import EVERY_RANK
from strop.train.trainer import Trainer


class TrainStep:
    """Every rank's trainer: one step on the step's samples, and its weights to send, save or export."""

    placement = EVERY_RANK

    def __init__(self, cfg: Config, trainer: Trainer):
        self.cfg, self.trainer = cfg, trainer

    def step(self, samples: list) -> dict:
        """Advantages, loss, optimizer step(s) on every rank; the step's metrics."""
        return self.trainer.step(samples)

    def weights(self):
        """Sharded (FSDP, TP): gathered a bucket at a time as rank 0 reads them (strop.parallel.gather)."""
        return self.trainer.weights()

    def final_weights(self):
        """The weights the run saves as its final model (run.save_final), else None."""
        return self.trainer.weights() if self.cfg.run.save_final else None
