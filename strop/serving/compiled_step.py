"""The kv-cache decoder's whole decode step as one Inductor graph (``engine.compile_step``).

For a step of ``from_rows`` rows or more, everything from the embedded tokens to the logits is one graph: the norms
(Qwen3's per-head query/key norms too), the rotary embedding, the residuals and the MLP's activation are fused by
Inductor between the linear layers, and so is the sampler's first pass over the logits
(:func:`strop.serving.sampling.block_logsumexp`). The attention over the cache is strop's C kernel
(:mod:`strop.serving.attention_kernel`, the opaque custom op ``strop::decode_attention``) where it builds, else
Inductor's loops. Each linear layer stays on the decoder's packed weight (:mod:`strop.serving.linear`, oneDNN or
MKL) as an opaque custom op, ``strop::packed_linear``: Inductor does not take a packed weight as a graph input. The
graph writes nothing: the step's own key and value join the attention as a term of their own, and every layer's new
keys and values are written into the cache after the graph, in one copy.

One graph serves every decoder of the same shape in the process: a linear layer is named by its place in the
decoder and its width (the decoder is the calling thread's running one), and the norms' weights are graph inputs.
Only the rows and the cache's columns are dynamic. The graph is compiled at a typical step's sizes (``HINT_ROWS``
rows, ``HINT_KEYS`` columns), which Inductor lays its loops out for, twice and ahead of the first step: for a cache
view inside the cache and for one at its first column (storage offset 0, which Inductor specialises), each view taken
from a cache of more slots than rows, so that a batch compacted in place (:mod:`strop.serving.batch`) runs them too.
Two graphs in all, and no compile during a rollout.

The decoder's own step runs the steps of fewer rows, those with fewer than 2 cache columns before the new one,
batch-invariant ones (rollout.exact_logprobs, speculation's rounds), and every step after a compile failed: the
failure is named in one log line.
"""

from __future__ import annotations

import logging
import threading
import time
import types
from typing import NamedTuple

import torch
import torch.nn.functional as F

from strop.serving import attention_kernel
from strop.serving.attention import HINT_KEYS, HINT_ROWS, one_line
from strop.serving.kvdecode import LlamaDecoder, _rotate
from strop.serving.sampling import block_logsumexp

log = logging.getLogger("strop.serving")
USE_KERNEL = True  # the attention as strop's C kernel where it builds (bench/step_parts.py turns it off)
STORE_QUERIES = True  # the rotated queries stored once before the attention (bench/step_parts.py turns it off)
_RUNNING = threading.local()  # .decoder: the decoder whose step this thread is running


def _packed_linear(x: torch.Tensor, handle: str) -> torch.Tensor:
    """The running decoder's linear layer ``handle`` ('<its index in decoder.linears>:<output width>') on ``x``."""
    return _RUNNING.decoder.linears[int(handle.split(":")[0])](x)


# a CPU kernel of its own rather than ``torch.library.custom_op``, whose wrappers cost more: measured in a compiled
# graph on a tiny layer, 16 us a call against 23 (a SmolLM2 step makes 121; the op has no gradient, CPUs only)
_LIB = torch.library.Library("strop", "DEF")
_LIB.define("packed_linear(Tensor x, str handle) -> Tensor")
_LIB.impl("packed_linear", _packed_linear, "CPU")
packed_linear = torch.ops.strop.packed_linear.default


@torch.library.register_fake("strop::packed_linear")
def _(x, handle):
    return x.new_empty(*x.shape[:-1], int(handle.split(":")[1]))


_LIB.define("decode_attention(Tensor q, Tensor kc, Tensor vc, Tensor bias, Tensor k, Tensor v, float scale) -> Tensor")
_LIB.impl("decode_attention", attention_kernel.attend, "CPU")
decode_attention = torch.ops.strop.decode_attention.default


@torch.library.register_fake("strop::decode_attention")
def _(q, kc, vc, bias, k, v, scale):
    return q.new_empty(q.shape, dtype=torch.float32)


class _Norm(NamedTuple):  # what LlamaDecoder._norm reads of a norm module
    weight: torch.Tensor
    variance_epsilon: float


class Shape(NamedTuple):
    """What a compiled step is specialised to; decoders equal in it share one graph."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    widths: tuple  # output width of each of decoder.linears
    eps: tuple  # each norm's epsilon, in the order of _norms (the graph's weights)
    qk_norms: bool  # Qwen3: a norm on each query and key head before the rotation
    dtype: torch.dtype
    kernel: bool  # the attention as strop's C kernel (strop.serving.attention_kernel), else Inductor's loops


def why_step_not_compiled(dec: LlamaDecoder) -> str:
    """Why ``dec``'s step cannot be compiled ('' when it can)."""
    if dec.routed:
        return "routed-expert (MoE) layers are not in the compiled step: use compile_attention"
    acts = {type(parts[6]).__name__ for parts in dec.layers}
    if not acts <= {"SiLU", "SiLUActivation"}:
        return f"the MLP's activation {sorted(acts)} is not in the compiled step (SiLU only)"
    return ""


def _norms(dec: LlamaDecoder) -> list:
    """The decoder's norm modules in the graph's order: per layer the input norm, the post-attention norm (and
    Qwen3's query and key norms), then the final norm."""
    mods = []
    for parts, qk in zip(dec.layers, dec.qk_norms):
        mods += [parts[0], parts[3], *(qk or ())]
    return mods + [dec.backbone.norm]


def shape_of(dec: LlamaDecoder) -> Shape:
    return Shape(
        dec.n_layers,
        dec.n_heads,
        dec.n_kv,
        dec.head_dim,
        tuple(sum(int(m.weight.shape[0]) for m in lin.modules) for lin in dec.linears),
        tuple(float(m.variance_epsilon) for m in _norms(dec)),
        any(dec.qk_norms),
        dec.dtype,
        not attention_reason(dec),
    )


def attention_reason(dec: LlamaDecoder) -> str:
    """Why the step's attention is Inductor's loops rather than strop's C kernel ('' when it is the kernel)."""
    return attention_kernel.why_not(dec.dtype, dec.group) if USE_KERNEL else "the C kernel turned off"


def _graph(shape: Shape):
    """The step's body for ``shape``, a function of its own (dynamo keeps one cache of graphs per code object)."""
    L, H, KV, D = shape.layers, shape.heads, shape.kv_heads, shape.head_dim
    G, scale, per = H // KV, D**-0.5, 4 if shape.qk_norms else 2
    handle = [f"{i}:{w}" for i, w in enumerate(shape.widths)]
    norm = LlamaDecoder._norm

    def step(x, cos, sin, kc, vc, bias, weights):
        B = x.shape[0]
        new_qk, new_v = [], []
        if shape.kernel:  # the own key's column last, as the kernel takes it
            bias_all = bias.float().reshape(B, -1)
        else:
            bias_cache, bias_new = bias[..., :-1].float(), bias[..., -1:].float()
        for i in range(L):
            w, e = weights[per * i : per * i + per], shape.eps[per * i : per * i + per]
            qkv = packed_linear(norm(_Norm(w[0], e[0]), x), handle[4 * i]).view(B, H + 2 * KV, D)
            qk, v = qkv[:, : H + KV], qkv[:, H + KV :]
            if shape.qk_norms:
                qk = torch.cat([norm(_Norm(w[2], e[2]), qk[:, :H]), norm(_Norm(w[3], e[3]), qk[:, H:])], dim=1)
            qk = _rotate(qk, cos, sin)
            new_qk.append(qk)  # (an output: computed once, not again inside the attention's loops)
            new_v.append(v)
            q, k = qk[:, :H].reshape(B, KV, G, D).float(), qk[:, H:].float()
            if STORE_QUERIES:  # left to Inductor, each score recomputed its query's rotation (bench/step_parts.py)
                q = torch.ops.prims.inductor_force_stride_order(q, (H * D, G * D, D, 1))
            if shape.kernel:  # (strop.serving.attention_kernel)
                o = decode_attention(q, kc[i], vc[i], bias_all, k, v.float(), scale)
            else:
                s_cache = (q.unsqueeze(-2) * kc[i].float().unsqueeze(2)).sum(-1) * scale + bias_cache  # (B, KV, G, T)
                s_new = (q * k.unsqueeze(2)).sum(-1, keepdim=True) * scale + bias_new
                p = torch.softmax(torch.cat([s_cache, s_new], dim=-1), dim=-1)
                o = (p[..., :-1].unsqueeze(-1) * vc[i].float().unsqueeze(2)).sum(-2)
                o = o + p[..., -1:] * v.float().unsqueeze(2)
            x = x + packed_linear(o.to(x.dtype).reshape(B, -1), handle[4 * i + 1])
            g, u = packed_linear(norm(_Norm(w[1], e[1]), x), handle[4 * i + 2]).chunk(2, dim=-1)
            x = x + packed_linear(F.silu(g) * u, handle[4 * i + 3])
        logits = packed_linear(norm(_Norm(weights[-1], shape.eps[-1]), x), handle[-1]).float()
        return logits, block_logsumexp(logits), torch.stack(new_qk), torch.stack(new_v)

    code = step.__code__.replace(co_name=f"compiled_step_{len(_STEPS)}")
    return types.FunctionType(code, step.__globals__, code.co_name, None, step.__closure__)


def _mark(x, cos, sin, kc, vc, bias) -> None:
    """Rows and cache columns dynamic, nothing else (with every size dynamic the head size became a symbol too,
    and the attention's loops ran 1.5x slower)."""
    for t in (x, cos, sin, bias):
        torch._dynamo.mark_dynamic(t, 0)
    for t in (kc, vc):  # (layers, rows, kv heads, columns, head size)
        torch._dynamo.mark_dynamic(t, 1)
        torch._dynamo.mark_dynamic(t, 3)
    torch._dynamo.mark_dynamic(bias, 3)


class CompiledStep:
    """One shape's compiled step. ``seconds``: the first compile's time (at the typical sizes), ``graphs``: graphs
    compiled so far, ``reason``: why it fell back to the decoder's own step for good ('' while it has not)."""

    def __init__(self, shape: Shape):
        self.shape = shape
        self.seconds, self.graphs, self.reason = 0.0, 0, ""
        self._fn = None
        self._lock = threading.Lock()

    def _inductor(self, gm, example_inputs):  # Inductor, counting the graphs it compiles
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        return compile_fx(gm, example_inputs)

    def __call__(self, dec: "CompiledStepDecoder", x, cos, sin, kc, vc, bias):
        """The logits (B, V) in fp32 and their :func:`block_logsumexp`, the rotated queries and keys (layers, B, H +
        KV, D) and the values (layers, B, KV, D) of ``dec``'s step; None where it cannot run (``reason`` says why,
        once in the log)."""
        from torch._inductor import config as inductor

        _mark(x, cos, sin, kc, vc, bias)
        weights = [m.weight.detach() for m in dec.norms]  # (each step: an update may have replaced a parameter)
        _RUNNING.decoder = dec
        try:
            with inductor.patch(compile_threads=1):  # (a recompile leaves no pool of compile workers running)
                if self._fn is None:
                    with self._lock:  # (one thread compiles; the others wait and use it, or fall back with it)
                        if self.reason:
                            return None
                        if self._fn is None:
                            self._compile(dec, weights)
                            dec._sync(len(x))  # (MKL's weights were packed for the typical rows)
                return self._fn(x, cos, sin, kc, vc, bias, weights)
        except Exception as err:  # noqa: BLE001 (any compile failure falls back, named once)
            self.reason = one_line(err)
            log.warning("decode step: not compiled (%s); the decoder's own step runs", self.reason)
            return None
        finally:
            _RUNNING.decoder = None

    def _compile(self, dec: LlamaDecoder, weights) -> None:
        s, start = self.shape, time.perf_counter()
        fn = torch.compile(_graph(s), backend=self._inductor, fullgraph=True)
        R, T, hidden = HINT_ROWS, HINT_KEYS, dec.backbone.embed_tokens.weight.shape[1]
        x = torch.zeros(R, hidden, dtype=s.dtype)
        cos, sin = torch.ones(R, 1, s.head_dim, dtype=s.dtype), torch.zeros(R, 1, s.head_dim, dtype=s.dtype)
        bias = torch.zeros(R, 1, 1, T + 1, dtype=s.dtype)
        # the first R of R + 8 slots: a batch keeps its cache's slots as rows finish (Batch._compact), so the layer
        # stride must not be traced as rows x the row stride (measured: a recompile otherwise)
        kc, vc = (torch.zeros(s.layers, R + 8, s.kv_heads, T + 64, s.head_dim, dtype=s.dtype)[:, :R] for _ in "kv")
        dec._sync(R)
        for first in (3, 0):  # a view into a longer cache, then one at its column 0: the two graphs, compiled ahead
            k, v = kc[:, :, :, first : first + T], vc[:, :, :, first : first + T]
            _mark(x, cos, sin, k, v, bias)
            fn(x, cos, sin, k, v, bias, weights)
        self._fn, self.seconds = fn, time.perf_counter() - start
        log.info("decode step: compiled in %.1f s", self.seconds)


_STEPS: dict[Shape, CompiledStep] = {}
_STEPS_LOCK = threading.Lock()


def compiled_for(shape: Shape) -> CompiledStep:
    """The process's compiled step for decoders of ``shape`` (made on first use)."""
    with _STEPS_LOCK:
        if shape not in _STEPS:
            _STEPS[shape] = CompiledStep(shape)
        return _STEPS[shape]


class CompiledStepDecoder(LlamaDecoder):
    """A :class:`LlamaDecoder` whose steps of ``from_rows`` rows or more run as one compiled graph (measured on a
    2-core AMD EPYC with SmolLM2-135M at 32-64 rows: 1.04-1.38x the decoder with compiled attention, in fp32 and
    bf16; docs/benchmarks.md)."""

    def __init__(self, model, *, from_rows: int = 32, **kw):
        super().__init__(model, **kw)
        why = why_step_not_compiled(self)
        if why:
            raise ValueError(f"compile_step: {why}")
        self.from_rows = from_rows
        self.norms = _norms(self)  # (the graph's weights are theirs)
        self.compiled = compiled_for(shape_of(self))

    @torch.no_grad()
    def step(self, tokens, positions, keys, values, col: int, lo: int, bias, starts=None):
        B, c = tokens.shape[0], self.compiled
        self.block_lse = None
        if self.batch_invariant or c.reason or B < self.from_rows or col - lo < 2:
            return super().step(tokens, positions, keys, values, col, lo, bias, starts)
        self.routes = []
        self._sync(B)
        x = self.backbone.embed_tokens(tokens)
        cos, sin = self.backbone.rotary_emb(x, positions.unsqueeze(1))
        out = c(self, x, cos, sin, keys[:, :B, :, lo:col], values[:, :B, :, lo:col], bias)
        if out is None:
            return super().step(tokens, positions, keys, values, col, lo, bias, starts)
        logits, self.block_lse, qk, v = out
        keys[:, :B, :, col] = qk[:, :, self.n_heads :]
        values[:, :B, :, col] = v
        return logits
