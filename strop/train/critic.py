"""The value model of PPO: the policy's backbone with a scalar head."""

from __future__ import annotations

import torch
from torch import nn

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

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
                position_ids: torch.Tensor | None = None, cp=None) -> torch.Tensor:
        # the state before each response token (N, H); with ``cp`` only this CP rank's entries
        h, _, restore = response_hidden(self.backbone, input_ids, attention_mask, positions, position_ids, cp)
        return restore(self.value_head(h).squeeze(-1).float())  # (B, T)
