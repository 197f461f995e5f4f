"""The value model of PPO: the policy's backbone with a scalar head."""

from __future__ import annotations

import torch
from torch import nn

from strop.algo.losses import aggregate, value_loss
from strop.parallel.packing import unpack
from strop.train.logprob import response_hidden


class ValueModel(nn.Module):
    """``V(prefix)`` for every response token, read at the position that predicts it."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)  # start at V = 0: the first value loss is 0.5 * R^2
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_causal_lm(cls, model) -> "ValueModel":
        backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        return cls(backbone, model.config.hidden_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        positions: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cp=None,
        pred_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # the state before each response token (N, H); with ``cp`` only this CP rank's entries
        h, _, restore = response_hidden(
            self.backbone, input_ids, attention_mask, positions, position_ids, cp, pred_positions
        )
        return restore(self.value_head(h).squeeze(-1).float())  # (B, T)


def critic_values(trainer, batch: dict) -> torch.Tensor:
    """The critic's values of a collated micro-batch (B, T) or, for a packed row, (n, T)."""
    with trainer._precision():
        values = trainer.critic(
            batch["input_ids"],
            batch["attention_mask"],
            batch["positions"],
            position_ids=batch.get("position_ids"),
            cp=batch.get("cp"),
            pred_positions=batch.get("pred_positions"),
        ).float()
    return unpack(values, batch) if "scatter" in batch else values


def train_critic(trainer, b, mini: list[int], m, n_mini: int) -> None:
    """One optimizer step of ``trainer``'s critic on the samples ``mini`` of the step batch ``b``: PPO's clipped
    value loss, token mean over the mini-batch, into the step's stats ``m``."""
    total = float(b.loss_mask[mini].sum())
    for idx, real in trainer.dp.share(trainer._micro_batches(mini, b.samples)):
        batch = trainer._collate([b.samples[i] for i in idx])
        mask = batch["loss_mask"]
        Tm = mask.shape[1]
        values = critic_values(trainer, batch)
        old, ret = b.old_values[idx, :Tm].to(trainer.device), b.returns[idx, :Tm].to(trainer.device)
        per_token, info = value_loss(values, old, ret, clip=trainer.algo.value_clip)
        loss = aggregate(per_token, mask, "token_mean", num_sequences=float(len(mini)), total_tokens=total)
        (loss * trainer.dp.loss_scale(real)).backward()
        if real:
            m.add("value_loss", loss.item() / n_mini)
            m.tok("value_clip_fraction", info["value_clipped"].float(), mask)
    m.last("critic_grad_norm", trainer.critic_opt.step(m))
