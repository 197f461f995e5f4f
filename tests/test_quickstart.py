"""A shortened quickstart on the real embedded model (slow; CI runs it)."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from strop.config import build_config
from strop.loop import train

ROOT = Path(__file__).resolve().parents[1]


def _shortened_quickstart(run_dir):
    return build_config(
        overrides={
            "data": {"eval_size": 16},
            "rollout": {"prompts_per_step": 4, "n_samples_per_prompt": 4},
            "train": {"steps": 2},
            "eval": {"every": 0},
            "run": {"dir": str(run_dir), "progress": False, "save_every": 0},
        }
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_shortened_quickstarts_give_identical_metrics(tmp_path):
    """The shortened quickstart runs (finite metrics, engine and trainer logprobs agree, an evaluation, the
    final model); run twice with the same config and seed, every number of metrics.jsonl is equal, except
    measurements of time, speed and memory (strop.observe.metrics.reproducible)."""
    from safetensors.torch import load_file

    from strop.observe.metrics import reproducible

    summary = [train(_shortened_quickstart(tmp_path / name)) for name in ("a", "b")][0]
    a, b = ([json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in "ab")
    steps = [r for r in a if "reward_mean" in r]
    assert len(steps) == 2 and summary["steps"] == 2
    for r in steps:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        # engine and trainer run the same fp32 weights: their logprobs agree
        assert r["train_rollout_logprob_abs_diff"] < 1e-3
    assert 0.0 <= summary["eval_accuracy_first"] <= 1.0 and summary["eval_accuracy_last"] is not None
    assert (tmp_path / "a" / "final" / "config.json").exists()
    assert len(a) == 4 and [reproducible(r) for r in a] == [reproducible(r) for r in b]
    assert any(k.endswith("_seconds") for k in a[1])  # the measured entries exist, and only they are left out
    wa, wb = (load_file(tmp_path / n / "final" / "model.safetensors") for n in "ab")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start.*?```bash\n(.*?)```", readme, re.S).group(1).strip().splitlines()
    assert len(block) == 2, "the Quick start is exactly two commands"
    assert "strop train" in block[0] and "pytest" in block[1]
    assert block[1] in (ROOT / ".ci" / "run").read_text()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quickstart_with_example_reward_and_generate(tmp_path):
    cfg = build_config(
        overrides={
            "data": {"eval_size": 8},
            "rollout": {
                "prompts_per_step": 2,
                "n_samples_per_prompt": 4,
                "max_new_tokens": 24,
                "reward": "examples.plugins.rewards:concise_math_reward",
            },
            "train": {"steps": 2},
            "eval": {"every": 0},
            "run": {"dir": str(tmp_path / "run"), "progress": False, "save_final": False, "save_every": 0},
            "plugins": {"generate": "examples.plugins.generate:answer_prefix_generate"},
        }
    )
    summary = train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert summary["steps"] == 2 and len(steps) == 2
    for r in steps:
        # the forced prefix is not trainable, and the policy's own tokens still match the engine's
        assert r["train_rollout_logprob_abs_diff"] < 1e-3
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))
    # concise_math_reward is 1 - length penalty or 0 - length penalty: never exactly 0 or 1
    assert all(0 < abs(r["reward_mean"]) < 1.2 for r in steps)
