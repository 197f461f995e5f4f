"""Routed experts on the wire (MoE routing replay): the experts each token was routed to, as the two engine
dialects send them.

- SGLang 0.5.23's ``/generate`` with ``return_routed_experts: true`` answers ``meta_info.routed_experts``: base64 of
  the int32 array ``[tokens, layers, top_k]`` flattened, no shape; the tokens are
  ``[routed_experts_start_len, prompt + output - 1)``, so a reader knows their count, not layers and top_k apart.
- vLLM 0.32's ``/v1/completions`` (server started with ``--enable-return-routed-experts``) answers each choice's
  ``routed_experts``: base64 of a ``.npy`` file of ``[prompt + output - 1, layers, top_k]`` (uint8, uint16 or int32).

strop serve writes both; strop's clients read both into int16 tensors (:class:`strop.types.Completion`'s layout).
"""

from __future__ import annotations

import base64
import io

import numpy as np
import torch


def sglang_routes(routes: torch.Tensor, start: int = 0) -> str:
    """SGLang's ``meta_info.routed_experts`` of ``routes`` from token ``start`` on."""
    return base64.b64encode(routes[start:].to(torch.int32).contiguous().numpy().astype("<i4").tobytes()).decode()


def read_sglang_routes(text: str, tokens: int) -> torch.Tensor:
    """SGLang's ``meta_info.routed_experts`` for ``tokens`` tokens as int16 ``[tokens, layers * top_k]`` (the
    trainer, which knows the model, splits the last dimension); ValueError if it cannot be that."""
    data = np.frombuffer(base64.b64decode(text, validate=True), dtype="<i4")
    if tokens <= 0 or data.size % tokens:
        raise ValueError(f"routed_experts holds {data.size} expert ids, not a whole number per each of {tokens} tokens")
    return torch.from_numpy(data.astype(np.int16)).reshape(tokens, -1)


def vllm_routes(routes: torch.Tensor) -> str:
    """vLLM's ``routed_experts`` of ``routes``: a base64 ``.npy`` file."""
    with io.BytesIO() as buffer:
        np.save(buffer, routes.to(torch.int32).numpy(), allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode("ascii")


def read_vllm_routes(text: str) -> torch.Tensor:
    """vLLM's ``routed_experts`` as int16 ``[tokens, layers, top_k]``; ValueError if it is not such an array."""
    array = np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)
    if array.ndim != 3 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"routed_experts is a {array.dtype} array of shape {array.shape}, not [tokens, layers, top_k]")
    return torch.from_numpy(array.astype(np.int16))
