"""The Python API: ``strop.Config`` and ``strop.train`` (strop/__init__.py), the run ``strop train`` runs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import strop

ROOT = Path(__file__).resolve().parents[1]


def test_import_strop_loads_neither_torch_nor_the_config():
    code = (
        "import sys, strop; print('torch' in sys.modules, 'pydantic' in sys.modules); "
        "c = strop.Config(train={'steps': 1}); print(c.train.steps, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "False", "1", "False"], out.stdout + out.stderr


def test_the_api_names_the_cli_config():
    from strop.config import Config
    from strop.configbase import ConfigError

    assert strop.Config is Config and strop.ConfigError is ConfigError
    assert {"Config", "train", "load_config"} <= set(dir(strop))
    with pytest.raises(AttributeError, match="no attribute 'Confg'"):
        strop.Confg  # noqa: B018


def test_strop_train_stays_the_function_beside_the_train_package():
    """The import system binds the strop/train/ package to strop.train when it loads: the API keeps the name."""
    import strop.train.trainer

    assert callable(strop.train) and not isinstance(strop.train, type(strop))
    assert strop.train.trainer is sys.modules["strop.train.trainer"]  # (tests/killer.py patches through it)


def test_load_config_merges_sections_and_refuses_bad_values(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = strop.load_config({"train": {"steps": 3}}, train={"lr": 0.5}, rollout={"reward": "exact_match"})
    assert (cfg.train.steps, cfg.train.lr, cfg.rollout.reward) == (3, 0.5, "exact_match")
    given = strop.Config(train={"steps": 2})
    assert strop.load_config(given) is given
    assert strop.load_config(given, run={"dir": "x"}).train.steps == 2
    (tmp_path / "c.yaml").write_text("train:\n  steps: 4\n")
    assert strop.load_config(tmp_path / "c.yaml", train={"lr": 0.1}).train.steps == 4
    with pytest.raises(strop.ConfigError, match=r"train\.steps"):
        strop.train(train={"steps": "many"})  # refused before any model loads: nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


@pytest.mark.timeout(600)
def test_the_api_and_the_cli_run_the_same_run(tiny_model_dir, tmp_path):
    """One step through strop.train and one through `strop train`: equal metrics.jsonl, timings aside."""
    from strop.cli import main
    from strop.observe.metrics import reproducible

    sections = {
        "model": {"path": str(tiny_model_dir)},
        "data": {"size": 8, "eval_size": 0},
        "rollout": {"prompts_per_step": 2, "n_samples_per_prompt": 2, "max_new_tokens": 8},
        "train": {"steps": 1, "warmup_steps": 0},
        "run": {"progress": False, "save_every": 0},
    }
    summary = strop.train(strop.Config(**sections), run={"dir": str(tmp_path / "api")})
    assert summary["steps"] == 1
    flags = [f"--{s}.{k}={v}" for s, values in sections.items() for k, v in values.items()]
    assert main(["train", *flags, f"--run.dir={tmp_path / 'cli'}"]) == 0
    api, cli = (
        [json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in ("api", "cli")
    )
    assert any("reward_mean" in r for r in api)
    assert [reproducible(r) for r in api] == [reproducible(r) for r in cli]
