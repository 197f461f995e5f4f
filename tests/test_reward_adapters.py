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


TRIAL_REWARDS = {  # one function per shape; each notes what it was called with in LOG
    "per_sample": "def per_sample(sample):\n    return note(sample.response_text, sample.label)\n",
    "per_group": "def per_group(samples):\n    return [note(s.response_text, s.label) for s in samples]\n",
    "trl": "def trl(completions, ground_truth, **kwargs):\n"
    "    return [note(c, g) for c, g in zip(completions, ground_truth)]\n",
    "compute_score": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return note(solution_str, ground_truth)\n",
    "slime": "async def slime(args, sample):\n    return note(sample.response, sample.label)\n",
    "slime_group": "async def slime_group(args, samples):\n    return [note(s.response, s.label) for s in samples]\n",
}


def _trial_file(tmp_path) -> tuple[Path, Path]:
    log = tmp_path / "calls.jsonl"
    body = "import json\n\n\ndef note(response, label):\n"
    body += f"    open({str(log)!r}, 'a').write(json.dumps([response, label]) + '\\n')\n    return 1.0\n\n\n"
    (tmp_path / "trial_rewards.py").write_text(body + "\n\n".join(TRIAL_REWARDS.values()))
    return tmp_path / "trial_rewards.py", log


def _start_checks(tmp_path, **rollout):
    from strop.config import build_config
    from strop.setup import _check_controller_inputs

    (tmp_path / "d.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{i}+1?", "label": str(i + 1)}) + "\n" for i in range(6))
    )
    (tmp_path / "e.jsonl").write_text(json.dumps({"prompt": "9+1?", "label": "10"}) + "\n")
    cfg = build_config(
        overrides={
            "rollout": rollout,
            "data": {"path": str(tmp_path / "d.jsonl"), "eval_path": str(tmp_path / "e.jsonl"), "eval_min_size": 1},
            "run": {"dir": str(tmp_path / "run")},
        }
    )
    return _check_controller_inputs(cfg, {}, False)


@pytest.mark.parametrize("function", list(TRIAL_REWARDS))
def test_every_reward_shape_is_tried_at_start_as_the_run_calls_it(function, tmp_path):
    """The reward is called once on the first training row and once on the first held-out row, before any model
    loads, in the shape the run calls it (per sample or per group, awaited when async), its label as the
    response."""
    path, log = _trial_file(tmp_path)
    reward_fn, _, train_rows, eval_rows = _start_checks(tmp_path, reward=f"{path}:{function}")
    assert callable(reward_fn) and len(train_rows) == 6 and len(eval_rows) == 1
    assert [json.loads(x) for x in log.read_text().splitlines()] == [["1", "1"], ["10", "10"]]
    assert not (tmp_path / "run").exists()


def test_a_reward_that_cannot_score_the_data_is_refused_at_start_unless_told(tmp_path):
    from strop.data.sources import DataError

    # a TRL reward reading a column the data lacks; one that returns nan; a group reward of the wrong length
    for reward, said in [
        ("tests.peer_rewards:trl_needs_column", r"requires \['difficulty'\]"),
        ("tests.plugins:nan_reward", r"returned nan; rewards must be finite"),
        ("tests.plugins:not_a_number_reward", r"returned 'yes'"),
    ]:
        with pytest.raises(DataError, match=rf"rollout.reward='{reward}' cannot score .*d.jsonl:1 .*{said}"):
            _start_checks(tmp_path, reward=reward)
        assert not (tmp_path / "run").exists()
    with pytest.raises(DataError, match=r"rollout.check_reward=false"):
        _start_checks(tmp_path, reward="tests.peer_rewards:trl_needs_column")
    # told not to try it: nothing is called at start and the checks pass
    path, log = _trial_file(tmp_path)
    reward_fn, _, train_rows, _ = _start_checks(tmp_path, reward=f"{path}:trl", check_reward=False)
    assert callable(reward_fn) and len(train_rows) == 6 and not log.exists()


def test_the_trial_runs_under_a_running_event_loop(tmp_path):
    """``strop.train`` from a notebook (an event loop already runs): an async reward is still tried."""
    path, log = _trial_file(tmp_path)

    async def from_a_notebook():
        return _start_checks(tmp_path, reward=f"{path}:slime")

    asyncio.run(from_a_notebook())
    assert len(log.read_text().splitlines()) == 2


@pytest.mark.parametrize("reward", ["tests/verl_reward/gsm8k_style.py", "tests.peer_rewards.trl_quickstart"])
def test_a_reward_file_or_dotted_path_passes_the_start_checks(reward, tmp_path):
    """A reward file named without its function (verl's habit) and slime's dotted path are tried at start in
    their own shape (called with the wrong one, they were once refused there)."""
    reward_fn, _, train_rows, _ = _start_checks(tmp_path, reward=reward)
    assert callable(reward_fn) and len(train_rows) == 6
