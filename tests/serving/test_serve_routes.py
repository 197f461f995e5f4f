"""strop serve returns routed experts in both dialects (SGLang's /generate with return_routed_experts, vLLM's
/v1/completions under --enable-return-routed-experts), and strop's clients read them into the routes the trainer
replays: the same the embedded engine records for the same request."""

import asyncio
import base64
import copy

import httpx
import numpy as np
import pytest
import torch

from strop.engines.sglang import SGLangEngine
from strop.engines.vllm import VLLMEngine
from strop.serving.embedded import EmbeddedEngine
from strop.serving.server import create_app
from strop.types import SamplingParams, Sample
from tests.serving.test_serve_hostile import serving
from tests.tiny import make_tiny_model, make_tiny_qwen3_moe

pytestmark = pytest.mark.timeout(120)
PROMPT = [5, 17, 230, 9, 41]
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=7, seed=3, stop_token_ids=[-1])


def test_both_dialects_return_the_routes_the_embedded_engine_records():
    model = make_tiny_qwen3_moe(seed=4)
    want = EmbeddedEngine(copy.deepcopy(model), pad_token_id=0).generate_batch([PROMPT], SAMPLING)[0]
    assert want.routed_experts.shape == (len(PROMPT) + 7 - 1, 2, 2)
    app = create_app(EmbeddedEngine(model, pad_token_id=0), return_routes=True)
    with serving(app) as url:
        sglang = asyncio.run(SGLangEngine(url, routes=True).generate(PROMPT, SAMPLING))
        vllm = asyncio.run(VLLMEngine(url).generate(PROMPT, SAMPLING))
        plain = asyncio.run(SGLangEngine(url).generate(PROMPT, SAMPLING))
        raw = httpx.post(
            f"{url}/generate",
            json={
                "input_ids": PROMPT,
                "sampling_params": {"temperature": 1.0, "max_new_tokens": 7, "sampling_seed": 3, "ignore_eos": True},
                "return_routed_experts": True,
                "routed_experts_start_len": 2,
            },
        ).json()
        late = httpx.post(
            f"{url}/generate",
            json={"input_ids": PROMPT, "return_routed_experts": True, "routed_experts_start_len": 6},
        )
    assert sglang.token_ids == want.token_ids == vllm.token_ids
    # SGLang's wire has no shape: [tokens, layers * top_k] until the trainer, which knows the model, splits it
    assert torch.equal(sglang.routed_experts, want.routed_experts.reshape(len(want.routed_experts), -1))
    assert torch.equal(vllm.routed_experts, want.routed_experts)
    assert plain.routed_experts is None  # not asked for: not sent
    flat = np.frombuffer(base64.b64decode(raw["meta_info"]["routed_experts"]), dtype="<i4")  # SGLang's int32
    assert flat.tolist() == want.routed_experts[2:].flatten().tolist()  # from routed_experts_start_len on
    assert late.status_code == 400 and "routed_experts_start_len=6 is past a 5-token prompt" in late.text
    # what the client read places on a sample as the embedded engine's own completion does
    a, b = Sample(prompt="p", prompt_ids=PROMPT), Sample(prompt="p", prompt_ids=PROMPT)
    a.apply_completion(sglang)
    b.apply_completion(want)
    assert torch.equal(a.routed_experts.reshape(b.routed_experts.shape), b.routed_experts)


def test_a_server_without_routes_says_so(tiny_model_dir):
    from strop.serving.server import serve

    app = create_app(EmbeddedEngine(make_tiny_model(), pad_token_id=2))  # a dense model: nothing to record
    with serving(app) as url:
        r = httpx.post(f"{url}/generate", json={"input_ids": PROMPT, "return_routed_experts": True})
        assert r.status_code == 400 and "records no routed experts" in r.text
        with pytest.raises(Exception, match="records no routed experts"):
            asyncio.run(SGLangEngine(url, routes=True, retries=0).generate(PROMPT, SAMPLING))
    with pytest.raises(ValueError, match="--enable-return-routed-experts: .* records no routed experts"):
        serve(str(tiny_model_dir), return_routes=True)
