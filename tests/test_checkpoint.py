"""Checkpoints and exact resume: runs killed with SIGKILL (mid-rollout, mid-backward, mid-save, and at
a random moment) and resumed end bitwise equal to a run never interrupted, in one process and under
``--nproc 2`` with FSDP."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from strop import checkpoint
from strop.config import ConfigError, build_config, resume_config, save_config
from strop.observe.metrics import reproducible

ROOT = Path(__file__).resolve().parents[1]
KILLER = [sys.executable, str(ROOT / "tests" / "killer.py"), "train"]


def _args(model_dir, run_dir, *extra):
    return [
        f"--model.path={model_dir}",
        "--data.size=16",
        "--data.eval_size=4",
        "--rollout.prompts_per_step=2",
        "--rollout.n_samples_per_prompt=4",
        "--rollout.max_new_tokens=8",
        "--rollout.reward=tests.plugins:even_token_reward",
        "--rollout.temperature=1.5",
        "--train.steps=5",
        "--train.lr=1e-3",
        "--train.warmup_steps=2",
        "--train.micro_batch_size=2",
        "--eval.every=2",
        "--run.progress=false",
        "--run.save_every=2",
        "--run.keep_checkpoints=2",
        "--parallel.grad_reduce_bucket_bytes=1048576",
        f"--run.dir={run_dir}",
        *extra,
    ]


def _strop(args, kill_at=None, rank=0, timeout=240):
    env = dict(os.environ, STROP_KILL_AT=kill_at or "none:0", STROP_KILL_RANK=str(rank))
    return subprocess.run(KILLER + args, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def _rows(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _weights(path):
    from safetensors.torch import load_file

    return load_file(Path(path) / "model.safetensors")


def _assert_same_run(ref_dir, run_dir):
    ref, got = _rows(ref_dir), _rows(run_dir)
    assert [r["step"] for r in got if "reward_mean" in r] == [1, 2, 3, 4, 5]  # none missing, none twice
    assert [reproducible(r) for r in got] == [reproducible(r) for r in ref]  # every number but time and memory
    a, b = _weights(Path(ref_dir) / "final"), _weights(Path(run_dir) / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _assert_no_incomplete_checkpoint_is_visible(run_dir):
    folder = Path(run_dir) / "checkpoints"
    if not folder.exists():  # killed before the first save: nothing there, nothing half-written
        return
    for p in folder.iterdir():
        assert p.name.startswith(".tmp-") or (p / "meta.json").is_file(), p


def _kill_chain(tiny_model_dir, tmp_path, nproc_args, kills):
    """One run killed at each point of ``kills`` in turn, resumed after each; then finished."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    done = _strop(_args(tiny_model_dir, ref, *nproc_args))
    assert done.returncode == 0, done.stderr[-3000:]
    args = _args(tiny_model_dir, run, *nproc_args)
    for i, (point, rank) in enumerate(kills):
        proc = _strop(args if i == 0 else [*nproc_args, f"--resume={run}"], kill_at=point, rank=rank)
        assert proc.returncode != 0 and f"killer: SIGKILL at {point.split(':')[0]}" in proc.stderr, proc.stderr[-3000:]
        _assert_no_incomplete_checkpoint_is_visible(run)
    proc = _strop([*nproc_args, f"--resume={run}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    _assert_same_run(ref, run)
    return run


@pytest.mark.timeout(600)
def test_sigkill_anywhere_then_resume_is_bitwise_an_uninterrupted_run(tiny_model_dir, tmp_path):
    # checkpoints at steps 2 and 4: killed in the rollout of step 3 (resumes from 2), while saving
    # step 4 (files written, folder not renamed: resumes from 2 again), in the backward of step 5
    # (resumes from 4); killed while saving step 2 at first, the run starts again from step 0
    run = _kill_chain(tiny_model_dir, tmp_path, [], [("save:2", 0), ("rollout:3", 0), ("save:4", 0), ("backward:5", 0)])
    assert [p.name for _, p in checkpoint.complete(run)] == ["step_000004", "step_000005"]  # keep_checkpoints=2
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_000005" / "policy")
    final = _weights(run / "final")
    assert all(torch.equal(p, final[k]) for k, p in policy.state_dict().items() if k in final)


@pytest.mark.timeout(600)
def test_sigkill_under_fsdp_nproc_2_then_resume_is_bitwise(tiny_model_dir, tmp_path):
    run = _kill_chain(
        tiny_model_dir, tmp_path, ["--nproc=2", "--parallel.dp_mode=fsdp"], [("backward:3", 1), ("save:4", 0)]
    )
    shards = sorted(p.name for p in (run / "checkpoints" / "step_000004" / "trainer").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own shards


@pytest.mark.timeout(600)
def test_random_moment_sigkill_then_resume(tiny_model_dir, tmp_path):
    """SIGKILL from outside at random moments after the run starts (the seed is printed)."""
    seed = int(os.environ.get("STROP_KILL_SEED", time.time_ns() % 10_000))
    print(f"random kill seed {seed}")
    rng = random.Random(seed)
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert _strop(_args(tiny_model_dir, ref)).returncode == 0
    args = _args(tiny_model_dir, run)
    for attempt in range(2):
        proc = subprocess.Popen(
            KILLER + (args if attempt == 0 else [f"--resume={run}"]),
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            for line in proc.stdout:  # the run is under way once it names its directory
                if "strop: run directory" in line:
                    break
            time.sleep(rng.uniform(0.0, 2.0))
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it had already finished: resuming a finished run is fine too
                pass
        finally:
            proc.wait(timeout=30)
        _assert_no_incomplete_checkpoint_is_visible(run)
    done = _strop([f"--resume={run}"])
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_same_run(ref, run)


def test_a_changed_field_is_refused_on_resume_unless_allowed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    save_config(build_config(overrides={"train": {"lr": 1e-5}}), run / "config.yaml")
    with pytest.raises(ConfigError, match=r"(?s)train.lr: 1e-05 -> 0.001.*--allow-change train.lr"):
        resume_config(run, overrides={"train": {"lr": 1e-3}})
    cfg = resume_config(run, overrides={"train": {"lr": 1e-3, "steps": 99}}, allow=["train.lr", "train.steps"])
    assert cfg.train.lr == 1e-3 and cfg.train.steps == 99 and cfg.run.dir == str(run)
    assert resume_config(run, overrides={"run": {"progress": False}}).train.lr == 1e-5  # progress is free
    with pytest.raises(ConfigError, match="no such config field"):
        resume_config(run, allow=["train.nope"])
    with pytest.raises(ConfigError, match="resumes in its own directory"):
        resume_config(run, overrides={"run": {"dir": str(tmp_path / "elsewhere")}})


def test_resume_cli_errors(tmp_path, capsys):
    from strop.cli import main

    assert main(["train", f"--resume={tmp_path}"]) == 2
    assert "not a strop run directory" in capsys.readouterr().err
    assert main(["train", "--allow-change=train.lr"]) == 2
    assert "only applies with --resume" in capsys.readouterr().err


def test_latest_ignores_unfinished_folders_and_cut_logs_restores_lengths(tmp_path):
    root = tmp_path / "checkpoints"
    for name, complete_ in (
        ("step_000002", True),
        ("step_000004", True),
        ("step_000006", False),
        (".tmp-step_000008", True),
    ):
        (root / name).mkdir(parents=True)
        if complete_:
            (root / name / "meta.json").write_text("{}")
    assert checkpoint.latest(tmp_path).name == "step_000004"
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    sizes = checkpoint.log_sizes(tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3}\n{"st')  # a row after the checkpoint, and one cut by the kill
    (tmp_path / "samples.jsonl").write_text("late\n")
    checkpoint.cut_logs(tmp_path, sizes)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert (tmp_path / "samples.jsonl").read_text() == ""


def test_resume_latest_is_the_newest_run_with_a_config(tmp_path, monkeypatch):
    from strop.config import find_run_dir

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="no run directory"):
        find_run_dir("latest")
    for i, name in enumerate(("20260101-000000", "20260102-000000", "20260103-000000")):
        (tmp_path / "runs" / name).mkdir(parents=True)
        if name != "20260103-000000":  # the newest has no config: it never started
            (tmp_path / "runs" / name / "config.yaml").write_text("{}")
        os.utime(tmp_path / "runs" / name, (1000 + i, 1000 + i))
    assert find_run_dir("latest").name == "20260102-000000"


@pytest.mark.parametrize(
    "algo",
    [dict(estimator="ppo", kl_coef=0.1, ref_mode="copy"), dict(estimator="grpo", kl_coef=0.1, ref_mode="swap")],
    ids=["ppo-critic", "grpo-swap-ref"],
)
def test_trainer_state_round_trip_is_bitwise(tmp_path, algo):
    """Save after a step, load into a fresh trainer: the next two steps equal the original's, with the
    critic and its optimizer (PPO), the LR warm-up and the reference rebuilt from the initial weights."""
    from strop.config import AlgoConfig, TrainConfig
    from strop.train.trainer import Sampling, Trainer
    from tests.test_trainer import make_samples
    from tests.tiny import make_tiny_model

    def fresh():
        return Trainer(
            make_tiny_model(),
            pad_token_id=0,
            train=TrainConfig(lr=1e-3, warmup_steps=3, micro_batch_size=4),
            algo=AlgoConfig(**algo),
            rollout=Sampling(max_new_tokens=8),
        )

    a = fresh()
    a.step(make_samples(seed=1))
    checkpoint.save_trainer(tmp_path, a)
    later_a = [a.step(make_samples(seed=s)) for s in (2, 3)]
    b = fresh()
    checkpoint.load_trainer(tmp_path, b)
    later_b = [b.step(make_samples(seed=s)) for s in (2, 3)]
    assert [reproducible(m) for m in later_a] == [reproducible(m) for m in later_b]
    for x, y in zip(
        [*a.model.parameters(), *(a.critic.parameters() if a.critic else ())],
        [*b.model.parameters(), *(b.critic.parameters() if b.critic else ())],
    ):
        assert torch.equal(x, y)
    assert later_a[0]["lr"] < later_a[1]["lr"]  # still warming up: the scheduler's position came back


class _RunsCode:
    """A pickle that runs code when loaded (here: creates a file): what a tampered checkpoint can hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (Path(self.marker),)


def test_checkpoint_files_are_loaded_without_running_their_code(tmp_path):
    """rank<R>.pt and controller.pt go through torch.load(weights_only=True): a file that would run
    code when unpickled is refused with a CheckpointError naming it, and the code never runs."""
    marker = tmp_path / "code-ran"
    torch.save({"step": 1, "payload": _RunsCode(marker)}, tmp_path / "controller.pt")
    with pytest.raises(checkpoint.CheckpointError, match="controller.pt"):
        checkpoint.load_controller_state(tmp_path)
    assert not marker.exists()
    torch.save({"torch_rng": torch.get_rng_state(), "payload": _RunsCode(marker)}, tmp_path / "rank0.pt")
    with pytest.raises(checkpoint.CheckpointError, match="rank0.pt"):
        checkpoint.load_process_state(tmp_path, 0)
    assert not marker.exists()


def test_controller_state_with_samples_and_rng_round_trips_through_the_safe_loader(tmp_path):
    """What strop itself writes (samples held by the rollout manager, the engine's generator state,
    the prompt sampler) loads back equal under the safe loader."""
    from strop.types import Sample, Status

    s = Sample(
        prompt=[{"role": "user", "content": "1+1?"}],
        prompt_ids=[1, 2],
        label="2",
        group_id=3,
        index=1,
        metadata={"row_index": 4, "tool_calls": 1},
    )
    s.append([5, 6], [-0.5, -0.25], weight_version=2)
    s.status, s.reward = Status.COMPLETED, 1.0
    state = {
        "step": 2,
        "weight_version": 2,
        "world": 1,
        "sampler": {"epoch": 0, "offset": 4, "next_group_id": 4},
        "engine_rng": torch.Generator().manual_seed(5).get_state(),
        "elapsed_seconds": 1.5,
        "logs": {"metrics.jsonl": 10},
        "rollout": {"ready": [[s]], "prefetched": None, "dropped": {"stale": 1}},
    }
    tmp = checkpoint.begin(tmp_path, 2)
    path = checkpoint.finish(tmp_path, tmp, 2, controller_state=state, weights=None, model=None, tokenizer=None, keep=1)
    back = checkpoint.load_controller_state(path)
    got = back["rollout"]["ready"][0][0]
    assert got == s and got.status is Status.COMPLETED
    assert torch.equal(back["engine_rng"], state["engine_rng"]) and back["sampler"] == state["sampler"]


def _save(run_dir, step, held, keep=1):
    tmp = checkpoint.begin(run_dir, step)
    return checkpoint.finish(
        run_dir,
        tmp,
        step,
        controller_state={"step": step, "rollout": {"ready": [[held]]}},
        weights=None,
        model=None,
        tokenizer=None,
        keep=keep,
    )


def _assert_only(run_dir, step):
    """``step``'s checkpoint is the one published (and resumable), and nothing else is in the folder."""
    assert checkpoint.latest(run_dir) == checkpoint.step_dir(run_dir, step)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{step:06d}"]
    assert checkpoint.load_controller_state(checkpoint.latest(run_dir))["step"] == step


def test_numpy_values_a_hook_put_into_held_samples_are_saved_as_python_values(tmp_path):
    """A reward hook sets a numpy number on a sample the rollout manager holds (async, one_step_off): the
    checkpoint stores it as a Python number, published and loaded back by the safe loader."""
    import numpy as np

    from strop.types import Sample

    held = Sample(prompt="p", prompt_ids=[1, 2])
    held.metadata["score"], held.metadata["pair"] = np.float64(0.5), (np.int64(2), np.str_("a"))
    path = _save(tmp_path, 3, held)
    got = checkpoint.load_controller_state(path)["rollout"]["ready"][0][0].metadata
    assert got == {"score": 0.5, "pair": (2, "a")} and type(got["score"]) is float and type(got["pair"][0]) is int


def test_a_value_a_checkpoint_cannot_hold_stops_the_save_by_name_and_the_last_good_one_stays(tmp_path):
    import datetime

    from strop.types import Sample

    _save(tmp_path, 2, Sample(prompt="p", prompt_ids=[1, 2]))
    held = Sample(prompt="p", prompt_ids=[1, 2], group_id=5, index=2)
    held.metadata["entry"] = {"when": datetime.date(2024, 1, 1)}  # set by a hook after the sample was made
    why = r"checkpoint of step 4 not saved: sample group=5 index=2 metadata\['entry'\]\['when'\]: datetime.date cannot"
    with pytest.raises(checkpoint.CheckpointError, match=why):
        _save(tmp_path, 4, held)
    _assert_only(tmp_path, 2)


def test_a_checkpoint_that_fails_its_round_trip_is_not_published_and_prunes_nothing(tmp_path, monkeypatch):
    """Whatever slips past the conversion (here: the conversion switched off) and cannot be loaded back:
    the save stops with an error naming it, the new checkpoint is not published and the previous one, with
    run.keep_checkpoints=1, is not removed."""
    import numpy as np

    from strop import types
    from strop.types import Sample

    _save(tmp_path, 2, Sample(prompt="p", prompt_ids=[1, 2]))
    monkeypatch.setattr(types, "checkpointable", lambda value, where: value, raising=False)
    held = Sample(prompt="p", prompt_ids=[1, 2])
    held.metadata["score"] = np.float64(0.5)
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"checkpoint of step 4 not saved \(it could not be "
        r"resumed\): .*controller.pt.*numpy",
    ):
        _save(tmp_path, 4, held)
    _assert_only(tmp_path, 2)


def _samples(x) -> list:
    from strop.types import Sample

    if isinstance(x, Sample):
        return [x]
    items = x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else ()
    return [s for y in items for s in _samples(y)]


@pytest.mark.timeout(300)
def test_a_knights_and_knaves_run_one_step_off_resumes_bitwise_from_a_checkpoint_holding_its_samples(
    tiny_model_dir, tmp_path
):
    """The shipped reasoning-gym task knights_knaves (numpy strings in its entries) in one_step_off: the
    checkpoint of step 1 holds the samples generated ahead, loads through the safe loader, and a run
    resumed from it ends with the uninterrupted run's weights."""
    pytest.importorskip("reasoning_gym")
    import shutil

    run = tmp_path / "run"
    args = [
        f"--model.path={tiny_model_dir}",
        "--data.task=knights_knaves",
        "--data.task_options={}",
        "--data.size=16",
        "--data.eval_size=0",
        "--rollout.reward=reasoning_gym",
        "--rollout.mode=one_step_off",
        "--algo.off_policy_correction=none",
        "--rollout.prompts_per_step=2",
        "--rollout.n_samples_per_prompt=2",
        "--rollout.max_new_tokens=8",
        "--train.steps=2",
        "--train.micro_batch_size=2",
        "--run.save_every=1",
        "--run.keep_checkpoints=2",
        "--run.progress=false",
        f"--run.dir={run}",
    ]
    done = _strop(args)
    assert done.returncode == 0, done.stderr[-3000:]
    final = _weights(run / "final")
    held = _samples(checkpoint.load_controller_state(checkpoint.step_dir(run, 1))["rollout"])
    assert held and all(s.metadata["reasoning_gym_task"] == "knights_knaves" for s in held)
    shutil.rmtree(checkpoint.step_dir(run, 2))  # step 1's is the newest: the resume takes its held samples
    resumed = _strop([f"--resume={run}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step_000001" in resumed.stdout
    got = _weights(run / "final")
    assert got.keys() == final.keys() and all(torch.equal(got[k], final[k]) for k in final)


@pytest.mark.timeout(240)
def test_without_the_policy_copy_a_checkpoint_is_smaller_and_export_writes_it_from_the_trainer_state(
    tiny_model_dir, tmp_path, capsys
):
    """run.checkpoint_policy=false: no policy/ in the checkpoints (the weights are stored once); `strop export`
    writes the policy from the trainer state, equal to the run's final policy, and refuses to overwrite."""
    from strop.cli import main

    run = _strop(_args(tiny_model_dir, tmp_path / "run", "--run.checkpoint_policy=false"))
    assert run.returncode == 0, run.stderr[-3000:]
    last = checkpoint.latest(tmp_path / "run")
    assert last.name == "step_000005" and not (last / "policy").exists() and (last / "trainer").is_dir()
    assert main(["export", str(last), str(tmp_path / "exported")]) == 0
    got, final = _weights(tmp_path / "exported"), _weights(tmp_path / "run" / "final")
    assert got.keys() == final.keys() and all(torch.equal(got[k], final[k]) for k in final)
    assert (tmp_path / "exported" / "tokenizer.json").is_file()
    assert main(["export", str(last), str(tmp_path / "exported")]) == 1
    assert "exists; export writes a new folder and never overwrites one" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "other")]) == 1  # not a checkpoint
    assert not (tmp_path / "other").exists()
