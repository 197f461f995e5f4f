"""strop's decode-attention C kernel (strop.serving.attention_kernel), the compiled step's attention: equal to a
float64 reference within 1e-6 in fp32 on cache views as the step passes them (a slice of a longer cache, fewer rows
than slots, masked columns, groups of 1 to 7 query heads), bf16 caches widened exactly; built once per machine and
loaded from its cache after; where it cannot be built it says why, and the compiled step keeps Inductor's attention
(named in the engine's start line) and decodes what the decoder's own step does."""

import os
import platform
import shutil

import pytest
import torch

from strop.serving import attention_kernel
from strop.serving.compiled_step import CompiledStepDecoder, shape_of
from strop.serving.embedded import EmbeddedEngine
from strop.types import SamplingParams
from tests.tiny import make_tiny_model

needs_kernel = pytest.mark.skipif(bool(attention_kernel.why_unavailable()), reason=attention_kernel.why_unavailable())
# the kernel's paths (strop.serving.attention_kernel.lanes): as built for this CPU, and on x86-64 also built without
# AVX-512 (AVX2's) and without AVX2 and FMA (the compiler's vectors), so that a machine with AVX-512 tests all three
PATHS = {"native": ()}
if platform.machine() == "x86_64":
    PATHS |= {"no AVX-512": ("-mno-avx512f",), "no AVX2": ("-mno-avx512f", "-mno-avx2", "-mno-fma")}


@pytest.fixture(scope="module", params=list(PATHS))
def path(request, tmp_path_factory):
    """Which of the kernel's paths the test's calls run: ``attend`` is pointed at a library built for it."""
    if attention_kernel.why_unavailable():
        pytest.skip(attention_kernel.why_unavailable())
    if not PATHS[request.param]:
        yield request.param
        return
    compiler = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    saved = dict(attention_kernel._state)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STROP_KERNEL_CACHE", str(tmp_path_factory.mktemp("kernels")))
        lib = attention_kernel.open_library(attention_kernel._build(compiler, PATHS[request.param]))
    attention_kernel._state.update(lib=lib)
    yield request.param
    attention_kernel._state.clear()
    attention_kernel._state.update(saved)


def reference(q, kc, vc, bias, k_new, v_new, scale):
    """Float64: the cache's columns and the step's own key and value as one attention."""
    K = torch.cat([kc.double(), k_new.double().unsqueeze(2)], dim=2)
    V = torch.cat([vc.double(), v_new.double().unsqueeze(2)], dim=2)
    s = q.double() @ K.transpose(-1, -2) * scale + bias.double()[:, None, None, :]
    return torch.softmax(s, dim=-1) @ V


def inputs(B, KV, G, D, T, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # the step's view: the first B of B + 3 slots, columns 4..4+T of a longer cache
    kc, vc = (torch.randn(B + 3, KV, T + 11, D, generator=g).to(dtype)[:B, :, 4 : 4 + T] for _ in "kv")
    q, k_new, v_new = torch.randn(B, KV, G, D, generator=g), *torch.randn(2, B, KV, D, generator=g)
    bias = torch.zeros(B, T + 1)
    for r in range(B):
        bias[r, : (3 * r) % (T + 1)] = float("-inf")  # left padding: row r masks its first columns (up to all)
    return q, kc, vc, bias, k_new, v_new


@pytest.mark.parametrize(
    "B,KV,G,D,T",
    [
        (5, 3, 3, 64, 37),
        (2, 2, 1, 16, 1),
        (3, 1, 7, 128, 70),
        (4, 2, 2, 8, 300),
        (3, 2, 1, 64, 130),
        (2, 1, 5, 64, 200),
    ],
)
def test_the_kernel_is_the_attention_in_fp32(path, B, KV, G, D, T):
    args = inputs(B, KV, G, D, T, torch.float32)
    got = attention_kernel.attend(*args, D**-0.5)
    want = reference(*args, D**-0.5)
    assert got.dtype == torch.float32 and got.shape == (B, KV, G, D)
    assert (got.double() - want).abs().max() < 1e-6
    # a row whose every cache column is masked attends only its own key: its output is its own value
    q, kc, vc, bias, k_new, v_new = args
    bias[0, :-1] = float("-inf")
    only_own = attention_kernel.attend(q, kc, vc, bias, k_new, v_new, D**-0.5)
    assert torch.equal(only_own[0], v_new[0].unsqueeze(1).expand(KV, G, D))
    # a masked column weighs exactly 0, whatever its value
    vc[1, :, 0] = 3e38
    assert torch.equal(attention_kernel.attend(q, kc, vc, bias, k_new, v_new, D**-0.5)[1], got[1])


@pytest.mark.parametrize("T", [50, 150])  # (150: fp32 blocks of 64 columns are read in place, bf16 ones widened)
def test_bf16_caches_are_widened_exactly(path, T):
    q, kc, vc, bias, k_new, v_new = inputs(6, 3, 3, 64, T, torch.bfloat16, seed=3)
    got = attention_kernel.attend(q, kc, vc, bias, k_new, v_new, 0.125)
    # the same values in fp32 caches: the same sums
    same = attention_kernel.attend(q, kc.float(), vc.float(), bias, k_new, v_new, 0.125)
    assert torch.equal(got, same)
    assert (got.double() - reference(q, kc, vc, bias, k_new, v_new, 0.125)).abs().max() < 1e-6


@needs_kernel
def test_inputs_it_cannot_take_are_refused():
    q, kc, vc, bias, k_new, v_new = inputs(2, 2, 2, 8, 5, torch.float32)
    with pytest.raises(ValueError, match="contiguous"):
        attention_kernel.attend(q, kc.transpose(2, 3), vc.transpose(2, 3), bias, k_new, v_new, 1.0)
    with pytest.raises(ValueError, match="float16"):
        attention_kernel.attend(q, kc.half(), vc.half(), bias, k_new, v_new, 1.0)


def test_caches_and_groups_it_does_not_take_are_named():
    assert (
        attention_kernel.why_not(torch.float16, 3)
        == "the C kernel takes float32 and bfloat16 caches, not torch.float16"
    )
    assert attention_kernel.why_not(torch.float32, 65) == (
        "the C kernel takes up to 64 query heads per key/value head, not 65"
    )
    assert attention_kernel.why_not(torch.bfloat16, 64) == attention_kernel.why_unavailable()


@pytest.mark.skipif(not shutil.which("cc") and not shutil.which("gcc"), reason="no C compiler here")
def test_it_is_built_once_per_machine_and_loaded_from_its_cache_after(tmp_path, monkeypatch):
    monkeypatch.setenv("STROP_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(attention_kernel, "_state", {})
    assert attention_kernel.why_unavailable() == ""
    (built,) = tmp_path.glob("attention-*.so")
    stamp = built.stat().st_mtime_ns
    monkeypatch.setattr(attention_kernel, "_state", {})  # (another process)
    assert attention_kernel.why_unavailable() == "" and built.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [built.name]  # (no build folder left behind)


def test_without_a_compiler_it_says_why_and_the_compiled_step_keeps_inductors_attention(tmp_path, monkeypatch):
    monkeypatch.setenv("STROP_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setattr(attention_kernel, "_state", {})
    why = attention_kernel.why_unavailable()
    assert why == "no C compiler (no-such-compiler) to build the attention kernel"
    assert not list(tmp_path.iterdir())
    with pytest.raises(RuntimeError, match="no C compiler"):
        attention_kernel.attend(*inputs(2, 2, 2, 8, 5, torch.float32), 1.0)
    model = make_tiny_model()
    assert shape_of(CompiledStepDecoder(model)).kernel is False
    engines = [EmbeddedEngine(model, pad_token_id=0, max_batch_size=4, compile_step=c) for c in (True, False)]
    assert f"its attention Inductor's ({why})" in engines[0].decode_path
    if not shutil.which(os.environ.get("CXX") or "g++"):
        return  # (Inductor needs a C++ compiler)
    # the compiled step with Inductor's attention decodes what the decoder's own step does
    engines[0]._fast.from_rows = 2
    prompts = [[5, 17, 230, 9], [44, 45, 46], [7, 8], [9, 9, 31, 4, 8]]
    sps = [SamplingParams(temperature=1.0, max_new_tokens=10, seed=i, stop_token_ids=[-1]) for i in range(4)]
    (got, want) = (e.generate_batch(prompts, sps) for e in engines)
    assert engines[0]._fast.compiled.reason == "" and engines[0]._fast.compiled.graphs == 2
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


def test_a_failed_build_is_named(tmp_path, monkeypatch):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'cc: error: unrecognized option' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("STROP_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setattr(attention_kernel, "_state", {})
    why = attention_kernel.why_unavailable()
    assert why.startswith("the attention kernel did not build:") and "unrecognized option" in why
    assert not list((tmp_path / "cache").glob("*.so"))


def test_each_path_runs_where_it_was_built_for(path):
    flags = set(" ".join(ln for ln in open("/proc/cpuinfo").read().splitlines() if ln.startswith("flags")).split())
    avx2 = 8 if {"avx2", "fma"} <= flags else 0
    want = {"native": 16 if "avx512f" in flags else avx2, "no AVX-512": avx2, "no AVX2": 0}[path]
    assert attention_kernel.lanes() == want
    assert attention_kernel.isa() == {16: "AVX-512", 8: "AVX2", 0: "plain C"}[want]
