"""The receipt every engine kind can give: a fixed short token sequence scored by each engine and by the
trainer after a weight update. Checksums prove bytes arrived where an engine computes one strop can
reproduce (strop serve, strop's vLLM extension); the probe proves the engine *computes* with the
trainer's weights, whatever it is (SGLang, whose checksums cover its own fused tensors, has no other).

It sees what moves a short sequence's logprobs by more than the tolerance: an engine that kept old
weights while the trainer moved on (verl #7495, an adapter that never reached vLLM), one serving another
model, one whose load went wrong. A single small optimizer step may move them by less: there the
version read back and the checksums are the receipt.

The engine side and the reference are here; the comparison (:func:`strop.wire.probe.check_probe`) is the
trainer's.
"""

from __future__ import annotations

import torch


def reference_logprobs(model, ids: list[int]) -> list[float]:
    """The trainer's logprob of each token of ``ids`` after the first (temperature 1, fp32)."""
    return prompt_logprobs(model, ids)[0]


def prompt_logprobs(
    model, ids: list[int], temperature: float = 1.0, top: int = 0
) -> tuple[list[float], list[dict[int, float] | None]]:
    """Each token of ``ids`` after the first: its logprob under logits / ``temperature`` (fp32) given the
    tokens before it, and with ``top`` the ``top`` most likely ``{token_id: logprob}`` there (else None).
    The model's train/eval mode is put back (a shared model is the trainer's)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            x = torch.tensor([ids], device=next(model.parameters()).device)
            logits = model(input_ids=x).logits[0, :-1].float()  # (P - 1, V): each predicts the next token
    finally:
        model.train(was_training)
    lp = torch.log_softmax(logits / temperature, dim=-1)
    picked = lp.gather(-1, x[0, 1:, None]).squeeze(-1).tolist()
    if not top:
        return picked, [None] * len(picked)
    values, top_ids = (t.tolist() for t in torch.topk(lp, min(top, lp.shape[-1]), dim=-1))
    return picked, [dict(zip(i, v)) for i, v in zip(top_ids, values)]
