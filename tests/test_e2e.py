"""Two RL steps of the real loop on a tiny random model, and bad input through the CLI."""

import json
import logging
import math

import pytest
import torch

from strop.cli import main
from strop.config import build_config
from strop.loop import train


# a sampling seed whose rollouts vary in reward within a group at both steps (the random tiny model often repeats
# one token, and a step whose groups all score alike trains nothing), for tests that need every step to learn
SIGNAL = {"seed": 2}


def tiny_overrides(model_dir, run_dir, **extra):
    cfg = {
        "model": {"path": str(model_dir)},
        "data": {"size": 16, "eval_size": 4},
        "rollout": {
            "prompts_per_step": 2,
            "n_samples_per_prompt": 4,
            "max_new_tokens": 8,
            "reward": "tests.plugins:even_token_reward",
        },
        "train": {"steps": 2, "lr": 1e-3, "warmup_steps": 0, "micro_batch_size": 3},
        "eval": {"every": 1},
        "run": {"dir": str(run_dir), "progress": False, "save_every": 0},  # checkpoint tests set it
    }
    for section, values in extra.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return cfg


def test_two_rl_steps_change_every_parameter(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    summary = train(build_config(overrides=tiny_overrides(tiny_model_dir, run_dir, rollout=SIGNAL)))
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    after = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    for (name, a), b in zip(after.named_parameters(), before.parameters()):
        assert not torch.equal(a, b), f"{name} did not change"

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        for key in (
            "reward_mean",
            "accuracy",
            "response_length_mean",
            "entropy",
            "clip_fraction",
            "grad_norm",
            "train_rollout_logprob_abs_diff",
            "rollout_tokens_per_s",
            "train_tokens_per_s",
            "step_seconds",
        ):
            assert math.isfinite(r[key]), (key, r[key])
        assert r["train_rollout_logprob_abs_diff"] < 1e-3
        assert r["trained_samples"] > 0
    assert [r["step"] for r in rows if "eval_accuracy" in r] == [0, 1, 2]
    assert summary["steps"] == 2 and summary["eval_accuracy_first"] is not None
    assert (run_dir / "curves.png").stat().st_size > 0 and (run_dir / "config.yaml").exists()
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2


def test_async_reward_function_works(tiny_model_dir, tmp_path):
    cfg = tiny_overrides(
        tiny_model_dir,
        tmp_path / "run",
        rollout={"reward": "tests.plugins:async_even_token_reward"},
        train={"steps": 1},
        run={"save_final": False, "plot": False},
    )
    assert train(build_config(overrides=cfg))["steps"] == 1


def _cli(args, capsys):
    code = main(["train", *args])
    return code, capsys.readouterr().err


def test_missing_model_path_fails_without_a_run_dir(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code, err = _cli([f"--model.path={tmp_path / 'no-such-model'}", f"--run.dir={run_dir}"], capsys)
    assert code == 1 and "no-such-model" in err and "does not exist" in err
    assert not run_dir.exists()


def test_malformed_jsonl_row_names_file_and_line(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1?", "label": "2"}\n{"prompt": "2+2?", "label": "4"\n')
    run_dir = tmp_path / "run"
    code, err = _cli(
        [f"--model.path={tiny_model_dir}", "--data.source=file", f"--data.path={data}", f"--run.dir={run_dir}"], capsys
    )
    assert code == 1 and f"{data}:2: not valid JSON" in err
    assert not run_dir.exists()
    data.write_text('{"question": "1+1?"}\n')
    code, err = _cli(
        [f"--model.path={tiny_model_dir}", "--data.source=file", f"--data.path={data}", f"--run.dir={run_dir}"], capsys
    )
    assert code == 1 and f"{data}:1: missing prompt key 'prompt'" in err


def test_unknown_config_key_fails_before_anything_loads(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rollout:\n  n_samples: 4\n")
    code, err = _cli([str(cfg), f"--run.dir={tmp_path / 'run'}"], capsys)
    assert code == 2 and "rollout.n_samples: unknown key" in err
    assert not (tmp_path / "run").exists()


def test_prompt_longer_than_context_window(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        json.dumps({"prompt": "short", "label": "1"})
        + "\n"
        + json.dumps({"prompt": "word " * 400, "label": "1"})
        + "\n"
    )
    code, err = _cli(
        [
            f"--model.path={tiny_model_dir}",
            "--data.source=file",
            f"--data.path={data}",
            f"--run.dir={tmp_path / 'run'}",
        ],
        capsys,
    )
    # the tiny model's window is 256 tokens; row 1 is about 400
    assert code == 1 and "row 1: prompt has" in err and "context window" in err
    assert not (tmp_path / "run").exists()


def test_existing_run_dir_is_never_overwritten(tiny_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "precious.txt").write_text("keep me")
    code, err = _cli([f"--model.path={tiny_model_dir}", f"--run.dir={run_dir}"], capsys)
    assert code == 1 and "already exists" in err
    assert (run_dir / "precious.txt").read_text() == "keep me"


def test_a_run_dir_holding_only_launched_servers_logs_is_used_again(tmp_path):
    """A start that failed after its servers started leaves their logs (engines/<port>.log) and nothing else: the
    same run.dir starts again. Anything more there, or logs that are not plain .log files, is refused."""
    from strop.observe.run_dir import check_run_dir

    def check(run_dir):
        check_run_dir(build_config(overrides={"run": {"dir": str(run_dir)}}))

    logs = tmp_path / "a" / "engines"
    logs.mkdir(parents=True)
    (logs / "40001.log").write_text("strop serve: ...")
    check(tmp_path / "a")
    for name, make in [
        ("more", lambda d: (d / "metrics.jsonl").write_text("{}")),
        ("not_a_log", lambda d: (d / "engines" / "notes.txt").write_text("x")),
        ("a_folder", lambda d: (d / "engines" / "sub.log").mkdir()),
        ("linked", lambda d: (d / "engines" / "40002.log").symlink_to(tmp_path / "a" / "engines" / "40001.log")),
    ]:
        run_dir = tmp_path / name
        (run_dir / "engines").mkdir(parents=True)
        (run_dir / "engines" / "40001.log").write_text("")
        make(run_dir)
        with pytest.raises(FileExistsError, match="already exists and is not empty"):
            check(run_dir)
    linked = tmp_path / "linked_folder"
    linked.mkdir()
    (linked / "engines").symlink_to(logs, target_is_directory=True)
    with pytest.raises(FileExistsError, match="already exists and is not empty"):
        check(linked)


def test_a_reward_that_is_not_a_number_stops_the_run_cleanly(tiny_model_dir, tmp_path):
    from strop.rollout.generate import RewardError

    run_dir = tmp_path / "run"
    cfg = tiny_overrides(
        tiny_model_dir, run_dir, rollout={"reward": "tests.plugins:not_a_number_reward", "check_reward": False}
    )  # (the run-time path: the trial at start would refuse it first, tests/test_reward_adapters.py)
    with pytest.raises(RewardError, match=r"not_a_number_reward on sample group=-?\d+ index=\d+: returned 'yes'"):
        train(build_config(overrides=cfg))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "PluginError" in summary["error"]
    assert not (run_dir / "final").exists()


def test_packed_micro_batches_run_end_to_end(tiny_model_dir, tmp_path):
    cfg = tiny_overrides(
        tiny_model_dir,
        tmp_path / "run",
        train={"max_tokens_per_micro_batch": 200},
        rollout=SIGNAL,
        run={"save_final": False, "plot": False},
    )
    summary = train(build_config(overrides=cfg))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert summary["steps"] == 2 and all(r["train_rollout_logprob_abs_diff"] < 1e-3 for r in steps)
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in steps)


@pytest.mark.parametrize("fast_decode", [True, False])
def test_exact_logprobs_end_to_end_on_both_decode_paths(tiny_model_dir, tmp_path, fast_decode):
    """rollout.exact_logprobs through the real loop: the gap the trainer measures is exactly 0 and
    the engine's own gap (either decode path) is reported, small but not zero."""
    cfg = tiny_overrides(
        tiny_model_dir,
        tmp_path / "run",
        rollout={"exact_logprobs": True},
        engine={"fast_decode": fast_decode},
        eval={"every": 0},
        run={"save_final": False, "plot": False},
    )
    assert train(build_config(overrides=cfg))["steps"] == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert len(steps) == 2
    assert all(r["train_rollout_logprob_abs_diff"] == 0.0 for r in steps)
    assert all(0 < r["engine_logprob_abs_diff"] < 1e-4 for r in steps)


def test_a_bf16_engine_beside_an_fp32_trainer_reports_its_gap(tiny_model_dir, tmp_path):
    """engine.dtype=bfloat16: the embedded engine decodes in bf16 while the trainer stays fp32; the run learns
    through the cast updates and the logprob gap each step reports is bf16's, far above an fp32 engine's."""
    gaps = {}
    for dtype in ("float32", "bfloat16"):
        cfg = tiny_overrides(
            tiny_model_dir,
            tmp_path / dtype,
            engine={"dtype": dtype},
            rollout=SIGNAL,
            eval={"every": 0},
            run={"save_final": False, "plot": False},
        )
        assert train(build_config(overrides=cfg))["steps"] == 2
        rows = [json.loads(x) for x in (tmp_path / dtype / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "reward_mean" in r]
        assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in steps)
        gaps[dtype] = max(r["train_rollout_logprob_abs_diff"] for r in steps)
    assert gaps["float32"] < 1e-4 and 1e-3 < gaps["bfloat16"] < 1.0 and gaps["bfloat16"] > 100 * gaps["float32"]


def _need_sandbox():
    """The python tool needs an isolation; CI has one, elsewhere a machine may not (skip, saying why)."""
    import os

    from strop.tools.sandbox import Sandbox, SandboxUnavailable

    try:
        Sandbox()
    except SandboxUnavailable as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no sandbox for the python tool here: {exc}")


def test_tools_make_the_run_multi_turn_end_to_end(tiny_model_dir, tmp_path, capsys):
    """tools.enabled through the real loop (a random model rarely calls a tool; the unit tests in
    test_multiturn.py script the calls): the sandbox is chosen and announced, and every step
    reports tool use and the aborted fraction."""
    _need_sandbox()
    cfg = tiny_overrides(
        tiny_model_dir,
        tmp_path / "run",
        tools={"enabled": ["python", "calculator"]},
        eval={"every": 0},
        run={"save_final": False, "plot": False},
    )
    assert train(build_config(overrides=cfg))["steps"] == 2
    assert "strop: tools: python in sandbox:" in capsys.readouterr().out
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert len(steps) == 2 and all(r["turns_mean"] >= 1 and r["aborted_fraction"] == 0.0 for r in steps)
    assert all(math.isfinite(r["tool_calls_mean"]) for r in steps)
    evals = [r for r in rows if "eval_accuracy" in r]
    assert evals and all(0.0 <= r["eval_tool_call_fraction"] <= 1.0 for r in evals)  # eval is multi-turn too


def test_tools_refuse_a_generate_hook_and_partial_resume():
    with pytest.raises(ValueError, match="multi-turn generate function.*plugins.generate"):
        build_config(overrides={"tools": {"enabled": ["calculator"]}, "plugins": {"generate": "tests.plugins:x"}})
    with pytest.raises(ValueError, match="partial='resume'.*restarts clean"):
        build_config(overrides={"tools": {"enabled": ["calculator"]}, "rollout": {"partial": "resume"}})


def test_a_nan_reward_stops_the_run_naming_hook_and_sample(tiny_model_dir, tmp_path):
    from strop.plugins import PluginError

    run_dir = tmp_path / "run"
    cfg = tiny_overrides(
        tiny_model_dir, run_dir, rollout={"reward": "tests.plugins:nan_reward", "check_reward": False}
    )  # (the run-time path: the trial at start would refuse it first, tests/test_reward_adapters.py)
    with pytest.raises(
        PluginError, match=r"nan_reward on sample group=-?\d+ index=\d+: returned nan; rewards must be finite"
    ):
        train(build_config(overrides=cfg))
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"


def test_check_plugin_refuses_a_nan_reward(capsys):
    assert main(["check-plugin", "--hook", "reward", "tests.plugins:nan_reward"]) == 1
    assert "rewards must be finite" in capsys.readouterr().err


def test_a_reward_error_fails_its_sample_is_written_down_and_retried(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    reward = {"reward": "tests.plugins:first_try_fails_reward", "check_reward": False}
    # (check_reward=false: the run-time path; the trial at start would refuse it first, tests/test_reward_adapters.py)
    cfg = tiny_overrides(tiny_model_dir, run_dir, rollout=reward)
    train(build_config(overrides=cfg))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    per_step, n = cfg["rollout"]["prompts_per_step"], cfg["rollout"]["n_samples_per_prompt"]
    assert all(r["sample_failures/reward/KeyError"] == per_step and r["samples_retried"] == per_step for r in steps)
    assert all(r["samples_trained"] == per_step * n and r["failed_fraction"] == 0 for r in steps)  # whole groups
    failed = [json.loads(x) for x in (run_dir / "failed_samples.jsonl").read_text().splitlines()]
    failed = [f for f in failed if f["group_id"] >= 0]  # (held-out prompts, group ids < 0, fail the same way)
    assert len(failed) == per_step * len(steps) and all("no verifier" in f["error"] for f in failed)
    assert all(f["index"] == 0 and f["stage"] == "reward" and f["attempt"] == 1 for f in failed)


def test_a_reward_that_always_fails_drops_whole_groups_and_says_why(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    reward = {"reward": "tests.plugins:flaky_reward", "check_reward": False, "filter_max_rounds": 1}
    with pytest.raises(RuntimeError, match="2 groups had a sample that failed past rollout.sample_retries=1"):
        train(build_config(overrides=tiny_overrides(tiny_model_dir, run_dir, rollout=reward, train={"steps": 1})))
    failed = [json.loads(x) for x in (run_dir / "failed_samples.jsonl").read_text().splitlines()]
    assert sorted(f["attempt"] for f in failed if f["group_id"] >= 0) == [1, 1, 2, 2]


def _step_numbers(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timing = ("seconds", "per_s", "rss", "memory", "gib")
    return [{k: v for k, v in r.items() if not any(t in k for t in timing)} for r in rows]


def test_an_engine_decoding_from_the_trainers_own_weights_changes_no_number(tiny_model_dir, tmp_path, capsys):
    """engine.share_weights (default in sync mode, one process): the engine holds no copy of the weights (its
    parameters are the trainer's tensors), and every logged number and the final weights equal a run whose
    engine keeps its own copy: the fast decoder refreshes what it fused from the weights the optimizer changed."""
    from strop.setup import build

    c = build(build_config(overrides=tiny_overrides(tiny_model_dir, tmp_path / "built")))
    try:
        engine_ptrs = {p.data_ptr() for p in c.engine.model.parameters()}
        assert engine_ptrs == {p.data_ptr() for p in c.trainer.model.parameters()}
    finally:
        c.close()
    for share in (False, None):
        cfg = tiny_overrides(
            tiny_model_dir, tmp_path / str(share), engine={"share_weights": share}, run={"plot": False}
        )
        assert train(build_config(overrides=cfg))["steps"] == 2
    assert "from the trainer's own weights" in capsys.readouterr().out
    copied, shared = _step_numbers(tmp_path / "False"), _step_numbers(tmp_path / "None")
    assert copied == shared and len(copied) == 5  # evaluations at 0, 1, 2 and two steps
    from safetensors.torch import load_file

    a, b = (
        load_file(tmp_path / "False" / "final" / "model.safetensors"),
        load_file(tmp_path / "None" / "final" / "model.safetensors"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            {"rollout": {"mode": "one_step_off", "max_staleness": 1}, "algo": {"use_rollout_logprobs": True}},
            "generates while the trainer changes its weights",
        ),
        ({"engine": {"dtype": "bfloat16"}}, "decodes from a bfloat16 copy"),
        ({"engine": {"fast_decode": False}}, "train mode"),
    ],
)
def test_sharing_the_trainers_weights_where_it_cannot_work_is_refused(tiny_model_dir, tmp_path, overrides, message):
    from strop.config import ConfigError

    cfg = tiny_overrides(tiny_model_dir, tmp_path / "run", **overrides)
    cfg["engine"] = {**cfg.get("engine", {}), "share_weights": True}
    with pytest.raises(ConfigError, match=f"engine.share_weights=true: .*{message}"):
        build_config(overrides=cfg)


def test_a_model_the_fast_decoder_cannot_run_keeps_its_copy_and_refuses_sharing(tmp_path, tokenizer):
    """A model the fast decoder does not know (Mixtral) runs on the fallback decoder, which calls the model's
    forward: unset, the engine keeps a copy of the weights (in eval mode, the trainer's stays in train mode); set to
    true, the run is refused."""
    from strop.config import ConfigError
    from strop.setup import build
    from tests.tiny import make_tiny_mixtral

    path = tmp_path / "mixtral"
    make_tiny_mixtral().save_pretrained(path)
    tokenizer.save_pretrained(path)
    c = build(build_config(overrides=tiny_overrides(path, tmp_path / "auto")))
    try:
        assert not {p.data_ptr() for p in c.engine.model.parameters()} & {
            p.data_ptr() for p in c.trainer.model.parameters()
        }
        assert not c.engine.model.training and c.trainer.model.training
    finally:
        c.close()
    # closed, the components leave no run.log open: a later line (another run's start) is not written there
    logging.getLogger("strop.test_e2e").info("strop: after close")
    assert "after close" not in (tmp_path / "auto" / "run.log").read_text()
    with pytest.raises(ConfigError, match="engine.share_weights=true: strop's fast decoder cannot run this model"):
        build(build_config(overrides=tiny_overrides(path, tmp_path / "on", engine={"share_weights": True})))
