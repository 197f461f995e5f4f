"""engine.sync='adapter': a LoRA run sends strop serve each version's adapter alone, the server merges it with
the trainer's formula, and its checksum of the merged weights is the receipt: a stale or wrong adapter fails
the load naming the server."""

import asyncio
import pytest
import torch

from strop.engines.launch import LocalServer
from strop.engines.sglang import SGLangEngine
from strop.process import free_port
from strop.sync.disk import WeightWriter
from strop.wire.digest import state_checksum
from strop.wire.errors import EngineRequestError
from strop.wire.lora import ADAPTER_FILE, CONFIG_FILE, adapter_pairs, adapter_tensors, merge, peft_files

pytest.importorskip("peft")


def _adapter(model, seed: int, rank: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pairs = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.endswith(("q_proj", "down_proj")):
            pairs[name] = (
                torch.randn(rank, m.in_features, generator=g),
                torch.randn(m.out_features, rank, generator=g),
            )
    return adapter_tensors(pairs)


def _move(adapters) -> None:
    """Every adapter B to new random values (a training step that moved them)."""
    with torch.no_grad():
        for name, p in adapters.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)


def _merged_checksum(model, adapter, scaling) -> str:
    own = model.state_dict()
    return state_checksum(
        {f"{m}.weight": merge(own[f"{m}.weight"], a, b, scaling) for m, (a, b) in adapter_pairs(adapter).items()}
    )


@pytest.mark.timeout(240)
def test_strop_serve_merges_an_adapter_and_its_receipt_catches_a_stale_one(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    writer = WeightWriter(tmp_path / "weights")
    server = LocalServer(str(tiny_model_dir), free_port(), ["--threads=1", f"--weights-dir={tmp_path / 'weights'}"])
    server.start().wait_healthy(120)
    try:

        async def go():
            client = SGLangEngine(server.url, require_checksum=True)
            try:
                first, second = _adapter(base, 1), _adapter(base, 2)
                p1, _ = writer.write(first, 1, "-adapter")
                p2, _ = writer.write(second, 2, "-adapter")
                assert await client.load_adapter(str(p1), 1, 0.5, _merged_checksum(base, first, 0.5)) == 1
                # version 2's adapter merges over the base, not over version 1's merged weights
                assert await client.load_adapter(str(p2), 2, 0.5, _merged_checksum(base, second, 0.5)) == 2
                # an update skipped on purpose: version 3 announced, version 1's file sent
                with pytest.raises(EngineRequestError, match=rf"{server.url}: the adapter of version 3 merged into"):
                    await client.load_adapter(str(p1), 3, 0.5, _merged_checksum(base, second, 0.25))
                # a file that is no adapter, and one outside the server's weights folder, are refused
                bad, _ = writer.write({"model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 32)}, 4, "-bad")
                with pytest.raises(EngineRequestError, match="not LoRA pairs"):
                    await client.load_adapter(str(bad), 4, 0.5, "x")
                with pytest.raises(EngineRequestError, match="outside the weights folder"):
                    await client.load_adapter(str(tiny_model_dir), 4, 0.5, "x")
                # a peft adapter folder: its scale (lora_alpha / r) is read from its config when none is given
                tensors, config = peft_files(adapter_pairs(second), 0.25)
                p5, _ = writer.write(tensors, 5, "-adapter", filename=ADAPTER_FILE, beside={CONFIG_FILE: config})
                assert await client.load_adapter(str(p5), 5, None, _merged_checksum(base, second, 0.25)) == 5
                # its config may not lead outside the weights folder
                outside = tmp_path / "elsewhere"
                outside.mkdir()
                (outside / CONFIG_FILE).write_text(config)
                (p5 / CONFIG_FILE).unlink()
                (p5 / CONFIG_FILE).symlink_to(outside / CONFIG_FILE)
                with pytest.raises(EngineRequestError, match="outside the weights folder"):
                    await client.load_adapter(str(p5), 6, None, "x")
            finally:
                await client.close()

        asyncio.run(go())
    finally:
        server.stop()


@pytest.mark.timeout(600)
def test_a_lora_run_into_strop_serve_sends_the_adapter_alone(tiny_model_dir, tmp_path, capsys):
    from tests.test_lora import lora_steps

    engine = {"kind": "strop", "launch": 1, "launch_args": ["--threads=1"]}  # engine.sync=auto
    steps = lora_steps(tiny_model_dir, tmp_path / "run", {"engine": engine})
    assert "weight sync: adapter (auto: each version's LoRA adapter alone into strop servers" in capsys.readouterr().out
    # what travelled is a peft adapter folder per version
    folders = sorted((tmp_path / "run" / "weights").glob("v*-adapter"))
    assert folders and all(
        {"adapter_config.json", "adapter_model.safetensors"} <= {f.name for f in d.iterdir()} for d in folders
    )
    assert len(steps) == 3 and steps[-1]["kl_ref"] > 0
    # the adapter alone moved: a few percent of the merged model's bytes, every step
    assert all(0 < r["weight_sync_fraction"] < 0.05 for r in steps), [r["weight_sync_fraction"] for r in steps]
    log = (tmp_path / "run" / "run.log").read_text()  # and each step's line says so
    for r in steps:
        assert (
            f"strop: step {r['step']}/3, " in log and f"weights sent {r['weight_sync_fraction']:.1%} of a full" in log
        )
    # and the server decodes exactly the trainer's merged weights (its logprobs are the trainer's)
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-4 for r in steps)


@pytest.mark.timeout(300)
def test_every_replica_behind_the_router_gets_every_adapter(tiny_model_dir, tmp_path):
    from strop.engines.health import HEALTHY
    from strop.engines.router import Router
    from strop.sync.adapter import AdapterSync
    from strop.train.lora import add_adapters
    from tests.tiny import make_tiny_model

    adapters = add_adapters(make_tiny_model(), 2, 4, 0.0, ["q_proj", "v_proj"])
    weights_dir = tmp_path / "weights"
    servers = [
        LocalServer(str(tiny_model_dir), free_port(), ["--threads=1", f"--weights-dir={weights_dir}"]).start()
        for _ in range(2)
    ]
    try:
        for s in servers:
            s.wait_healthy(120)

        async def go():
            clients = [SGLangEngine(s.url, require_checksum=True) for s in servers]
            router = Router(clients, sync=AdapterSync(WeightWriter(weights_dir), keep=3))
            try:
                for version in (1, 2):
                    _move(adapters)
                    weights = adapters.merged_weights()
                    assert await router.update_weights(weights, version) == version
                    # both merged it (each checked its checksum against the trainer's merged weights)
                    assert router.state == [HEALTHY, HEALTHY]
                    assert [await c.get_weight_version() for c in clients] == [version, version]
                    adapter_bytes = sum(t.numel() * t.element_size() for t in weights.adapter.values())
                    assert router.bytes_sent == 2 * adapter_bytes
            finally:
                await router.close()

        asyncio.run(go())
    finally:
        for s in servers:
            s.stop()


@pytest.mark.timeout(300)
def test_sglangs_runtime_adapters_against_strop_serve_speaking_its_routes(tiny_model_dir, tmp_path):
    """The SGLang client's adapter dialect (what a LoRA run sends a real SGLang server: load by name, every
    request naming it, the older one unloaded), against strop serve answering SGLang's LoRA routes; the
    payloads themselves are checked against SGLang 0.5.23's structures in test_sglang_contract.py."""
    from strop.engines.health import HEALTHY
    from strop.engines.router import Router
    from strop.serving.probe import reference_logprobs
    from strop.sync.adapter import AdapterSync
    from strop.train.lora import add_adapters
    from strop.types import SamplingParams
    from strop.wire.errors import EngineReceiptError
    from tests.tiny import make_tiny_model

    adapters = add_adapters(make_tiny_model(), 2, 4, 0.0, ["q_proj", "v_proj"])
    weights_dir = tmp_path / "weights"
    server = LocalServer(str(tiny_model_dir), free_port(), ["--threads=1", f"--weights-dir={weights_dir}"])
    server.start().wait_healthy(120)
    ids = [1, 5, 9, 13, 17, 21]
    try:

        async def go():
            client = SGLangEngine(server.url)  # SGLang's dialect: no checksum, adapters by name
            await client.check_adapters()
            router = Router([client], sync=AdapterSync(WeightWriter(weights_dir), keep=3))
            try:
                for version in (1, 2):
                    _move(adapters)
                    assert await router.update_weights(adapters.merged_weights(), version) == version
                    assert router.state == [HEALTHY] and client.adapter == f"policy-v{version}"
                    # the server decodes with what the trainer holds (the probe), and says which adapter
                    assert await router.probe(ids, reference_logprobs(adapters.model, ids), 1e-4) < 1e-4
                    done = await router.generate(ids, SamplingParams(max_new_tokens=3))
                    assert done.weight_version == version
                    listed = [m["id"] for m in (await client._call("GET", "/v1/models"))["data"]]
                    assert listed[1:] == [f"policy-v{version}"]
                # a request naming an adapter the server does not decode with is refused, naming both
                stale = {"input_ids": ids, "lora_path": "policy-v1", "sampling_params": {"max_new_tokens": 1}}
                with pytest.raises(EngineRequestError, match="'policy-v1' is not the adapter this server decodes"):
                    await client._call("POST", "/generate", json=stale)
                # an update skipped on purpose: the probe sees the server decoding the older adapter
                _move(adapters)
                client.load_runtime_adapter = lambda path, version: asyncio.sleep(0, result=version)
                await router.update_weights(adapters.merged_weights(), 3)
                with pytest.raises(EngineReceiptError, match=rf"SGLangEngine\({server.url}\) at weight version 3"):
                    await router.probe(ids, reference_logprobs(adapters.model, ids), 1e-4)
            finally:
                await router.close()

        asyncio.run(go())
    finally:
        server.stop()
