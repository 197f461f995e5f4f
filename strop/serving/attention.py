"""The kv-cache decoder's attention for one new token per row (:meth:`strop.serving.kvdecode.LlamaDecoder.step`):
``q`` (B, KV, G, D), a kv head's G query heads against its keys and values (B, KV, T, D), masked by an additive
``bias`` (B, 1, 1, T).

Two ways, the engine's ``compile_attention`` choosing:
- eager: ``F.scaled_dot_product_attention``, one fused kernel. On a CPU its flash kernel works in blocks of
  query positions, and a decode step has G (3 in SmolLM2) per kv head: it reaches about 34 GFLOP/s at batch 64.
- compiled: the same attention written as two reductions in fp32 and compiled by Inductor into one loop nest
  over the cache (measured on a 2-core AMD EPYC at batch 64: 1.2x faster than eager in fp32, 1.7-2.1x in
  bf16, where it also keeps the probabilities in fp32; bench/attention.py). Compiled for any batch and length
  (dynamic shapes; a cache view at storage offset 0 is specialised once more); Inductor's cache on disk makes
  later processes' compiles short.
  Where it cannot compile (no C++ compiler, an unsupported device) it says why in one line and stays eager.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
import torch.nn.functional as F

log = logging.getLogger("strop.serving")


def eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)


def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """The attention as Inductor fuses it: scores, softmax and the weighted sum in fp32 (read once, no
    (B, KV, G, T, D) tensor is built once compiled)."""
    scores = (q.float().unsqueeze(-2) * k.float().unsqueeze(2)).sum(-1) * scale + bias.float()  # (B, KV, G, T)
    probs = torch.softmax(scores, dim=-1)
    return (probs.unsqueeze(-1) * v.float().unsqueeze(2)).sum(-2).to(q.dtype)


def one_line(err: Exception) -> str:
    """A failed compile as the log names it: the exception's type and its message's first line."""
    first_line = (str(err).strip().splitlines() or [""])[0][:200]
    return f"{type(err).__name__}: {first_line}"


HINT_ROWS, HINT_KEYS = 64, 256  # the sizes the compiled loops are laid out for


def _typical(q: torch.Tensor):
    """Inputs like a decode step's at a typical batch and length (``HINT_ROWS`` rows, ``HINT_KEYS`` columns of a
    longer cache), with ``q``'s heads, size, dtype and device: measured on a 2-core AMD EPYC in fp32, the loops
    Inductor laid out for a first call of 4 rows ran the engine 4-10 % slower at 32-64 rows than the fused kernel,
    and those laid out for 64 rows 3-6 % faster."""
    _, KV, G, D = q.shape
    cache = torch.zeros(2, HINT_ROWS, KV, HINT_KEYS + 64, D, dtype=q.dtype, device=q.device)
    bias = torch.zeros(HINT_ROWS, 1, 1, HINT_KEYS, dtype=q.dtype, device=q.device)
    typical_q = torch.empty_strided((HINT_ROWS, KV, G, D), q.stride(), dtype=q.dtype, device=q.device).zero_()
    return typical_q, cache[0, :, :, :HINT_KEYS], cache[1, :, :, :HINT_KEYS], bias  # (q laid out as the step's)


class CompiledAttention:
    """:func:`fused` compiled on first use, shared by every decoder of the process, for steps of ``from_rows``
    rows or more (fewer run :func:`eager`: measured on a 2-core AMD EPYC, the engine with it decoded 0.88-0.94x as
    fast at 1 and 8 rows, as fast at 16, 1.03-1.12x at 32-64). ``seconds``: the compile time (the first call's),
    ``reason``: why it fell back to :func:`eager` ('' while it has not)."""

    def __init__(self, from_rows: int = 32):
        self.from_rows = from_rows
        self._fn = None
        self._lock = threading.Lock()
        self.seconds = 0.0
        self.reason = ""

    def __call__(self, q, k, v, bias, scale):
        if self.reason or q.device.type != "cpu" or q.shape[0] < self.from_rows:
            return eager(q, k, v, bias, scale)
        if self._fn is None:
            with self._lock:
                if self._fn is None and not self.reason:
                    self._compile(q, k, v, bias, scale)
            if self.reason:
                return eager(q, k, v, bias, scale)
        return self._fn(q, k, v, bias, scale)

    def _compile(self, q, k, v, bias, scale) -> None:
        start = time.perf_counter()
        try:
            from torch._inductor import config as inductor

            fn = torch.compile(fused, dynamic=True, fullgraph=True)
            with inductor.patch(compile_threads=1):  # in this process: no pool of compile workers left running
                fn(*_typical(q), scale)  # (Inductor lays out its loops for the sizes it first sees)
                fn(q, k, v, bias, scale)
        except Exception as err:  # noqa: BLE001 (any compile failure falls back, named once)
            self.reason = one_line(err)
            log.warning("decode attention: not compiled (%s); the eager kernel runs", self.reason)
            return
        self.seconds = time.perf_counter() - start
        self._fn = fn
        log.info("decode attention: compiled in %.1f s", self.seconds)


COMPILED = CompiledAttention()
