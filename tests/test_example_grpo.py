"""examples/grpo_one_file.py: it runs on the tiny model, prints its metrics, and its one optimiser step per
batch moves the weights exactly when some advantage is non-zero."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples import grpo_one_file
from strop.models import load_model

SCRIPT = Path(grpo_one_file.__file__)
SMALL = ["--steps", "2", "--prompts", "2", "--samples", "4", "--max-new-tokens", "6", "--seed", "7"]


def variety(sample) -> float:
    """A reward in [0, 1] the random tiny model earns in varying measure (it tends to repeat one token): how many
    different tokens its answer holds, 0 for one token repeated, 1 for all different."""
    ids = sample.response_ids
    return (len(set(ids)) - 1) / max(len(ids) - 1, 1)


def changed_tensors(model, model_dir) -> list[str]:
    before = load_model(str(model_dir)).state_dict()  # the weights on disk, as the run started from them
    return [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]


@pytest.mark.timeout(180)
def test_a_step_with_signal_moves_every_weight(tiny_model_dir):
    rewards = []

    def reward(sample):
        rewards.append(variety(sample))
        return rewards[-1]

    model, history = grpo_one_file.main(["--model", str(tiny_model_dir), *SMALL], reward=reward)
    assert [m["step"] for m in history] == [1, 2]
    assert all(tuple(m) == grpo_one_file.METRICS for m in history)
    assert len(rewards) == 2 * 2 * 4 and all(0.0 <= r <= 1.0 for r in rewards)
    assert all(m["groups_with_signal"] > 0 and m["grad_norm"] > 0 for m in history)
    # departure 3 of the docstring: on-policy, one step per batch, so the ratio is 1 and nothing is clipped
    assert all(m["clip_frac"] == 0.0 for m in history)
    # the engine decodes from the policy's own tensors: its logprobs are the trainer's
    assert all(m["engine_logprob_diff"] < 1e-3 for m in history)
    assert all(m["response_tokens"] <= 6 for m in history)
    assert changed_tensors(model, tiny_model_dir) == list(model.state_dict())


@pytest.mark.timeout(180)
def test_equal_rewards_leave_the_weights_alone(tiny_model_dir):
    """Every group scored alike: every advantage is 0, so the loss, its gradient and the step are 0 too."""
    model, history = grpo_one_file.main(["--model", str(tiny_model_dir), *SMALL], reward=lambda sample: 1.0)
    assert all(m["reward"] == 1.0 and m["groups_with_signal"] == 0 and m["grad_norm"] == 0 for m in history)
    assert changed_tensors(model, tiny_model_dir) == []


@pytest.mark.timeout(180)
def test_the_script_runs_from_the_command_line(tiny_model_dir):
    """As a user runs it, with the default (math) reward: one line of metrics per step, rewards in [0, 1]."""
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(tiny_model_dir), *SMALL],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [dict(kv.split("=") for kv in line.split()) for line in out.stdout.splitlines() if line.startswith("step=")]
    assert [tuple(m) for m in lines] == [grpo_one_file.METRICS] * 2
    assert all(0.0 <= float(m["reward"]) <= 1.0 for m in lines)


def test_sizes_below_one_are_refused(capsys):
    with pytest.raises(SystemExit) as refused:
        grpo_one_file.parse_args(["--samples", "0"])
    assert refused.value.code == 2 and "--samples must be at least 1" in capsys.readouterr().err


def test_the_script_stays_one_readable_file():
    """<= 300 lines, no function over 80, and the docstring names the departures from textbook GRPO."""
    source = SCRIPT.read_text()
    assert len(source.splitlines()) <= 300
    tree = ast.parse(source)
    long = [f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.end_lineno - f.lineno + 1 > 80]
    assert long == []
    doc = ast.get_docstring(tree)
    for departure in (
        "Token-level loss aggregation",
        "No KL term, no reference model",
        "one optimiser step",
        "sample std",
    ):
        assert departure in doc
