"""Every preset (the algorithms', and lora) runs a few real quickstart steps without NaN or inf (slow; CI runs them)."""

import json
import math

import pytest

from strop.config import build_config
from strop.loop import train
from strop.presets import PRESETS


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_runs_the_quickstart(preset, tmp_path):
    if "python" in PRESETS[preset]().get("tools", {}).get("enabled", []):
        from tests.test_e2e import _need_sandbox

        _need_sandbox()
    cfg = build_config(
        overrides={
            "data": {"eval_size": 0, "size": 64},
            "rollout": {"prompts_per_step": 2, "n_samples_per_prompt": 4, "max_new_tokens": 24},
            "train": {"steps": 2, "micro_batch_size": 8},
            "run": {
                "dir": str(tmp_path / "run"),
                "progress": False,
                "save_final": False,
                "plot": False,
                "save_every": 0,
            },
        },
        preset=preset,
    )
    summary = train(cfg)
    assert summary["steps"] == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        bad = {k: v for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
        assert r["train_rollout_logprob_abs_diff"] < 1e-3
    if preset == "ppo":
        assert all("value_loss" in r for r in rows)
    if PRESETS[preset]().get("algo", {}).get("kl_coef"):
        assert all("kl_ref" in r for r in rows)
    if PRESETS[preset]().get("tools", {}).get("enabled"):  # the multi-turn run reports its tool use
        steps = [r for r in rows if "reward_mean" in r]
        assert steps and all("tool_calls_mean" in r and "aborted_fraction" in r and "turns_mean" in r for r in steps)


def test_presets_are_valid_configs():
    """Each preset builds, and every value it sets is the built config's (algorithm presets, and the lora one)."""
    for name, preset in PRESETS.items():
        cfg = build_config(preset=name)
        for section, values in preset().items():
            for key, value in values.items():
                assert getattr(getattr(cfg, section), key) == value, f"{name}: {section}.{key}"


def test_a_preset_is_a_function_of_its_name_returning_a_fresh_config():
    for name, preset in PRESETS.items():
        assert preset.__name__ == name and preset.__doc__
        first = preset()
        section = next(iter(first))
        first[section]["changed"] = True
        assert "changed" not in preset()[section]
