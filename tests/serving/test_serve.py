"""`strop serve`: real server processes on 127.0.0.1, SGLang-native and OpenAI routes, bad input."""

import asyncio

import httpx
import pytest
import torch

from strop.engines.sglang import SGLangEngine
from strop.sync.disk import WeightWriter
from strop.wire.digest import state_checksum
from strop.types import SamplingParams

pytestmark = pytest.mark.timeout(240)


def _post(url, path, body, **kw):
    return httpx.post(url + path, json=body, timeout=60, **kw)


def test_generate_returns_tokens_and_the_trainers_logprobs(start_server, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from strop.train.logprob import response_logprobs

    server = start_server()
    prompt = [5, 17, 230, 9]
    r = _post(
        server.url,
        "/generate",
        {
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": {"temperature": 0.7, "max_new_tokens": 8, "stop_token_ids": [-1]},
        },
    )
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    ids = [e[1] for e in meta["output_token_logprobs"]]
    assert ids == out["output_ids"] and len(ids) == 8 and meta["finish_reason"] == {"type": "length"}
    assert meta["weight_version"] == 0 and isinstance(out["text"], str)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    full = torch.tensor([prompt + ids])
    with torch.no_grad():
        lp, _ = response_logprobs(model, full, torch.ones_like(full), torch.arange(4, 12).unsqueeze(0), temperature=0.7)
    torch.testing.assert_close(torch.tensor([[e[0] for e in meta["output_token_logprobs"]]]), lp, rtol=0, atol=1e-4)


def test_64_concurrent_clients_are_all_answered(start_server):
    server = start_server()
    engine = SGLangEngine(server.url, timeout_s=120)

    async def main():
        sp = SamplingParams(temperature=1.0, max_new_tokens=6)
        outs = await asyncio.gather(*(engine.generate([3 + i, 40, 7], sp) for i in range(64)))
        await engine.close()
        return outs

    outs = asyncio.run(main())
    assert len(outs) == 64
    assert all(o.finish_reason in ("stop", "length") and len(o.logprobs) == len(o.token_ids) > 0 for o in outs)


def test_bad_requests_get_4xx_and_the_server_keeps_serving(start_server, tmp_path):
    server = start_server()  # loads weights from tmp_path only
    url = server.url
    r = httpx.post(url + "/generate", content=b'{"input_ids": [1, 2', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "json" in r.text.lower()
    r = _post(url, "/generate", {"input_ids": "not a list"})
    assert r.status_code == 422 and "input_ids" in r.text
    r = _post(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}})
    assert r.status_code == 422 and "temperature" in r.text
    r = _post(url, "/generate", {"input_ids": [1, 2], "surprise": 1})
    assert r.status_code == 422 and "surprise" in r.text
    r = _post(url, "/generate", {"input_ids": [1] * 300})  # the tiny model's window is 256
    assert r.status_code == 400 and "context window" in r.text
    r = _post(url, "/generate", {"input_ids": []})
    assert r.status_code == 400 and "empty prompt" in r.text
    r = _post(url, "/update_weights_from_disk", {"model_path": str(tmp_path / "no-such-dir")})
    assert r.status_code == 400 and "no safetensors" in r.text
    r = _post(url, "/update_weights_from_disk", {"model_path": "/no/such/dir"})
    assert r.status_code == 403 and "outside the weights folder" in r.text
    assert httpx.get(url + "/health").status_code == 200
    ok = _post(url, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) >= 1


def test_weights_from_disk_change_generation_and_report_version_and_checksum(start_server, tmp_path):
    from tests.tiny import make_tiny_model

    server = start_server()  # loads weights from tmp_path only
    engine = SGLangEngine(server.url, writer=WeightWriter(tmp_path / "weights"))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=[-1])
    other = make_tiny_model(seed=7).state_dict()

    async def main():
        before = await engine.generate([5, 6, 7], greedy)
        version = await engine.update_weights(other, version=3)  # checks the server's checksum against ours
        after = await engine.generate([5, 6, 7], greedy)
        reported = await engine.get_weight_version()
        await engine.close()
        return before, version, after, reported

    before, version, after, reported = asyncio.run(main())
    assert version == reported == 3 and after.weight_version == 3
    assert before.logprobs != pytest.approx(after.logprobs, abs=1e-3)  # other weights, other distribution
    written = list((tmp_path / "weights").glob("v*"))
    assert [p.name for p in written] == ["v3"] and not list((tmp_path / "weights").glob(".tmp*"))
    r = _post(server.url, "/update_weights_from_disk", {"model_path": str(written[0]), "weight_version": 4})
    from strop.serving.routes_weights import load_weights_dir

    assert r.json()["checksum"] == state_checksum(load_weights_dir(str(written[0]), "cpu"))


def test_abort_request_ends_a_running_request(start_server):
    server = start_server()
    engine = SGLangEngine(server.url)

    async def main():
        long = SamplingParams(temperature=1.0, max_new_tokens=250, stop_token_ids=[-1])
        task = asyncio.ensure_future(engine.generate([4, 5, 6], long, request_id="long-one"))
        await asyncio.sleep(0.05)  # queued, running or not yet arrived: each ends as an abort
        await engine.abort("long-one")
        out = await asyncio.wait_for(task, 60)
        await engine.close()
        return out

    out = asyncio.run(main())
    assert out.finish_reason == "abort" and len(out.token_ids) < 250


def test_openai_routes_return_token_ids_and_logprobs(start_server):
    server = start_server()
    r = _post(server.url, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4, "logprobs": 21, "temperature": 0})
    assert r.status_code == 400 and "logprobs" in r.text  # more alternatives than vLLM's max_logprobs: refused
    r = _post(server.url, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4, "logprobs": 1, "temperature": 0})
    tops = r.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert r.status_code == 200 and len(tops) == 4 and all(1 <= len(top) <= 2 for top in tops)  # (+ the token)
    r = _post(server.url, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4, "logprobs": 0, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == [5, 6, 7] and len(choice["logprobs"]["token_logprobs"]) == len(
        choice["token_ids"]
    )
    r = _post(
        server.url,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 4, "logprobs": True, "model": "x"},
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["role"] == "assistant" and len(choice["logprobs"]["content"]) == len(choice["token_ids"])


def test_a_launched_server_with_a_token_guards_its_routes(start_server):
    """The token policy end to end (every route in tests/serving/test_serve_hostile.py)."""
    server = start_server(None, "--token=s3cret")
    assert httpx.get(server.url + "/health").status_code == 401
    assert httpx.get(server.url + "/health", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert _post(server.url, "/generate", {"input_ids": [1, 2]}).status_code == 401
    assert _post(server.url, "/flush_cache", None, headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_speculative_serve_answers_what_the_batch_invariant_one_does(start_server):
    """``strop serve --speculative 3`` (what engine.launch passes for engine.speculative): one batch of seeded
    requests, four samples per prompt, gets the tokens and logprobs a --batch-invariant server gives, bitwise."""
    from strop.engines.config import EngineConfig
    from strop.engines.launch import engine_flags

    assert engine_flags(EngineConfig(kind="strop", launch=1, speculative=3)) == ["--speculative", "3"]
    assert engine_flags(EngineConfig(kind="embedded", speculative=3)) == []  # (the embedded engine takes it itself)
    both = EngineConfig(kind="strop", launch=1, speculative=2, cpu_kernels="onednn")
    assert engine_flags(both) == ["--speculative", "2", "--cpu-kernels", "onednn"]
    spec, plain = start_server(None, "--speculative", "3"), start_server(None, "--batch-invariant")
    assert "speculative: up to 3 drafted tokens" in spec.log_tail(20000)
    body = {
        "input_ids": [[5, 17, 230, 9, 5, 17], [44, 45, 46]],
        "return_logprob": True,
        "sampling_params": {
            "temperature": 1.0,
            "max_new_tokens": 24,
            "stop_token_ids": [-1],
            "n": 4,
            "sampling_seed": 7,
        },
    }
    answers = []
    for server in (spec, plain):
        r = _post(server.url, "/generate", body)
        assert r.status_code == 200, r.text
        answers.append([(a["output_ids"], a["meta_info"]["output_token_logprobs"]) for a in r.json()])
    assert answers[0] == answers[1] and len(answers[0]) == 8 and all(len(ids) == 24 for ids, _ in answers[0])
