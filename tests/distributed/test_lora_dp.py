"""LoRA on 2 gloo processes, replicate and FSDP2, equals one process: loss, grad norm, the adapters after two
steps and the merged weights the engine gets; under FSDP only the adapters have gradients and optimizer state,
the merged weights are W + scale B A of the gathered adapters, and checkpoints save and load the adapters."""

import math

import pytest
import torch

from strop.parallel.launch import run_on_ranks
from tests.distributed import BACKEND
from tests.distributed.test_dp import _full, _strategy

pytest.importorskip("peft")

RANK, ALPHA = 4, 8.0  # scale alpha / r = 2
TOL = 1e-6


def _trainer(rank, world, mode, kl_coef=0.1, files=None):
    """A LoRA trainer on the tiny model, whole, or on the meta device and read from ``files`` (as a run loads
    it to shard it)."""
    from strop.config import AlgoConfig, TrainConfig, build_config
    from strop.models import meta_model
    from strop.train.modules import build_modules
    from strop.train.trainer import Sampling, Trainer
    from tests.tiny import make_tiny_model

    section = build_config(overrides={"model": {"lora_rank": RANK, "lora_alpha": ALPHA}}).model
    train = TrainConfig(lr=1e-3, warmup_steps=0, micro_batch_size=3)
    algo = AlgoConfig(kl_coef=kl_coef)  # the reference is the model with its adapters off
    dp = _strategy(rank, world, mode)
    model = make_tiny_model() if files is None else meta_model(str(files), dtype=torch.float32)
    torch.manual_seed(1)  # the adapters' A: the same whichever way the model came
    modules = build_modules(model, dp, algo, train, weights_path=files and str(files), lora=section)
    return Trainer(modules, pad_token_id=0, train=train, algo=algo, rollout=Sampling(max_new_tokens=8), parallel=dp)


def _lora_steps(rank, world, mode="replicate", steps=2, files=None):
    """``steps`` LoRA steps; each step's metrics, which parameters had gradients at each optimizer step, which
    the optimizer holds state for, the adapters (whole) and the merged weights (rank 0's, whole)."""
    from tests.test_trainer import make_samples

    trainer = _trainer(rank, world, mode, files=files)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    with_grads = []
    trainer.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: with_grads.append(
            sorted(n for n, p in trainer.model.named_parameters() if p.grad is not None)
        )
    )
    metrics = [trainer.step(make_samples(10)) for _ in range(steps)]
    stateful = sorted(names[id(p)] for p in trainer.optimizer.state)
    optimized = sorted(names[id(p)] for g in trainer.optimizer.param_groups for p in g["params"])
    adapters = {n: _full(p.detach()).cpu() for n, p in trainer.model.named_parameters() if p.requires_grad}
    merged = trainer.weights()  # a collective under FSDP: every rank joins, rank 0 keeps the result
    frozen = sorted(n for n, p in trainer.model.named_parameters() if not p.requires_grad)
    return {
        "metrics": metrics,
        "with_grads": with_grads,
        "stateful": stateful,
        "optimized": optimized,
        "frozen": frozen,
        "adapters": adapters,
        "merged": {k: v.cpu() for k, v in merged.items()},
        "merged_adapter": {k: v.cpu() for k, v in merged.adapter.items()},
        "scaling": merged.scaling,
        "sharded": trainer.adapters.sharded(),
    }


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_lora_same(results, single):
    """Every rank's steps equal one process's: loss, grad norm and KL within 1e-6 (relative; 1e-8 absolute, for
    the KL of the first steps, itself ~1e-5), the adapters after
    the steps and rank 0's merged weights within 1e-6; the other ranks get no merged weights."""
    diffs = {"loss": 0.0, "grad_norm": 0.0, "adapters": 0.0}
    for got in results:
        for m, ref in zip(got["metrics"], single["metrics"]):
            for key in ("loss", "grad_norm", "kl_ref"):
                assert math.isclose(m[key], ref[key], rel_tol=TOL, abs_tol=1e-8), (key, m[key], ref[key])
                diffs[key] = max(diffs.get(key, 0.0), abs(m[key] - ref[key]))
        diffs["adapters"] = max(diffs["adapters"], _max_diff(got["adapters"], single["adapters"]))
    assert single["metrics"][-1]["kl_ref"] > 0  # the adapters moved the policy off the reference
    assert any(v.abs().max() > 0 for k, v in single["adapters"].items() if ".lora_B." in k)  # B left 0
    assert diffs["adapters"] <= TOL
    diffs["merged"] = _max_diff(results[0]["merged"], single["merged"])
    assert diffs["merged"] <= TOL
    assert all(not r["merged"] for r in results[1:])  # only rank 0 feeds the engine
    print(f"\nLoRA dp=2 vs dp=1, max differences: {diffs}")
    return diffs


@pytest.fixture(scope="module")
def single():
    return _lora_steps(0, 1)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["fsdp", "replicate"])
def test_lora_two_ranks_equal_one_process(mode, single):
    results = run_on_ranks(_lora_steps, 2, mode, timeout=200, backend=BACKEND)
    assert all(r["sharded"] == (mode == "fsdp") for r in results)  # FSDP shards the adapters with the base
    assert_lora_same(results, single)


@pytest.mark.timeout(240)
def test_lora_fsdp_from_the_meta_device_reads_the_model_whole_then_shards_it(tiny_model_dir, single):
    """A sharded run builds the policy on the meta device (strop.setup): the adapters need the whole model, which
    each rank reads from the files before FSDP shards both; the steps equal one process's."""
    results = run_on_ranks(_lora_steps, 2, "fsdp", 2, tiny_model_dir, timeout=200, backend=BACKEND)
    assert all(r["sharded"] for r in results)
    assert_lora_same(results, single)


@pytest.mark.timeout(240)
def test_lora_under_fsdp_only_the_adapters_have_gradients_and_optimizer_state():
    for got in run_on_ranks(_lora_steps, 2, "fsdp", timeout=200, backend=BACKEND):
        adapters = sorted(got["adapters"])
        assert len(adapters) == 2 * 7 * 2 and all(".lora_A." in n or ".lora_B." in n for n in adapters)
        assert got["optimized"] == adapters and got["stateful"] == adapters
        assert got["with_grads"] == [adapters, adapters]  # at both optimizer steps, the adapters alone
        assert got["frozen"] and not any(".lora_" in n for n in got["frozen"])


def _merged_by_hand(rank, world):
    """Two FSDP steps, then the merged weights next to W + (alpha / r) B A from the gathered adapters."""
    from tests.test_trainer import make_samples

    trainer = _trainer(rank, world, "fsdp")
    for _ in range(2):
        trainer.step(make_samples(10))
    whole = {n: _full(p.detach()).cpu() for n, p in trainer.model.named_parameters()}  # every rank gathers
    merged = trainer.weights()
    return whole, {k: v.cpu() for k, v in merged.items()}, dict(merged.adapter), merged.scaling, list(merged.merged)


@pytest.mark.timeout(240)
def test_lora_fsdp_merged_weights_are_the_base_plus_scaled_adapters():
    from tests.tiny import make_tiny_model

    (whole, merged, adapter, scaling, names), (_, other, other_adapter, _, _) = run_on_ranks(
        _merged_by_hand, 2, timeout=200, backend=BACKEND
    )
    assert not other and not other_adapter  # rank 1 gets nothing
    base = make_tiny_model().state_dict()
    assert set(merged) == set(base)  # the base model's names, nothing of peft's
    assert scaling == ALPHA / RANK
    adapted = sorted(n[: -len(".lora_A.default.weight")] for n in whole if n.endswith(".lora_A.default.weight"))
    assert len(adapted) == 14 and sorted(names) == sorted(f"{m}.weight" for m in adapted)
    for module in adapted:
        a, b = whole[f"{module}.lora_A.default.weight"], whole[f"{module}.lora_B.default.weight"]
        w = whole[f"{module}.base_layer.weight"]
        assert torch.equal(w, base[f"{module}.weight"])  # the base weights stay frozen
        assert b.abs().max() > 0
        assert (merged[f"{module}.weight"] - (w + (ALPHA / RANK) * b @ a)).abs().max().item() <= 1e-7
        assert torch.equal(adapter[f"{module}.lora_A"], a) and torch.equal(adapter[f"{module}.lora_B"], b)
    for key, w in base.items():  # every weight LoRA does not adapt, as it was
        if key not in names:
            assert torch.equal(merged[key], w), key


def _checkpointed(rank, world, folder):
    """Two FSDP steps, saved (trainer state and, on rank 0, peft's adapter); a fresh trainer loads the state;
    the adapters and their optimizer state, whole, of both."""
    from strop import checkpoint
    from tests.test_trainer import make_samples

    trainer = _trainer(rank, world, "fsdp")
    for _ in range(2):
        trainer.step(make_samples(10))
    trainer.weights()
    if rank == 0:
        trainer.adapters.save(folder / "adapter")
    checkpoint.save_trainer(folder, trainer)
    fresh = _trainer(rank, world, "fsdp")
    checkpoint.load_trainer(folder, fresh)

    def state(t):
        params = {n: _full(p.detach()).cpu() for n, p in t.model.named_parameters() if p.requires_grad}
        moments = {
            f"{n}.{k}": _full(t.optimizer.state[p][k]).cpu()
            for n, p in t.model.named_parameters()
            if p.requires_grad
            for k in ("exp_avg", "exp_avg_sq")
        }
        return params, moments, t.steps_done

    return state(trainer), state(fresh)


@pytest.mark.timeout(240)
def test_lora_fsdp_checkpoint_saves_and_loads_the_adapters(tmp_path):
    from safetensors.torch import load_file

    results = run_on_ranks(_checkpointed, 2, tmp_path, timeout=200, backend=BACKEND)
    for (params, moments, steps), (loaded, loaded_moments, loaded_steps) in results:
        assert steps == loaded_steps == 2
        assert params.keys() == loaded.keys() and all(torch.equal(params[k], loaded[k]) for k in params)
        assert moments.keys() == loaded_moments.keys()
        assert all(torch.equal(moments[k], loaded_moments[k]) for k in moments)
    params = results[0][0][0]
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")  # peft's names, without "default"
    assert len(saved) == 28
    for name, tensor in saved.items():
        assert torch.equal(tensor, params[name.removeprefix("base_model.model.").replace(".weight", ".default.weight")])
