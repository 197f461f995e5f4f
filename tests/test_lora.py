"""LoRA (model.lora_rank > 0, strop/train/lora.py): only the adapters train, the reference is the model with
them off, engines get the merged weights, and the saved adapter loads with peft as it trained."""

import copy
import json
import subprocess
import sys

import pytest
import torch

from strop.config import AlgoConfig, TrainConfig, build_config
from strop.parallel.strategy import SingleProcess
from strop.train.modules import build_modules
from strop.train.trainer import Sampling, Trainer
from tests.test_trainer import make_samples

pytest.importorskip("peft")


def lora_trainer(model, rank=4, lr=1e-2, init="default", **algo):
    section = build_config(overrides={"model": {"lora_rank": rank, "lora_alpha": 8, "lora_init": init}}).model
    train = TrainConfig(lr=lr, warmup_steps=0, micro_batch_size=8)
    algo = AlgoConfig(**algo)
    dp = SingleProcess("cpu")
    modules = build_modules(model, dp, algo, train, lora=section)
    return Trainer(modules, pad_token_id=0, train=train, algo=algo, rollout=Sampling(max_new_tokens=8), parallel=dp)


def logprobs(module_or_trainer, samples):
    """Each sample's response logprobs under ``module_or_trainer`` (a causal LM, or a trainer's policy)."""
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logits = module_or_trainer(input_ids=ids).logits[0].float()
            P = len(s.prompt_ids)
            lp = logits[P - 1 : -1].log_softmax(-1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
            out.append(lp)
    return torch.cat(out)


def test_only_the_adapters_train(tiny_model):
    base = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    trainer = lora_trainer(tiny_model)
    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    assert len(adapters) == 2 * 7 * 2  # A and B, 7 linears a layer, 2 layers
    trainer.step(make_samples())
    after = dict(trainer.model.named_parameters())
    for name, p in after.items():
        if p.requires_grad:
            continue
        key = name.replace(".base_layer", "")
        assert torch.equal(p, base[key]), f"{name} changed"
    changed = [n for n, v in adapters.items() if not torch.equal(after[n], v)]
    assert any(".lora_B." in n for n in changed)  # B starts at 0 and moves
    # the optimizer holds the adapters only
    held = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert held == {id(after[n]) for n in adapters}


def test_zero_initialised_adapters_leave_the_base_model_exactly(tiny_model):
    samples = make_samples()
    before = logprobs(copy.deepcopy(tiny_model), samples)
    trainer = lora_trainer(tiny_model)
    assert torch.equal(logprobs(trainer.model, samples), before)


@pytest.mark.parametrize("init", ["default", "gaussian"])
def test_lora_init_sets_how_a_starts_and_the_policy_still_starts_as_the_base(tiny_model, init):
    samples = make_samples()
    before = logprobs(copy.deepcopy(tiny_model), samples)
    torch.manual_seed(0)
    trainer = lora_trainer(tiny_model, rank=4, init=init)
    assert torch.equal(logprobs(trainer.model, samples), before)  # B is zero either way
    a = torch.cat([p.flatten() for n, p in trainer.model.named_parameters() if "lora_A" in n])
    # gaussian: normal of std 1/rank = 0.25; default (Kaiming-uniform, a=sqrt(5)): uniform within 1/sqrt(in)
    # = 1/sqrt(32), std 0.102
    expected = 0.25 if init == "gaussian" else (1 / 32**0.5) / 3**0.5
    assert abs(a.std().item() - expected) < 0.1 * expected, (init, a.std().item())


def test_the_reference_is_the_base_with_adapters_off(tiny_model):
    samples = make_samples()
    base = copy.deepcopy(tiny_model)
    trainer = lora_trainer(tiny_model, kl_coef=0.5)
    assert trainer.ref is None and trainer.ref_state is None and trainer.ref_off  # no copy of the model
    first = trainer.step(samples)
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-7)  # zero-initialised: the policy is the base
    second = trainer.step(samples)
    assert second["kl_ref"] > 0  # the adapters moved the policy away from the reference
    with trainer.adapters.disabled():
        off = logprobs(trainer.model, samples)
    assert torch.allclose(off, logprobs(base, samples), atol=1e-6, rtol=0)
    assert not torch.allclose(logprobs(trainer.model, samples), off, atol=1e-4)  # and on again after the block


def test_engines_get_the_merged_weights_under_the_base_names(tiny_model):
    samples = make_samples()
    engine = copy.deepcopy(tiny_model)
    trainer = lora_trainer(tiny_model)
    for _ in range(2):
        trainer.step(samples)
    merged = trainer.weights()
    assert set(merged) == set(engine.state_dict())  # the base model's names, nothing of peft's
    engine.load_state_dict(merged)
    assert torch.allclose(logprobs(engine, samples), logprobs(trainer.model, samples), atol=1e-5, rtol=0)
    # the merge is W + (alpha / r) B A for every adapted linear
    q = trainer.model.model.layers[0].self_attn.q_proj
    scale = 8 / 4
    expected = q.base_layer.weight + scale * q.lora_B["default"].weight @ q.lora_A["default"].weight
    assert torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"], expected, atol=1e-7)


def test_a_target_that_names_no_linear_is_refused(tiny_model):
    from strop.train.lora import add_adapters

    with pytest.raises(ValueError, match=r"model.lora_target_modules: \['qkv'\] name no linear layer"):
        add_adapters(tiny_model, 4, 8, 0.0, ["q_proj", "qkv"])


def test_without_peft_the_message_says_what_to_install(monkeypatch, tiny_model):
    import builtins

    real = builtins.__import__

    def no_peft(name, *a, **k):
        if name == "peft" or name.startswith("peft."):
            raise ImportError("No module named 'peft'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_peft)
    from strop.train.lora import add_adapters

    with pytest.raises(ImportError, match=r"pip install 'strop\[lora\]'"):
        add_adapters(tiny_model, 4, 8, 0.0, ["q_proj"])


@pytest.mark.timeout(600)
def test_a_lora_run_trains_and_its_adapter_loads_with_peft_elsewhere(tiny_model_dir, tmp_path):
    """The quickstart's loop with LoRA on the tiny model: the engine decodes the merged weights (its logprobs
    equal the trainer's), final/ is the merged model and final/adapter peft's adapter, which loads on the base
    model in a fresh process and gives the merged model's logprobs."""
    from strop.loop import train

    run_dir = tmp_path / "run"
    cfg = build_config(
        overrides={
            "model": {"path": str(tiny_model_dir), "lora_rank": 4, "lora_alpha": 16},
            "data": {"size": 16, "eval_size": 0},
            "rollout": {
                "prompts_per_step": 2,
                "n_samples_per_prompt": 4,
                "max_new_tokens": 8,
                "reward": "tests.plugins:even_token_reward",
            },
            "train": {"steps": 2, "warmup_steps": 0, "lr": 0.05},
            "algo": {"kl_coef": 0.1, "entropy_coef": 0.1},  # (the bonus moves the adapters whatever the rewards)
            "run": {"dir": str(run_dir), "progress": False, "save_every": 0, "plot": False},
        }
    )
    train(cfg)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "kl_ref" in r]
    assert len(steps) == 2 and steps[0]["kl_ref"] == pytest.approx(0.0, abs=1e-7) and steps[1]["kl_ref"] > 0
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-4 for r in steps)  # the engine has the merged weights
    assert "LoRA rank 4 (alpha 16) on q_proj" in (run_dir / "run.log").read_text()
    assert (run_dir / "final" / "adapter" / "adapter_config.json").is_file()
    check = f"""
import json, sys, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
ids = torch.tensor([[1, 5, 9, 200, 31, 7, 44]])
merged = AutoModelForCausalLM.from_pretrained({str(run_dir / "final")!r})
base = AutoModelForCausalLM.from_pretrained({str(tiny_model_dir)!r})
adapted = PeftModel.from_pretrained(base, {str(run_dir / "final" / "adapter")!r})
with torch.no_grad():
    a, m = adapted(input_ids=ids).logits.log_softmax(-1), merged(input_ids=ids).logits.log_softmax(-1)
    b = AutoModelForCausalLM.from_pretrained({str(tiny_model_dir)!r})(input_ids=ids).logits.log_softmax(-1)
print(json.dumps([float((a - m).abs().max()), float((a - b).abs().max())]))
"""
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    adapted_vs_merged, adapted_vs_base = json.loads(out.stdout.strip().splitlines()[-1])
    assert adapted_vs_merged < 1e-5 and adapted_vs_base > 1e-4  # the adapter is what trained, and it moved


def test_lora_beside_tensor_parallel_is_refused_naming_it(tiny_model):
    """Data- and context-parallel ranks train LoRA (tests/distributed/test_lora_dp.py, test_nproc.py); tensor
    parallel does not."""

    class Split(SingleProcess):
        processes, tp_size = 2, 2

    strategy = Split("cpu")
    section = build_config(overrides={"model": {"lora_rank": 4}}).model
    with pytest.raises(
        ValueError,
        match=r"model.lora_rank=4: this run has tensor parallel 2: LoRA adapters train on data-parallel and context",
    ):
        build_modules(tiny_model, strategy, AlgoConfig(), TrainConfig(), lora=section)


@pytest.mark.timeout(600)
def test_a_lora_run_killed_then_resumed_is_bitwise_an_uninterrupted_one(tiny_model_dir, tmp_path):
    """Checkpoints hold the adapters and their optimizer state: killed in step 3's backward, resumed from
    step 2's checkpoint, every logged number, the final model and the adapter equal an uninterrupted run."""
    from safetensors.torch import load_file

    from tests.test_checkpoint import _kill_chain

    lora = ["--model.lora_rank=4", "--model.lora_alpha=8", "--algo.kl_coef=0.1", "--train.lr=0.02"]
    run = _kill_chain(tiny_model_dir, tmp_path, lora, [("backward:3", 0)])
    a = load_file(tmp_path / "ref" / "final" / "adapter" / "adapter_model.safetensors")
    b = load_file(run / "final" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and len(a) == 28 and all(torch.equal(a[k], b[k]) for k in a)
    assert any(v.abs().max() > 0 for k, v in a.items() if "lora_B" in k)  # the adapters trained


def lora_steps(tiny_model_dir, run_dir, extra: dict) -> list[dict]:
    """A 3-step LoRA run on the tiny model with ``extra`` sections over its settings; its steps' metrics."""
    from strop.loop import train

    overrides = {
        "model": {"path": str(tiny_model_dir), "lora_rank": 4, "lora_alpha": 16},
        "data": {"size": 16, "eval_size": 0},
        "rollout": {"prompts_per_step": 2, "n_samples_per_prompt": 4, "max_new_tokens": 8},
        "train": {"steps": 3, "warmup_steps": 0, "lr": 0.05},
        "algo": {"kl_coef": 0.1, "entropy_coef": 0.1},  # (the bonus moves the adapters whatever the rewards)
        "run": {"dir": str(run_dir), "progress": False, "save_every": 0, "plot": False},
    }
    for section, values in extra.items():
        overrides[section] = {**overrides.get(section, {}), **values}
    train(build_config(overrides=overrides))
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in steps if "kl_ref" in r]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "extra",
    [
        {"rollout": {"mode": "one_step_off"}, "algo": {"tis_cap": 2.0}},  # async: the engine's copy lags a step
        {"train": {"max_tokens_per_micro_batch": 64, "logprob_chunk_size": 16}},  # packed rows, chunked logprobs
        {"tools": {"enabled": ["calculator"], "max_turns": 2}},  # multi-turn
        # a launched strop serve sent the merged weights as a full update (the adapter alone: test_lora_adapter_sync)
        {"engine": {"kind": "strop", "launch": 1, "launch_args": ["--threads=1"], "sync": "broadcast"}},
    ],
    ids=["one_step_off", "packed_chunked", "tools", "strop_serve_broadcast"],
)
def test_lora_composes_with(extra, tiny_model_dir, tmp_path):
    steps = lora_steps(tiny_model_dir, tmp_path / "run", extra)
    assert len(steps) == 3 and steps[-1]["kl_ref"] > 0  # the adapters trained, against the base as reference
    if extra.get("rollout", {}).get("mode") != "one_step_off":  # in sync the engine decodes the trainer's weights
        assert all(r["train_rollout_logprob_abs_diff"] < 1e-4 for r in steps)
    assert (tmp_path / "run" / "final" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.timeout(300)
def test_strop_export_of_a_lora_checkpoint_is_the_merged_model_and_the_adapter(tiny_model_dir, tmp_path):
    """Without the policy copy in its checkpoints (run.checkpoint_policy=false), `strop export` builds the policy
    from the trainer state: the adapters are added, loaded and merged, equal to the run's final model bitwise."""
    from safetensors.torch import load_file

    from strop import checkpoint
    from strop.cli import main

    run_dir = tmp_path / "run"
    lora_steps(tiny_model_dir, run_dir, {"run": {"save_every": 3, "checkpoint_policy": False}})
    last = checkpoint.latest(run_dir)
    assert last.name == "step_000003" and not (last / "policy").exists()
    assert main(["export", str(last), str(tmp_path / "exported")]) == 0
    got, final = (load_file(p / "model.safetensors") for p in (tmp_path / "exported", run_dir / "final"))
    assert got.keys() == final.keys() and all(torch.equal(got[k], final[k]) for k in final)
    a, b = (load_file(p / "adapter" / "adapter_model.safetensors") for p in (tmp_path / "exported", run_dir / "final"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
