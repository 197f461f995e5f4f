"""The value model of PPO: the policy's backbone with a scalar head."""

from __future__ import annotations

import torch
from torch import nn


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
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids).last_hidden_state  # (B, L, H)
        pred_pos = (positions - 1).clamp(min=0)  # the state before each response token
        h = hidden.gather(1, pred_pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # (B, T, H)
        return self.value_head(h).squeeze(-1).float()  # (B, T)
