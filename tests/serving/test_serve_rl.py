"""strop serve speaking vLLM's RL API: pause modes with requests in flight, the transfer phases on each
backend (in order, out of order, failing midway), versions, the weight checker, bad input. Real server
processes on 127.0.0.1 (the tiny model); the keep-mode recompute is checked on the engine itself."""

import asyncio
import base64
import json
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import save

from strop.process import free_port
from strop.wire.buckets import Bucket, manifest_of
from strop.wire.digest import tensor_digest
from strop.wire.group import close_group, make_group, send_bucket

pytestmark = pytest.mark.timeout(240)
NAME = "model.layers.0.mlp.down_proj.weight"
PREFIX = "dp0:pp0:pcp0:tp0:"


def call(url, method, path, **kw):
    return httpx.request(method, url + path, timeout=60, **kw)


def b64(state: dict) -> str:
    return base64.b64encode(save(state)).decode()


class Streamed:
    """One streamed /v1/completions request in a thread: the time each chunk arrived, its end."""

    def __init__(self, url, max_tokens=200, model="m"):
        self.times, self.tokens, self.finish, self.first = [], 0, None, threading.Event()
        body = {"model": model, "prompt": [3, 40, 7, 9], "max_tokens": max_tokens, "temperature": 1.0, "stream": True}
        body["ignore_eos"] = True
        self.thread = threading.Thread(target=self._run, args=(url, body))
        self.thread.start()

    def _run(self, url, body):
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                self.times.append(time.monotonic())
                self.tokens += 1 if choice.get("text") is not None and choice.get("finish_reason") is None else 0
                self.finish = choice.get("finish_reason") or self.finish
                self.first.set()

    def join(self):
        self.thread.join(120)
        assert not self.thread.is_alive()


def late_request(url, out: dict, model="m"):
    """A request sent while paused, in a thread: its status, finish reason and when it was answered."""
    body = {"model": model, "prompt": [5, 6], "max_tokens": 4, "temperature": 0, "ignore_eos": True}

    def run():
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        finish = r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else r.text[:200]
        out.update(status=r.status_code, finish=finish, at=time.monotonic())

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_pause_modes_with_requests_in_flight(start_server, mode):
    """abort: in-flight requests end now with their tokens so far (sent again if all had ended before the
    pause); wait: the pause returns once they finished; keep: no chunk arrives while paused, they finish after
    /resume. A request arriving while paused waits and succeeds after /resume; pause and resume twice are no
    error."""
    url = start_server().url
    for _attempt in range(3):
        flights = [Streamed(url) for _ in range(3)]
        for f in flights:
            assert f.first.wait(60)
        r = call(url, "POST", f"/pause?mode={mode}")
        paused_at = time.monotonic()
        if mode != "abort":
            break
        for f in flights:
            f.join()
        if any(f.finish == "abort" for f in flights):
            break
        # all 200 tokens were out before the pause (a client thread read its first chunk late): again
        assert call(url, "POST", "/resume").json() == {"status": "resumed"}
    assert r.status_code == 200 and r.json() == {"status": "paused"}
    assert call(url, "POST", f"/pause?mode={mode}").json() == {"status": "paused"}
    assert call(url, "GET", "/is_paused").json() == {"is_paused": True}
    late: dict = {}
    thread = late_request(url, late)
    time.sleep(1.0)
    assert late == {}, "a request arriving while paused must wait"
    resumed_at = time.monotonic()
    assert call(url, "POST", "/resume").json() == {"status": "resumed"}
    assert call(url, "POST", "/resume").json() == {"status": "resumed"}
    thread.join(60)
    for f in flights:
        f.join()
    assert late["status"] == 200 and late["finish"] == "length" and late["at"] >= resumed_at
    if mode == "abort":  # each ended at the pause with its tokens so far, or had ended before it
        ends = [(f.finish, f.tokens, f.times[-1] - paused_at) for f in flights]
        assert any(f.finish == "abort" for f in flights), ends
        assert all(
            (f.finish == "abort" and 0 < f.tokens < 200) or (f.finish == "length" and f.times[-1] <= paused_at + 0.25)
            for f in flights
        ), ends
    else:
        assert all(f.finish == "length" and f.tokens == 200 for f in flights)
    slack = 0.25  # a chunk sent before the pause answered may still be on its way
    if mode == "wait":  # they had all finished when the pause answered
        assert all(f.times[-1] <= paused_at + slack for f in flights)
    if mode == "keep":  # frozen: nothing between the pause and the resume, the rest after it
        chunks = [t for f in flights for t in f.times]
        assert not [t for t in chunks if paused_at + slack < t < resumed_at]
        assert any(t > resumed_at for t in chunks)
    assert call(url, "GET", "/is_paused").json() == {"is_paused": False}


def test_kept_batch_is_recomputed_on_the_new_weights(tiny_model_dir):
    """keep: a batch frozen across a weight load continues from its tokens so far on the new weights,
    token for token what the new weights give from that prefix (greedy), never from its old KV cache; each
    token says which weights sampled it."""
    from transformers import AutoModelForCausalLM

    from strop.serving.embedded import EmbeddedEngine
    from strop.types import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = EmbeddedEngine(model, pad_token_id=0, max_batch_size=4)
    new = {n: t + 0.05 * torch.randn_like(t) for n, t in model.state_dict().items()}
    greedy = SamplingParams(temperature=0, max_new_tokens=30, stop_token_ids=[-1])
    prompt = [3, 40, 7, 9]

    async def main():
        seen = []
        first = asyncio.Event()

        def heard(token, logprob, top):
            seen.append(token)
            if len(seen) == 5:
                first.set()

        task = asyncio.ensure_future(engine.generate(prompt, greedy, on_token=heard))
        await first.wait()
        await engine.pause("keep")
        k = len(seen)
        await engine.update_weights(new, version=1)
        engine.resume()
        out = await task
        rest = await engine.generate(prompt + out.token_ids[:k], SamplingParams(temperature=0, max_new_tokens=30 - k))
        return k, out, rest

    k, out, rest = asyncio.run(main())
    assert 5 <= k < 30 and len(out.token_ids) == 30
    assert out.token_ids[k:] == rest.token_ids
    # the logprobs after the pause are the new weights' from the whole prefix (a stale KV cache changes them)
    torch.testing.assert_close(torch.tensor(out.logprobs[k:]), torch.tensor(rest.logprobs), atol=1e-5, rtol=0)
    assert out.weight_version == 1 and out.token_versions == [0] * k + [1] * (30 - k)
    assert rest.token_versions is None  # one version throughout


def test_transfer_phases_in_and_out_of_order_and_bad_chunks(start_server, tiny_model_dir):
    """The checkpoint backend: ordering errors are 409 and the server keeps serving; a bad chunk is 400
    naming the field, nothing staged; a bad version is refused before anything loads; the staged
    tensors load at finish only, with the version; the checker sees them."""
    from transformers import AutoModelForCausalLM

    url = start_server(None, "--weight-transfer-backend=checkpoint", "--weight-version=4").url
    own = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert call(url, "GET", "/weight_info").json() == {"weight_version": "4"}
    assert call(url, "POST", "/update_weights", json={"update_info": {}}).status_code == 409
    assert call(url, "POST", "/finish_weight_update", json={}).status_code == 409
    assert call(url, "POST", "/start_weight_update").json() == {"message": "Weight update started"}
    assert call(url, "POST", "/start_weight_update").status_code == 409
    assert call(url, "POST", "/shutdown_weight_transfer_engine").status_code == 409
    new = torch.randn_like(own[NAME])
    for chunk, param in (
        ({"safetensors_b64": b64({"nope": new})}, "body.update_info.names[0]"),
        ({"safetensors_b64": b64({NAME: new[:1]})}, "body.update_info.shapes[0]"),
        ({"safetensors_b64": b64({NAME: new.double()})}, "body.update_info.dtype_names[0]"),
        ({"safetensors_b64": "not base64!"}, "body.update_info.safetensors_b64"),
        ({"path": "x"}, "body.update_info.path"),
        ([{"safetensors_b64": b64({NAME: new})}], "body.update_info"),
    ):
        r = call(url, "POST", "/update_weights", json={"update_info": chunk})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    before = call(url, "POST", "/weight_checker", json={"action": "checksum"}).json()["checksums"]
    assert before[PREFIX + NAME] == tensor_digest(own[NAME])
    r = call(url, "POST", "/update_weights", json={"update_info": {"safetensors_b64": b64({NAME: new})}})
    assert r.json() == {"message": "Weights updated"}
    staged = call(url, "POST", "/weight_checker", json={"action": "compare", "baseline": before}).json()
    assert staged == {"match": True, "mismatches": []}  # staged, not loaded: the old weights serve
    for bad in ("x", "-1", "1.5"):
        r = call(url, "POST", "/finish_weight_update", json={"weight_version": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "body.weight_version"
    assert call(url, "POST", "/finish_weight_update", json={"weight_version": 9}).status_code == 400
    assert call(url, "POST", "/finish_weight_update", json={"weight_version": "9"}).status_code == 200
    assert call(url, "GET", "/weight_info").json() == {"weight_version": "9"}
    after = call(url, "POST", "/weight_checker", json={"action": "compare", "baseline": before}).json()
    assert after == {"match": False, "mismatches": [PREFIX + NAME]}
    assert call(url, "POST", "/weight_checker", json={"action": "checksum"}).json()["checksums"][
        PREFIX + NAME
    ] == tensor_digest(new)
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    assert call(url, "POST", "/v1/completions", json=body).status_code == 200  # still serving


def test_versions_and_control_routes_refuse_bad_input(start_server):
    url = start_server().url
    for body in (
        {"new_version": 5},
        {"new_version": "-1"},
        {"new_version": "step-2"},
        {},
        {"new_version": "1", "x": 1},
    ):
        r = call(url, "POST", "/update_weight_version", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("body"), r.text
    assert call(url, "POST", "/update_weight_version", json={"new_version": "7"}).json() == {
        "success": True,
        "new_version": "7",
    }
    assert call(url, "GET", "/weight_info").json() == {"weight_version": "7"}
    for path, param in (
        ("/pause?mode=bogus", "query.mode"),
        ("/pause?mode=keep&clear_cache=maybe", "query.clear_cache"),
        ("/sleep?level=1", "query.level"),
        ("/sleep?level=x", "query.level"),
        ("/wake_up?tags=gpu", "query.tags"),
    ):
        r = call(url, "POST", path)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
    assert call(url, "GET", "/is_paused").json() == {"is_paused": False}  # none of them paused it
    assert call(url, "POST", "/abort_requests", content=b"[1]").status_code == 400
    assert call(url, "POST", "/abort_requests", json={"request_ids": [1]}).status_code == 400
    assert call(url, "POST", "/abort_requests", json={}).json() == {"status": "aborted", "aborted": 0}
    assert call(url, "GET", "/get_world_size").json() == {"world_size": 1}
    assert set(call(url, "GET", "/server_info").json()) == {"vllm_config", "vllm_env", "system_env"}
    assert call(url, "POST", "/sleep?level=0").json() == {"status": "sleeping", "level": 0}
    assert call(url, "GET", "/is_sleeping").json() == {"is_sleeping": True}
    assert call(url, "GET", "/is_paused").json() == {"is_paused": True}
    assert call(url, "POST", "/wake_up").json() == {"status": "awake", "tags": None}
    assert call(url, "GET", "/is_paused").json() == {"is_paused": False}


def test_gloo_transfer_loads_a_broadcast_and_a_broken_one_leaves_the_old_weights(start_server, tiny_model_dir):
    """The broadcast backend: init joins the trainer's group, each update receives the tensors it names (one
    broadcast each, or packed into one), finish loads them; a broadcast that breaks midway drops the round
    (500) and the previous weights keep serving, the version unchanged."""
    from transformers import AutoModelForCausalLM

    url = start_server(None, "--weight-transfer-backend=gloo").url
    own = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "timeout_s": 5}
    for bad, param in (
        ({**init, "master_port": 0}, "body.init_info.master_port"),
        ({**init, "rank_offset": 2}, "body.init_info.rank_offset"),
        ({**init, "world_size": "2"}, "body.init_info.world_size"),
        ({**init, "backend": "nccl"}, "body.init_info.backend"),
        ({**init, "surprise": 1}, "body.init_info.surprise"),
        ({k: v for k, v in init.items() if k != "master_address"}, "body.init_info.master_address"),
    ):
        r = call(url, "POST", "/init_weight_transfer_engine", json={"init_info": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
    r = call(url, "POST", "/update_weights", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"], r.text
    assert call(url, "POST", "/start_weight_update").status_code == 200
    r = call(url, "POST", "/update_weights", json={"update_info": {"names": ["x"], "dtype_names": [], "shapes": []}})
    assert r.status_code == 409, r.text  # a broadcast round needs the trainer's group first
    assert call(url, "POST", "/finish_weight_update", json={}).status_code == 200
    holder = {}
    t = threading.Thread(target=lambda: holder.update(g=make_group("127.0.0.1", port, 0, 2, "gloo", 5)))
    t.start()
    r = call(url, "POST", "/init_weight_transfer_engine", json={"init_info": init})
    t.join(60)
    assert r.json() == {"message": "Weight transfer initialized"}, r.text
    group = holder["g"]
    names = [m for m in manifest_of(own) if "layers.1" in m[0]]
    new = {n: torch.randn_like(own[n]) for n, _, _ in names}
    info = {
        "names": [n for n, _, _ in names],
        "dtype_names": [d for _, d, _ in names],
        "shapes": [list(s) for *_, s in names],
    }

    def send(packed):
        buckets = (
            [Bucket.from_payload(info["names"], info["dtype_names"], info["shapes"], "flattened_bucket")]
            if packed
            else [Bucket.from_payload([n], [d], [s], None) for n, d, s in zip(*info.values())]
        )
        for b in buckets:
            send_bucket(group, b, new, "cpu")

    try:
        assert call(url, "POST", "/start_weight_update").status_code == 200
        for packed in (False, True):
            sender = threading.Thread(target=send, args=(packed,))
            sender.start()
            r = call(url, "POST", "/update_weights", json={"update_info": {**info, "packed": packed}})
            sender.join(60)
            assert r.status_code == 200, r.text
        assert call(url, "POST", "/finish_weight_update", json={"weight_version": "1"}).status_code == 200
        sums = call(url, "POST", "/weight_checker", json={"action": "checksum"}).json()["checksums"]
        assert all(sums[PREFIX + n] == tensor_digest(new[n]) for n in new)
        # a broadcast that breaks: the trainer leaves after the first tensor of the chunk
        assert call(url, "POST", "/start_weight_update").status_code == 200
        first = Bucket.from_payload(info["names"][:1], info["dtype_names"][:1], info["shapes"][:1], None)
        newer = {n: torch.randn_like(t) for n, t in new.items()}

        def send_one_then_leave():
            send_bucket(group, first, newer, "cpu")
            close_group(group)

        sender = threading.Thread(target=send_one_then_leave)
        sender.start()
        r = call(url, "POST", "/update_weights", json={"update_info": info})
        sender.join(60)
        assert r.status_code == 500 and "previous weights keep serving" in r.json()["error"]["message"], r.text
        assert call(url, "POST", "/weight_checker", json={"action": "compare", "baseline": sums}).json()["match"]
        assert call(url, "GET", "/weight_info").json() == {"weight_version": "1"}
        assert call(url, "POST", "/finish_weight_update", json={}).status_code == 409  # the round was dropped
    finally:
        close_group(group)


def test_a_prompt_scored_before_an_update_is_scored_with_the_new_weights_after_it(start_server, tiny_model_dir):
    """Nothing stale after an update: the same prompt, asked before and after a transfer round, gets the logprobs
    of the weights held each time (the trainer's own forward on each), never the earlier answer."""
    from transformers import AutoModelForCausalLM

    from strop.serving.probe import reference_logprobs

    url = start_server(None, "--weight-transfer-backend=checkpoint").url
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    prompt = [3, 40, 7, 9, 11, 5]
    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}

    def served():
        choice = call(url, "POST", "/v1/completions", json=body).json()["choices"][0]
        return torch.tensor([at[str(t)]["logprob"] for t, at in zip(prompt[1:], choice["prompt_logprobs"][1:])])

    before = served()
    torch.testing.assert_close(before, torch.tensor(reference_logprobs(model, prompt)), atol=1e-5, rtol=0)
    new = {n: t + 0.5 * torch.randn_like(t) for n, t in model.state_dict().items() if "layers.1." in n}
    assert call(url, "POST", "/start_weight_update").status_code == 200
    assert call(url, "POST", "/update_weights", json={"update_info": {"safetensors_b64": b64(new)}}).status_code == 200
    assert call(url, "POST", "/finish_weight_update", json={"weight_version": "1"}).status_code == 200
    model.load_state_dict(new, strict=False)
    after = served()
    torch.testing.assert_close(after, torch.tensor(reference_logprobs(model, prompt)), atol=1e-5, rtol=0)
    assert (after - before).abs().max() > 1e-3  # the update changed them: the comparison can fail
