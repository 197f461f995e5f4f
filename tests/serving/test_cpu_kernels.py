"""The fast decoder's linear-layer kernel per CPU (``engine.cpu_kernels``, strop.serving.cpu_kernels): the one
asked for runs, or the engine refuses at start saying why; ``auto`` picks by CPU vendor and dtype; every kernel
decodes the same tokens."""

import copy

import pytest
import torch
import torch.nn.functional as F

from strop.serving import cpu_kernels
from strop.serving.embedded import EmbeddedEngine
from strop.serving.linear import PackedLinear
from strop.types import SamplingParams
from tests.tiny import make_tiny_model

PROMPTS = [[5, 17, 230, 9, 5, 17], [44, 45, 46], [7, 8]]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return make_tiny_model()


def decode_with(model, kernel, monkeypatch):
    """Tokens and logprobs of a seeded batch with rows joining (max 2 running), and the kernels packed for."""
    ran = []
    real = PackedLinear.pack
    monkeypatch.setattr(
        PackedLinear, "pack", lambda self, rows, keep=False: ran.append(self.kernel) or real(self, rows)
    )
    e = EmbeddedEngine(model, pad_token_id=0, default_stop_token_ids=[2], max_batch_size=2, cpu_kernels=kernel)
    sps = [SamplingParams(temperature=1.0, max_new_tokens=12, seed=i, stop_token_ids=[-1]) for i in range(3)]
    out = e.generate_batch(PROMPTS, sps)
    monkeypatch.setattr(PackedLinear, "pack", real)
    return [(c.token_ids, c.logprobs) for c in out], set(ran), e.decode_path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_kernel_this_cpu_has_runs_when_asked_and_decodes_what_plain_does(tiny, dtype, monkeypatch):
    model = copy.deepcopy(tiny).to(dtype)
    plain, ran, path = decode_with(model, "plain", monkeypatch)
    assert ran == set() and "linear layers on plain" in path
    tried = 0
    for kernel in ("mkl", "onednn"):
        why = cpu_kernels.unavailable(kernel, dtype)
        if why:  # refused at start, naming the reason
            with pytest.raises(ValueError, match=f"cpu_kernels='{kernel}': {why[:20]}"):
                decode_with(model, kernel, monkeypatch)
            continue
        tried += 1
        got, ran, path = decode_with(model, kernel, monkeypatch)
        assert ran == {kernel} and f"linear layers on {kernel}" in path
        assert [t for t, _ in got] == [t for t, _ in plain]
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for (_, a), (_, b) in zip(got, plain):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=tol)
    assert tried >= (1 if dtype == torch.float32 and torch.backends.mkl.is_available() else 0)


def test_mkl_is_refused_for_bf16_weights_and_cpu_kernels_on_a_gpu():
    with pytest.raises(ValueError, match="float32 only, and these weights are bfloat16"):
        cpu_kernels.choose("mkl", torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ValueError, match="is a CPU kernel; the weights are on cuda"):
        cpu_kernels.choose("onednn", torch.float32, torch.device("cuda"))
    assert cpu_kernels.choose("auto", torch.float32, torch.device("cuda")) == "plain"
    with pytest.raises(ValueError, match="choose one of auto, mkl, onednn, plain"):
        cpu_kernels.choose("fast", torch.float32, torch.device("cpu"))


@pytest.mark.parametrize(
    "vendor,dtype,want",
    [
        ("GenuineIntel", torch.float32, "mkl"),
        ("AuthenticAMD", torch.float32, "onednn"),
        ("GenuineIntel", torch.bfloat16, "onednn"),
        ("AuthenticAMD", torch.bfloat16, "onednn"),
    ],
)
def test_auto_picks_mkl_on_intel_in_fp32_and_onednn_elsewhere(vendor, dtype, want, monkeypatch):
    if cpu_kernels.unavailable(want, dtype):
        pytest.skip(f"{want} cannot run {dtype} here: {cpu_kernels.unavailable(want, dtype)}")
    monkeypatch.setattr(
        cpu_kernels, "cpu", lambda: {"vendor": vendor, "model": "x", "amx": False, "avx512_bf16": False}
    )
    assert cpu_kernels.choose("auto", dtype, torch.device("cpu")) == want


def test_without_a_packed_kernel_auto_runs_plain(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "unavailable", lambda kernel, dtype: "" if kernel == "plain" else "none here")
    assert cpu_kernels.choose("auto", torch.float32, torch.device("cpu")) == "plain"


def test_the_start_line_names_the_cpu_it_chose_for(tiny):
    e = EmbeddedEngine(tiny, pad_token_id=0)
    assert (
        cpu_kernels.cpu()["model"] in e.decode_path and f"linear layers on {e._fast.kernel} (float32" in e.decode_path
    )


def test_a_kernel_asked_for_where_the_fast_decoder_is_off_is_refused(tiny):
    with pytest.raises(ValueError, match="cpu_kernels='onednn' chooses the kv-cache decoder's kernel, which is off"):
        EmbeddedEngine(tiny, pad_token_id=0, fast_decode=False, cpu_kernels="onednn")
    assert EmbeddedEngine(tiny, pad_token_id=0, fast_decode=False).decode_path.startswith("transformers forward")


def test_strop_serve_runs_the_kernel_it_is_given(start_server):
    """``strop serve --cpu-kernels K`` (what engine.launch passes for engine.cpu_kernels) names K on its start line
    and decodes with it: the same tokens as the server on ``auto``'s pick."""
    import httpx

    asked = "onednn" if not cpu_kernels.unavailable("onednn", torch.float32) else "plain"
    servers = [start_server(None, "--cpu-kernels", asked), start_server(None)]
    assert f"linear layers on {asked} (float32" in servers[0].log_tail(20000)
    body = {"input_ids": [[5, 17, 230, 9], [44, 45]], "return_logprob": True}
    body["sampling_params"] = {"temperature": 1.0, "max_new_tokens": 10, "stop_token_ids": [-1], "sampling_seed": 3}
    answers = []
    for server in servers:
        r = httpx.post(server.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        answers.append([(a["output_ids"], a["meta_info"]["output_token_logprobs"]) for a in r.json()])
    assert [ids for ids, _ in answers[0]] == [ids for ids, _ in answers[1]] and len(answers[0][0][0]) == 10
    for (_, a), (_, b) in zip(*answers):
        lp = [torch.tensor([e[0] for e in entries]) for entries in (a, b)]
        torch.testing.assert_close(*lp, rtol=0, atol=1e-5)


@pytest.mark.skipif(cpu_kernels.unavailable("onednn", torch.float32) != "", reason="this torch build has no oneDNN")
def test_without_bf16_instructions_onednn_computes_bf16_layers_in_float32(tiny, monkeypatch):
    """A CPU without bf16 instructions (AVX2 only; forced here, so that every CPU runs this path): oneDNN keeps bf16
    weights as a packed float32 copy, and a layer's output of 3 rows or more is the float32 product rounded to
    bf16 once; the decoder's tokens are plain's, and the start line says what runs."""
    monkeypatch.setattr(cpu_kernels, "bf16_instructions", lambda: False)
    assert cpu_kernels.unavailable("onednn", torch.bfloat16) == ""
    assert cpu_kernels.computes_in("onednn", torch.bfloat16) == torch.float32
    assert cpu_kernels.computes_in("onednn", torch.float32) == torch.float32
    torch.manual_seed(1)
    layer = torch.nn.Linear(96, 40, bias=True).to(torch.bfloat16)
    lin = PackedLinear([layer], kernel="onednn")
    lin.refresh()
    lin.pack(0)
    assert lin.packed.dtype == torch.float32 and lin.packed_bias.dtype == torch.float32
    x = torch.randn(7, 96).to(torch.bfloat16)
    wide = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    for got in (lin(x), lin.batched(x[None])[0]):
        assert got.dtype == torch.bfloat16
        ulp = wide.abs().clamp_min(1e-30) * 2.0**-7  # (one bf16 step of the exact value; orders differ)
        assert ((got.float() - wide).abs() <= ulp).all()
    for rows in (1, 2):  # (fewer rows than WIDEN_ROWS: F.linear's bf16 product, the faster there)
        assert torch.equal(lin(x[:rows]), F.linear(x[:rows], layer.weight, layer.bias))
    model = copy.deepcopy(tiny).to(torch.bfloat16)
    plain, _, _ = decode_with(model, "plain", monkeypatch)
    got, ran, path = decode_with(model, "onednn", monkeypatch)
    assert ran == {"onednn"} and "linear layers on onednn (bfloat16 weights computed in float32" in path
    assert [t for t, _ in got] == [t for t, _ in plain]
    for (_, a), (_, b) in zip(got, plain):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=2e-2)
