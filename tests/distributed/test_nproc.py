"""`strop train --nproc 2` end to end on a tiny model: the same run as one process."""

import json
import subprocess
import sys

import pytest
import torch


def _run(tiny_model_dir, run_dir, nproc, mode="replicate", cp=1, tp=1, extra=()):
    args = [
        sys.executable,
        "-m",
        "strop.cli",
        "train",
        f"--model.path={tiny_model_dir}",
        "--data.size=16",
        "--data.eval_size=4",
        "--rollout.prompts_per_step=2",
        "--rollout.n_samples_per_prompt=4",
        "--rollout.max_new_tokens=8",
        "--rollout.reward=tests.plugins:even_token_reward",
        "--train.steps=2",
        "--train.lr=1e-4",
        "--train.warmup_steps=0",
        "--train.micro_batch_size=2",
        "--run.progress=false",
        "--parallel.grad_reduce_bucket_bytes=1048576",
        f"--parallel.dp_mode={mode}",
        f"--run.dir={run_dir}",
        f"--parallel.context_parallel_size={cp}",
        f"--parallel.tensor_parallel_size={tp}",
        *extra,
    ]
    if nproc > 1:
        args.insert(4, f"--nproc={nproc}")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if nproc > 1:
        layout = f"{nproc} processes = data parallel {nproc // cp // tp} ({mode}) x context parallel {cp}"
        assert layout + (f" x tensor parallel {tp}" if tp > 1 else "") in proc.stdout
        # the trainer's weights read in slices, straight into the shards (LoRA: whole, adapted, then sharded)
        lora = any(a.startswith("--model.lora_rank") for a in extra)
        moe = any(a.startswith("--parallel.expert_parallel_size") for a in extra)  # experts fused at load: whole
        split = (mode == "fsdp" or tp > 1) and not lora and not moe
        assert ("strop: trainer weights: each rank reads only its own slices" in proc.stdout) == split
        assert ("LoRA adds its adapters to the whole model" in proc.stdout) == (lora and mode == "fsdp")
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _same_steps(one, two, norm_tol=1e-5):
    """The two runs' step records, paired: both ran 2 steps on the same rollouts with both ranks' shares
    counted, losses within 1e-5 and gradient norms within ``norm_tol`` of each other."""
    steps_one = [r for r in one if "reward_mean" in r]
    steps_two = [r for r in two if "reward_mean" in r]
    assert len(steps_one) == len(steps_two) == 2
    for a, b in zip(steps_one, steps_two):
        assert a["reward_mean"] == b["reward_mean"] and a["trained_samples"] == b["trained_samples"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5
        assert abs(a["grad_norm"] - b["grad_norm"]) <= norm_tol * a["grad_norm"] + 1e-7
    return list(zip(steps_one, steps_two))


def _same_weights(dir_one, dir_two):
    """The final weights two runs saved, within 1e-5 parameter by parameter."""
    from transformers import AutoModelForCausalLM

    m1, m2 = AutoModelForCausalLM.from_pretrained(dir_one), AutoModelForCausalLM.from_pretrained(dir_two)
    for (name, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        assert (p1 - p2).abs().max().item() <= 1e-5, name


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "mode,cp,tp",
    [("replicate", 1, 1), ("fsdp", 1, 1), ("replicate", 2, 1), ("replicate", 1, 2)],
    ids=["dp2-replicate", "dp2-fsdp", "cp2", "tp2"],
)
def test_nproc_2_equals_one_process(tiny_model_dir, tmp_path, mode, cp, tp):
    one = _run(tiny_model_dir, tmp_path / "one", 1)
    two = _run(tiny_model_dir, tmp_path / "two", 2, mode, cp, tp)
    # tensor parallel: the gradient norm is one fp64 sum of squares over the ranks' slices, against torch's fp32
    # norm in one process: within 5e-5 of it (measured 3.4e-5 on this model)
    _same_steps(one, two, norm_tol=5e-5 if tp > 1 else 1e-5)
    _same_weights(tmp_path / "one" / "final", tmp_path / "two" / "final")


@pytest.mark.parametrize("nproc", [1, 3])
def test_context_parallel_size_must_divide_nproc(tmp_path, nproc):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "strop.cli",
            "train",
            f"--nproc={nproc}",
            "--parallel.context_parallel_size=2",
            f"--run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert f"parallel.context_parallel_size=2 needs a multiple of 2 processes, got {nproc}" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(120)
def test_nproc_missing_model_fails_on_every_rank(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "strop.cli",
            "train",
            "--nproc=2",
            f"--model.path={tmp_path / 'missing'}",
            f"--run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode != 0 and "does not exist" in proc.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("split", ["tensor", "expert"])
def test_a_tensor_parallel_checkpoint_resumes_in_one_process_resharded(tiny_model_dir, tokenizer, tmp_path, split):
    """Saved under tensor (or expert) parallel 2 (each rank its slices, torch.distributed.checkpoint): resumed by
    one process, the weights and optimizer state are put back together on load and steps 3-4 are the split run's;
    resumed under the same layout, steps 3-4 and the final weights are the split run's bit for bit."""
    import shutil

    option = f"parallel.{split}_parallel_size"
    if split == "expert":  # a Qwen3-MoE, its experts split over the two ranks
        from tests.tiny import make_tiny_qwen3_moe

        tiny_model_dir = tmp_path / "tiny-moe"
        make_tiny_qwen3_moe(seed=3).save_pretrained(tiny_model_dir)
        tokenizer.save_pretrained(tiny_model_dir)

    def run(run_dir, *extra):
        args = [sys.executable, "-m", "strop.cli", "train", *extra]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    base = [
        f"--model.path={tiny_model_dir}",
        "--data.size=16",
        "--data.eval_size=0",
        "--rollout.prompts_per_step=2",
        "--rollout.n_samples_per_prompt=4",
        "--rollout.max_new_tokens=8",
        "--rollout.reward=tests.plugins:even_token_reward",
        "--train.steps=4",
        "--train.lr=1e-3",
        "--train.micro_batch_size=2",
        "--run.progress=false",
        "--run.save_every=2",
        "--run.keep_checkpoints=2",
    ]
    run(tmp_path / "tp", "--nproc=2", *base, f"--{option}=2", f"--run.dir={tmp_path / 'tp'}")
    for name in ("one", "same"):
        shutil.copytree(tmp_path / "tp", tmp_path / name)
        shutil.rmtree(tmp_path / name / "checkpoints" / "step_000004")
    out = run(
        tmp_path / "one",
        "--resume",
        str(tmp_path / "one"),
        "--allow-change",
        option,
        f"--{option}=1",
    )
    assert "resumed from" in out and "step_000002 at step 2" in out
    out = run(tmp_path / "same", "--nproc=2", "--resume", str(tmp_path / "same"))
    assert "step_000002 at step 2" in out and "not bitwise" not in out
    from strop.observe.metrics import reproducible

    rows = {
        n: [json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in ("tp", "same")
    }
    assert [reproducible(r) for r in rows["same"]] == [reproducible(r) for r in rows["tp"]]
    steps = {}
    for name in ("tp", "one"):
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        steps[name] = {r["step"]: r for r in rows if "reward_mean" in r}
    for k in (3, 4):
        a, b = steps["tp"][k], steps["one"][k]
        assert a["reward_mean"] == b["reward_mean"] and abs(a["loss"] - b["loss"]) <= 1e-5, (k, a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 5e-5 * a["grad_norm"]
    # the TP run's last trainer state, put together by `strop export`, is its final policy
    from safetensors.torch import load_file

    from strop.cli import main

    assert main(["export", str(tmp_path / "tp" / "checkpoints" / "step_000004"), str(tmp_path / "exported")]) == 0
    got, final = (load_file(tmp_path / d / "model.safetensors") for d in ("exported", "tp/final"))
    assert got.keys() == final.keys() and all(torch.equal(got[k], final[k]) for k in final)
    same = load_file(tmp_path / "same" / "final" / "model.safetensors")
    assert all(torch.equal(same[k], final[k]) for k in final)


@pytest.mark.timeout(200)
def test_tensor_parallel_that_does_not_divide_the_kv_heads_fails_before_the_run_starts(tiny_model_dir, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "strop.cli",
            "train",
            "--nproc=4",
            f"--model.path={tiny_model_dir}",
            "--parallel.tensor_parallel_size=4",
            f"--run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode != 0
    assert "parallel.tensor_parallel_size=4 must divide the model's 2 KV heads (llama)" in proc.stderr, proc.stderr[
        -2000:
    ]
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["replicate", "fsdp"])
def test_a_lora_run_on_2_processes_equals_one_process(tiny_model_dir, tmp_path, mode):
    from safetensors.torch import load_file

    lora = ["--model.lora_rank=4", "--model.lora_alpha=8", "--algo.kl_coef=0.1"]
    one = _run(tiny_model_dir, tmp_path / "one", 1, extra=lora)
    two = _run(tiny_model_dir, tmp_path / "two", 2, mode, extra=lora)
    steps = _same_steps(one, two)
    assert all(abs(a["kl_ref"] - b["kl_ref"]) <= 1e-6 for a, b in steps)
    assert steps[-1][0]["kl_ref"] > 0  # the adapters moved the policy off the base
    # the adapter each run saved, whole, and equal
    a1 = load_file(str(tmp_path / "one" / "final" / "adapter" / "adapter_model.safetensors"))
    a2 = load_file(str(tmp_path / "two" / "final" / "adapter" / "adapter_model.safetensors"))
    assert a1.keys() == a2.keys() and any("lora_B" in k and a1[k].abs().max() > 0 for k in a1)
    assert all(a1[k].shape == a2[k].shape and (a1[k] - a2[k]).abs().max().item() <= 1e-6 for k in a1)


@pytest.mark.timeout(400)
def test_a_lora_run_with_context_parallel_2_equals_one_process(tiny_model_dir, tmp_path):
    lora = ["--model.lora_rank=4", "--model.lora_alpha=8", "--algo.kl_coef=0.1"]
    one = _run(tiny_model_dir, tmp_path / "one", 1, extra=lora)
    two = _run(tiny_model_dir, tmp_path / "two", 2, "replicate", cp=2, extra=lora)
    steps = _same_steps(one, two)
    assert all(abs(a["kl_ref"] - b["kl_ref"]) <= 1e-6 for a, b in steps) and steps[-1][0]["kl_ref"] > 0


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["replicate", "fsdp"])
def test_expert_parallel_2_with_routing_replay_equals_one_process(tokenizer, tmp_path, mode):
    """A Qwen3-MoE trained by `strop train --nproc 2` with its experts split over the two ranks (replicated
    otherwise, or FSDP2 for the rest) and the engine's routes replayed: the same rollouts, losses and final
    weights as one process."""
    from tests.tiny import make_tiny_qwen3_moe

    model_dir = tmp_path / "tiny-moe"
    make_tiny_qwen3_moe(seed=3).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    # one micro-batch a step: the second rank joins each dispatch with a repeat weighted 0
    extra = ["--algo.routing_replay=true", "--train.micro_batch_size=16", "--parallel.expert_parallel_size=2"]
    one = _run(model_dir, tmp_path / "one", 1, extra=extra[:2])
    two = _run(model_dir, tmp_path / "two", 2, mode, extra=extra)
    for a, b in _same_steps(one, two, norm_tol=5e-5):
        assert a["routing_disagreement"] == b["routing_disagreement"]  # counted on both ranks' tokens
    _same_weights(tmp_path / "one" / "final", tmp_path / "two" / "final")


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "args,said",
    [
        (["--nproc=3"], "parallel.expert_parallel_size=2 needs a multiple of 2 data-parallel processes, got 3"),
        (["--nproc=4", "--parallel.context_parallel_size=2"], "with tensor or context parallel is not built"),
        (["--nproc=2"], "parallel.expert_parallel_size=2: the model (llama) has no routed experts to split"),
    ],
    ids=["nproc", "cp", "dense"],
)
def test_expert_parallel_that_cannot_split_is_refused_before_the_run(tiny_model_dir, tmp_path, args, said):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "strop.cli",
            "train",
            *args,
            f"--model.path={tiny_model_dir}",
            "--parallel.expert_parallel_size=2",
            f"--run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode != 0 and said in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists() or not (tmp_path / "run" / "metrics.jsonl").exists()
