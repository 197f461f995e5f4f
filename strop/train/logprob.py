"""Per-token logprobs and entropy of response tokens.

The lm_head runs only at positions that predict a response token, so the
prompt part never materialises [tokens, vocab] logits. (Chunking over the
response tokens as well is the next step; see the algorithms issue.)
"""

from __future__ import annotations

import torch


def response_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      response_positions: torch.Tensor, *, temperature: float = 1.0,
                      with_entropy: bool = False, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs of the tokens at ``response_positions`` under ``log_softmax(logits / temperature)``.

    input_ids, attention_mask: (B, L), right-padded. response_positions: (B, T)
    indices into L of each response token (padding entries may repeat any
    valid index; the caller masks them). Returns logprobs (B, T) and, if asked,
    the entropy (B, T) of the same distribution (detached unless ``entropy_grad``:
    an entropy bonus needs its gradient, a metric does not).
    """
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    # the token at position p is predicted by the hidden state at p - 1
    pred_pos = (response_positions - 1).clamp(min=0)  # (B, T)
    h = hidden.gather(1, pred_pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # (B, T, H)
    logits = model.get_output_embeddings()(h).float()  # (B, T, V)
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature  # the rollout's distribution, so the ratio compares like with like
    logp_all = torch.log_softmax(logits, dim=-1)
    targets = input_ids.gather(1, response_positions)  # (B, T)
    logprobs = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs, entropy
