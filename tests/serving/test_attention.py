"""The kv-cache decoder's decode attention (strop.serving.attention, ``engine.compile_attention``): the compiled
attention computes what PyTorch's fused kernel does, for any batch, length, mask and cache stride; where it cannot
compile it says why and runs the fused kernel; the engine decodes the same tokens with it (strop serve with it:
tests/serving/test_compiled_step.py); and where it would not run it is refused at start. Also the prefill's linear layers on oneDNN's packed weight."""

import copy
import logging
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from strop.serving import attention
from strop.serving.cpu_kernels import unavailable
from strop.serving.embedded import EmbeddedEngine
from strop.serving.kvdecode import LlamaDecoder
from strop.serving.linear import PackedLinear
from strop.types import SamplingParams
from tests.tiny import make_tiny_model

PROMPTS = [[5, 17, 230, 9, 5, 17], [44, 45, 46], [7, 8], [5, 17, 230, 9, 5, 17]]
# Inductor's C++ compiler ($CXX, else g++ or clang++): without one the option runs the fused kernel (tested below)
compiles = pytest.mark.skipif(
    not any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "clang++") if c),
    reason="no C++ compiler here for Inductor",
)


def cache_case(B, T, dtype, seed=0, KV=2, G=3, D=16, capacity=40):
    """q (B, KV, G, D) and keys/values sliced from a longer cache (as a decode step slices its columns), with a
    bias that masks a different number of leading columns per row."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, KV, G, D, generator=g).to(dtype)
    keys = torch.randn(B, KV, capacity, D, generator=g).to(dtype)
    values = torch.randn(B, KV, capacity, D, generator=g).to(dtype)
    bias = torch.zeros(B, 1, 1, T, dtype=dtype)
    for r in range(B):
        bias[r, ..., : r % T] = float("-inf")
    return q, keys[:, :, 3 : 3 + T], values[:, :, 3 : 3 + T], bias


@pytest.fixture(scope="module")
def compiled():
    return attention.CompiledAttention(from_rows=1)


@compiles
@pytest.mark.parametrize("B,T", [(1, 1), (3, 7), (8, 29), (5, 33)])
def test_the_compiled_attention_equals_the_fused_kernel_in_fp32(compiled, B, T):
    q, k, v, bias = cache_case(B, T, torch.float32, seed=B * T)
    assert not k.is_contiguous()  # (a slice of the cache, as the step passes it)
    got, want = compiled(q, k, v, bias, 0.25), attention.eager(q, k, v, bias, 0.25)
    assert compiled.reason == "" and compiled.seconds > 0
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=bias.double(), scale=0.25)
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=1e-6)


@compiles
def test_in_bf16_the_compiled_attention_is_no_further_from_exact_than_the_fused_kernel(compiled):
    errors = {"compiled": [], "fused": []}
    for seed in range(4):
        q, k, v, bias = cache_case(6, 31, torch.bfloat16, seed=seed)
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=bias.double(), scale=0.25)
        for name, fn in (("compiled", compiled), ("fused", attention.eager)):
            errors[name].append((fn(q, k, v, bias, 0.25).double() - exact).abs().max().item())
    assert max(errors["compiled"]) <= max(errors["fused"]) and max(errors["compiled"]) < 2e-2, errors


def test_where_it_cannot_compile_it_says_why_once_and_runs_the_fused_kernel(monkeypatch, caplog):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore lines")

    monkeypatch.setattr(torch, "compile", no_compiler)
    fallback = attention.CompiledAttention(from_rows=1)
    q, k, v, bias = cache_case(4, 9, torch.float32)
    with caplog.at_level(logging.WARNING, logger="strop.serving"):
        first, second = fallback(q, k, v, bias, 0.25), fallback(q, k, v, bias, 0.25)
    assert fallback.reason == "RuntimeError: InvalidCxxCompiler: No working C++ compiler found"
    warned = [r.getMessage() for r in caplog.records if "decode attention: not compiled" in r.getMessage()]
    assert len(warned) == 1 and "No working C++ compiler" in warned[0] and "the eager kernel runs" in warned[0]
    assert torch.equal(first, attention.eager(q, k, v, bias, 0.25)) and torch.equal(first, second)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model()


def decode(model, **kw):
    e = EmbeddedEngine(model, pad_token_id=0, default_stop_token_ids=[2], max_batch_size=3, **kw)
    sps = [SamplingParams(temperature=1.0, max_new_tokens=14, seed=i, stop_token_ids=[-1]) for i in range(4)]
    out = e.generate_batch(PROMPTS, sps)
    return [c.token_ids for c in out], [torch.tensor(c.logprobs) for c in out], e


@compiles
def test_small_steps_run_the_fused_kernel_and_larger_ones_the_compiled_loops(monkeypatch):
    ran = []
    monkeypatch.setattr(
        attention,
        "eager",
        lambda *a: ran.append("eager") or F.scaled_dot_product_attention(*a[:3], attn_mask=a[3], scale=a[4]),
    )
    compiled = attention.CompiledAttention(from_rows=4)
    for B in (1, 3, 4, 9):
        q, k, v, bias = cache_case(B, 5, torch.float32)
        torch.testing.assert_close(compiled(q, k, v, bias, 0.25), attention.eager(q, k, v, bias, 0.25))
        ran.pop()  # (the reference's own call)
    assert ran == ["eager", "eager"] and compiled.seconds > 0


@compiles
def test_the_engine_decodes_the_same_tokens_with_the_attention_compiled(tiny, monkeypatch):
    monkeypatch.setattr(attention.COMPILED, "from_rows", 1)  # (these batches are small)
    calls = []
    real = attention.CompiledAttention._compile
    monkeypatch.setattr(attention.CompiledAttention, "_compile", lambda s, *a: calls.append(1) or real(s, *a))
    monkeypatch.setattr(attention.COMPILED, "_fn", None)  # (compiled afresh here, whatever ran before)
    tokens, logprobs, e = decode(tiny, compile_attention=True)
    assert "decode attention compiled" in e.decode_path and calls and attention.COMPILED._fn is not None
    want_tokens, want_logprobs, plain = decode(tiny)
    assert "decode attention compiled" not in plain.decode_path
    assert tokens == want_tokens
    for a, b in zip(logprobs, want_logprobs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_the_engine_refuses_compiled_attention_where_it_would_not_run(tiny):
    with pytest.raises(ValueError, match="compile_attention compiles the kv-cache decoder's attention, which is off"):
        EmbeddedEngine(tiny, pad_token_id=0, fast_decode=False, compile_attention=True)
    with pytest.raises(ValueError, match="batch-invariant steps attend row by row"):
        EmbeddedEngine(tiny, pad_token_id=0, batch_invariant=True, compile_attention=True)


@pytest.mark.skipif(bool(unavailable("onednn", torch.float32)), reason="oneDNN's packed matmul is not built here")
def test_the_prefill_runs_on_onednns_packed_weight_and_gives_what_f_linear_does(tiny):
    """With the oneDNN kernel the prefill's (N, P, in) inputs go through the packed weight, one packing for every
    row count; the batch-invariant prefill keeps ``F.linear``."""
    model = copy.deepcopy(tiny)
    dec, plain = LlamaDecoder(model, kernels="onednn"), LlamaDecoder(model, kernels="plain")
    ids, lengths = torch.tensor([[0, 0, 5, 17, 230], [44, 45, 46, 47, 48]]), torch.tensor([3, 5])
    logits, keys, _ = dec.prefill(ids, lengths)
    want, want_keys, _ = plain.prefill(ids, lengths)
    assert all(lin.packed_kernel == "onednn" for lin in dec.linears)
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(keys, want_keys, rtol=0, atol=1e-5)
    lin = dec.layers[0][1]
    packed = lin.packed
    for rows in (1, 7, 64, 300):
        lin.pack(rows)
        assert lin.packed is packed  # (oneDNN's layout serves every row count)
    x = torch.randn(2, 5, lin.weight.shape[1])
    torch.testing.assert_close(lin.batched(x), F.linear(x, lin.weight), rtol=0, atol=1e-5)
    assert torch.equal(lin(x), F.linear(x, lin.weight))  # (3-D through __call__: F.linear, as invariance needs)
    mkl = PackedLinear([model.lm_head], kernel="mkl")
    if not unavailable("mkl", torch.float32):
        mkl.refresh()
        mkl.pack(4)
        first = mkl.packed
        mkl.pack(8)
        assert mkl.packed is not first  # (MKL's packing is per row count)
