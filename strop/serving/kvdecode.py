"""A decode loop for Llama-family models with a preallocated KV cache, shared prompt prefixes and continuous batching.

The embedded engine uses it for the models it knows (``llama``, ``qwen2``, ``qwen3`` with its per-head query/key
norms, ``qwen3_moe`` with routed experts (:mod:`strop.serving.moe`, which records the routes), ``mistral``; without a
sliding window); anything else falls back to Hugging Face's forward with a ``DynamicCache``. It sees a weight update
(``load_state_dict`` or a broadcast into the parameters) at the next step.

The running batch, its cache slots and its layout, is :mod:`strop.serving.batch`.

Prefix sharing. Prompts admitted together are prefilled once each; a prompt's keys and values are copied into each
of its rows, and each row samples its first token independently from the prompt's logits. The tokens all of them
start with (a chat template's system prompt) are forwarded once (:mod:`strop.serving.prefix`).

Batch invariance. With ``batch_invariant=True`` a row's tokens and logprobs do not depend on its batch: each prompt
is prefilled alone, a step's linear layers use a kernel whose rows do not change with the row count, and each row
attends exactly its own columns (:mod:`strop.serving.invariant`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strop.serving.attention import COMPILED, eager
from strop.serving.invariant import attend_rows, exact_mkl, packed_rows, prefill_each, prefill_packed, rows_linear
from strop.serving.cpu_kernels import choose, unavailable
from strop.serving.linear import PackedLinear, return_freed_memory
from strop.serving.moe import RoutedExperts, is_routed
from strop.serving.prefix import forward_prompts, prefill_shared

SUPPORTED = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral")


def unsupported_reason(model) -> str | None:
    """Why the fast decoder cannot run ``model`` (None when it can)."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in SUPPORTED:
        return f"model_type {kind!r} is not one of {SUPPORTED}"
    if getattr(cfg, "sliding_window", None) and (
        kind not in ("qwen2", "qwen3") or getattr(cfg, "use_sliding_window", False)
    ):
        return "sliding-window attention"
    backbone = getattr(model, "model", None)
    if backbone is None or not all(hasattr(backbone, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "not the usual (embed_tokens, layers, norm, rotary_emb) layout"
    attn = backbone.layers[0].self_attn
    if not kind.startswith("qwen3") and any(hasattr(attn, a) for a in ("q_norm", "k_norm")):
        return "query/key norms (not a plain Llama attention)"
    if kind.startswith("qwen3") and not all(hasattr(attn, a) for a in ("q_norm", "k_norm")):
        return "a Qwen3 attention without its query/key norms"
    return None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.addcmul(x * cos, torch.cat((-x[..., half:], x[..., :half]), dim=-1), sin)


class LlamaDecoder:
    def __init__(
        self, model, *, prepack: bool = True, batch_invariant: bool = False, kernels: str = "auto", compiled=False
    ):
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"the fast decoder cannot run this model: {reason}")
        self.lm, self.backbone, cfg = model, model.model, model.config
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group = self.n_heads // self.n_kv
        self.scale = self.head_dim**-0.5
        self.layers, self.qk_norms = [], []
        for layer in self.backbone.layers:
            a, m = layer.self_attn, layer.mlp
            self.qk_norms.append((a.q_norm, a.k_norm) if hasattr(a, "q_norm") else None)  # Qwen3: per head, pre-RoPE
            dense = not is_routed(m)  # else (None, None, the routed experts) in the MLP's places
            self.layers.append(
                (
                    layer.input_layernorm,
                    PackedLinear([a.q_proj, a.k_proj, a.v_proj]),
                    PackedLinear([a.o_proj]),
                    layer.post_attention_layernorm,
                    PackedLinear([m.gate_proj, m.up_proj]) if dense else None,
                    PackedLinear([m.down_proj]) if dense else None,
                    m.act_fn if dense else RoutedExperts(m),
                )
            )
        self.head = PackedLinear([model.lm_head])
        self.linears = [lin for parts in self.layers for lin in parts[1:3] + parts[4:6] if lin] + [self.head]
        self.routed = sum(parts[4] is None for parts in self.layers)  # MoE layers
        self.routes: list[torch.Tensor] = []  # the last forward's expert choices, one entry per MoE layer
        w = self.backbone.embed_tokens.weight
        self.kernel = choose(kernels, w.dtype, w.device)  # the linear layers' kernel (strop.serving.cpu_kernels)
        self.prepack = prepack and self.kernel != "plain"
        exact = w.dtype == torch.float32 and not unavailable("mkl", w.dtype) and (not batch_invariant or exact_mkl())
        self.exact_kernel = "mkl" if exact else "plain"  # batch-invariant steps' kernel (strop.serving.invariant)
        self._seen = None  # the parameters' (address, version) when the fused weights were built
        self.batch_invariant = batch_invariant
        self.share_prefix = True  # forward the prompts' common prefix once (strop.serving.prefix)
        self.exact_slots = True  # a step computes only the running rows where the kernel allows (slot_step)
        self.shared_tokens = 0  # prompt tokens the last prefill did not forward again
        self.block_lse = None  # the last step's logits' block logsumexps, where the step computed them
        self.attend = COMPILED if compiled else eager  # a plain step's attention (strop.serving.attention)

    @property
    def slot_step(self) -> int:
        """:func:`slots_for`'s ``step`` for this decoder's batch. 1 where one packing of the weights serves every
        row count (oneDNN, or no packing): a finished row stops costing the step's linear layers and attention at
        once (measured in a GRPO batch of 64 rows: with buckets of 16 slots, 10 % of the rows a step computed
        had finished; 1.04-1.13x the tokens a second without them, bench/slots.py). 16 where MKL's packing is made for the row
        count (each change packs every weight again) and for batch-invariant steps (speculation's buckets)."""
        return 16 if self.batch_invariant or self.kernel == "mkl" or not self.exact_slots else 1

    @property
    def device(self):
        return self.backbone.embed_tokens.weight.device

    @property
    def dtype(self):
        return self.backbone.embed_tokens.weight.dtype

    def _signature(self):
        return [(p.data_ptr(), p._version) for p in self.lm.parameters()]

    def release(self) -> None:
        """Drop the fused and packed weights (rebuilt at the next forward). The engine calls it at every weight
        load (a broadcast into the parameters does not bump their version counters) and, beside a trainer, when
        a busy period ends: the weights change before the next rollout anyway, and the memory is free while the
        trainer works."""
        for lin in self.linears:
            lin.weight = lin.bias = lin.packed = lin.packed_kernel = lin.packed_bias = None
            lin.packed_rows, lin.packs = 0, {}
        self._seen = None
        return_freed_memory()

    def _sync(self, rows: int | None = None, keep: bool = False) -> None:
        sig = self._signature()
        if sig != self._seen:
            for lin in self.linears:
                lin.refresh()
            self._seen = sig
        kernel = self.exact_kernel if self.batch_invariant else self.kernel
        if (rows is not None or kernel == "onednn") and self.prepack and kernel != "plain":  # (oneDNN: any rows)
            for lin in self.linears:
                lin.kernel = kernel
                lin.pack(rows, keep=True) if keep else lin.pack(rows)

    @staticmethod
    def _norm(module, x):
        if x.dtype == torch.float32 and module.weight.dtype == torch.float32:
            # one fused kernel, bitwise equal to the module's own formula in fp32 (tested), instead of six
            return F.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
        return module.weight * h.to(x.dtype)

    def _split_rope(self, qkv, cos, sin, norms=None):
        """(..., (H + 2 KV) * D) -> rotated q (..., H, D), rotated k and v (..., KV, D); ``norms`` (Qwen3's
        q_norm, k_norm) normalise each query and key head before the rotation."""
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        qkv = qkv.view(*qkv.shape[:-1], H + 2 * KV, D)
        qk, v = qkv[..., : H + KV, :], qkv[..., H + KV :, :]
        if norms is not None:
            qk = torch.cat([self._norm(norms[0], qk[..., :H, :]), self._norm(norms[1], qk[..., H:, :])], dim=-2)
        qk = _rotate(qk, cos, sin)
        return qk[..., :H, :], qk[..., H:, :], v

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor):
        """Left-padded prompts ``ids`` (N, P). Returns last-position logits (N, V) and the keys and
        values (layers, N, KV, P, D), rotary embedding applied. ``shared_tokens``: the prompt tokens it saved."""
        self._sync()
        self.shared_tokens = 0
        if self.batch_invariant and self.prepack and self.exact_kernel == "mkl":
            return prefill_packed(self, ids, lengths)
        if self.batch_invariant:  # each prompt alone, unpadded; the logits through F.linear (3-D input)
            return prefill_each(self._prefill, ids, lengths)
        if self.routed or not self.share_prefix:  # (routes are recorded per prompt token)
            return self._prefill(ids, lengths, PackedLinear.batched)
        return prefill_shared(self, ids, lengths, PackedLinear.batched)

    def _mlp(self, h, gate_up, down, act, lin=PackedLinear.__call__):
        if gate_up is None:  # routed experts (strop.serving.moe): their choices kept for the rows
            out, chosen = act(h)
            self.routes.append(chosen)
            return out
        g, u = lin(gate_up, h).chunk(2, dim=-1)
        return lin(down, act(g).mul_(u))

    def _prefill(self, ids: torch.Tensor, lengths: torch.Tensor, lin=PackedLinear.__call__):
        return forward_prompts(self, ids, lengths, lin)

    @torch.no_grad()
    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        col: int,
        lo: int,
        bias: torch.Tensor,
        starts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Feed one token per row (B,) at cache column ``col``; attend over columns ``lo..col``
        with the additive ``bias`` (B, 1, 1, col-lo+1). Returns next-token logits (B, V).
        Batch-invariant, each row attends exactly the columns ``starts[r]..col`` instead."""
        B, self.routes = tokens.shape[0], []
        exact = self.batch_invariant
        self._sync(packed_rows(B) if exact else B)
        lin = rows_linear if exact else PackedLinear.__call__
        firsts = starts[:B].tolist() if exact else None
        x = self.backbone.embed_tokens(tokens)  # (B, hidden)
        cos, sin = self.backbone.rotary_emb(x, positions.unsqueeze(1))  # (B, 1, D): broadcasts over heads
        for i, (ln1, qkv, o_proj, ln2, gate_up, down, act) in enumerate(self.layers):
            q, k, v = self._split_rope(lin(qkv, self._norm(ln1, x)), cos, sin, self.qk_norms[i])
            keys[i, :B, :, col] = k
            values[i, :B, :, col] = v
            # a kv head's group of query heads act as G query positions against its keys: grouped
            # attention without repeating keys, one fused kernel (masked by bias, no causal mask)
            q = q.reshape(B, self.n_kv, self.group, self.head_dim)
            if exact:
                o = attend_rows(q, keys[i, :B], values[i, :B], firsts, col, self.scale)
            else:
                kc = keys[i, :B, :, lo : col + 1]  # (B, KV, T, D)
                vc = values[i, :B, :, lo : col + 1]
                o = self.attend(q, kc, vc, bias, self.scale)  # (B, KV, G, D) (strop.serving.attention)
            x = x + lin(o_proj, o.reshape(B, -1))
            x += self._mlp(self._norm(ln2, x), gate_up, down, act, lin)  # (x is this step's own tensor)
        return lin(self.head, self._norm(self.backbone.norm, x))
