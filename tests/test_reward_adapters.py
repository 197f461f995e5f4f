"""Reward functions written for TRL, verl and slime score strop's samples unchanged
(strop/rollout/reward_adapters.py), and each trains the quickstart for a step on the tiny model."""

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from strop.contracts import check_plugin, make_context
from strop.plugins import PluginError
from strop.rollout.generate import score_group
from strop.rollout.reward_adapters import detect_style, resolve_reward
from strop.rollout.rewards import BUILTIN_REWARDS
from strop.types import Sample, Status

HERE = Path(__file__).parent
VERL_FILE = HERE / "verl_reward" / "gsm8k_style.py"


def group(responses, label="4", prompt="What is 2+2?", metadata=None):
    out = []
    for i, text in enumerate(responses):
        s = Sample(prompt=prompt, prompt_ids=[1, 2, 3], label=label, index=i, metadata=dict(metadata or {}))
        s.append([ord(c) % 50 for c in text] or [7], [-0.5] * max(len(text), 1))
        s.response_text, s.status = text, Status.COMPLETED
        out.append(s)
    return out


def scores(reward, samples):
    asyncio.run(score_group(make_context(reward=reward), samples))
    return [s.reward for s in samples]


def test_trl_docs_example_reward_len():
    fn = resolve_reward("tests.peer_rewards:reward_len")
    assert detect_style(fn.strop_adapted[1]) == "trl"
    assert scores(fn, group(["x" * 20, "short", "y" * 25])) == [0.0, -15.0, -5.0]


def test_trl_reward_reads_dataset_columns_and_the_label():
    # the label reaches TRL functions as `solution` and `ground_truth`
    assert scores(resolve_reward("tests.peer_rewards:trl_accuracy"), group(["so 4", "it is 5"])) == [1.0, 0.0]
    # ... and under the data's own label column name
    cfg = SimpleNamespace(data=SimpleNamespace(label_key="answer"))
    fn = resolve_reward("tests.peer_rewards:trl_answer_column", cfg)
    assert scores(fn, group(["4!", "five"])) == [1.0, 0.0]
    # a metadata column a TRL function requires, missing from the samples: stops with its name
    with pytest.raises(PluginError, match=r"requires \['difficulty'\]"):
        scores(resolve_reward("tests.peer_rewards:trl_needs_column"), group(["a"]))
    samples = group(["a", "b"], metadata={"difficulty": 3})
    assert scores(resolve_reward("tests.peer_rewards:trl_needs_column"), samples) == [3.0, 3.0]


def test_trl_conversational_prompts_get_message_lists():
    chat = [{"role": "user", "content": "hi"}]
    # completion [{"role": "assistant", "content": text}]: len(text) + len(prompt messages)
    assert scores(resolve_reward("tests.peer_rewards:trl_chat_len"), group(["abc", "a"], prompt=chat)) == [4.0, 2.0]


def test_an_ambiguous_function_is_declared_with_a_prefix():
    fn = resolve_reward("trl:tests.peer_rewards:any_keywords")
    assert fn.strop_adapted[0] == "trl"
    assert scores(fn, group(["abc", "a"])) == [3.0, 1.0]  # completion_ids: one per character
    assert detect_style(fn.strop_adapted[1]) == "strop"  # undeclared, it would be read as strop's own


def test_verl_compute_score_by_import_path_and_dict_result():
    fn = resolve_reward("tests.peer_rewards:compute_score")
    assert fn.strop_adapted[0] == "verl"
    # data_source from the metadata (the data file's data_source column): +0.5 for 'arith'
    samples = group(["2+2 = 4", "5"], metadata={"data_source": "arith"}) + group(["4"])
    assert scores(fn, samples) == [1.5, 0.5, 1.0]
    with pytest.raises(PluginError, match=r"returned a dict without 'score'"):
        scores(resolve_reward("tests.peer_rewards:verl_no_score"), group(["4"]))


def test_verl_reward_file_by_path():
    fn = resolve_reward(str(VERL_FILE))  # the default function name: compute_score
    samples = group(["... #### 72", "#### 7", "72"], label="72")
    assert scores(fn, samples) == [1.0, 0.1, 0.0]
    # verl's reward_model column as the label: its ground_truth is compared
    assert scores(fn, group(["#### 3"], label={"style": "rule", "ground_truth": "3"})) == [1.0]
    fn = resolve_reward(f"{VERL_FILE}:for_quickstart")
    assert scores(fn, group(["#### 3"], label="3")) == [1.0]


def test_reward_file_errors_are_clear():
    with pytest.raises(PluginError, match=r"relative import .* make the import absolute"):
        resolve_reward(str(HERE / "verl_reward" / "relative.py"))
    with pytest.raises(PluginError, match=r"no 'compute_score' or 'reward' function and 2 public functions"):
        resolve_reward(str(HERE / "verl_reward" / "two_functions.py"))
    assert scores(resolve_reward(f"{HERE}/verl_reward/two_functions.py:score_b"), group(["x"])) == [0.0]
    with pytest.raises(PluginError, match=r"has no function 'nope'"):
        resolve_reward(f"{VERL_FILE}:nope")
    with pytest.raises(PluginError, match=r"no such file"):
        resolve_reward("missing/reward.py")


def test_slime_async_rewards_per_sample_and_per_group():
    fn = resolve_reward("tests.peer_rewards:slime_rm")
    samples = group(["4", "no"], metadata={"bonus": 0.25})
    assert scores(fn, samples) == [1.25, 0.25]
    assert scores(resolve_reward("tests.peer_rewards:slime_group_rm"), group(["abcd", "ab", "a"])) == [1.0, 0.5, 0.25]


def test_a_misspelled_builtin_lists_the_builtins():
    with pytest.raises(PluginError, match=r"no such built-in reward \(built-ins: math, exact_match, reasoning_gym\); "):
        resolve_reward("maths")
    with pytest.raises(PluginError, match=r"did you mean 'exact_match'\?"):
        resolve_reward("exact-match")
    assert resolve_reward("math") is BUILTIN_REWARDS["math"]


def test_an_unknown_shape_names_the_shapes():
    with pytest.raises(
        PluginError, match=r"requires 2 parameter\(s\)(.|\n)*shapes strop takes(.|\n)*verl:  def compute"
    ):
        resolve_reward("tests.peer_rewards:no_known_shape")


def test_strop_check_plugin_takes_every_shape():
    report = check_plugin("reward", "tests.peer_rewards:reward_len")
    # the synthetic group answers 'The answer is 4.' etc. (16 characters): -abs(20 - 16)
    assert "rewards [-4.0, -4.0, -4.0, -4.0]" in str(report)


# ---- one quickstart step with each shape -----------------------------------------------------------
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "reward",
    ["tests.peer_rewards:trl_quickstart", f"{VERL_FILE}:for_quickstart", "tests.peer_rewards:slime_quickstart"],
    ids=["trl", "verl", "slime"],
)
def test_each_shape_trains_the_quickstart_one_step(reward, tiny_model_dir, tmp_path):
    from strop.config import build_config
    from strop.loop import train

    run_dir = tmp_path / "run"
    cfg = build_config(
        overrides={
            "model": {"path": str(tiny_model_dir)},
            "data": {"size": 8, "eval_size": 0},
            "rollout": {"prompts_per_step": 2, "n_samples_per_prompt": 2, "max_new_tokens": 8, "reward": reward},
            "train": {"steps": 1, "warmup_steps": 0},
            "run": {"dir": str(run_dir), "progress": False, "save_every": 0},
        }
    )
    train(cfg)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "reward_mean" in r)
    assert step["failed_fraction"] == 0.0 and not (run_dir / "failed_samples.jsonl").exists()
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2  # (one logged per group)
    for s in samples:  # each function's value: 1 (the answer shows), else the share of even characters
        text = s["response"]
        assert s["reward"] == 1.0 or s["reward"] == pytest.approx(sum(ord(x) % 2 == 0 for x in text) / len(text))
    assert 0.0 < step["reward_mean"] <= 1.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reward", ["tests/verl_reward/gsm8k_style.py", "tests.peer_rewards.trl_quickstart"])
def test_a_reward_file_or_dotted_path_passes_the_start_checks(reward, tmp_path):
    """Only built-in rewards are tried on the first rows at start; a reward file (no ':') or slime's dotted path
    is the user's own and is not called there (it was, with the wrong shape, and the run was refused)."""
    from strop.config import build_config
    from strop.setup import _check_controller_inputs

    cfg = build_config(
        overrides={
            "rollout": {"reward": reward},
            "data": {"size": 8, "eval_size": 0},
            "run": {"dir": str(tmp_path / "run")},
        }
    )
    reward_fn, _, train_rows, _ = _check_controller_inputs(cfg, {}, False)
    assert callable(reward_fn) and len(train_rows) == 8
