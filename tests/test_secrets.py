"""Secrets in the config (engine.token): never written, logged, printed or sent to a tracker; taken
from the environment; a resumed run takes them from the environment again or refuses."""

import os
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, SecretStr

from strop.config import Config, ConfigError, build_config, parse_overrides, resume_config, save_config
from tests.test_e2e import tiny_overrides

SECRET = "s3cret-6f1d2a"


def _secret_fields(model=Config, prefix=""):
    """Every field of the config tree as (dotted name, field info, is a SecretStr)."""
    for name, info in model.model_fields.items():
        kinds = typing.get_args(info.annotation) or (info.annotation,)
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            yield from _secret_fields(info.annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", info, SecretStr in kinds


def test_every_secret_looking_field_is_a_secret_with_an_environment_variable():
    """The class, not one field: a field named like a credential is a SecretStr, and every secret
    names the environment variable it is read from."""
    fields = list(_secret_fields())
    assert any(name == "engine.token" for name, _, _ in fields)
    for name, info, secret in fields:
        leaf = name.rsplit(".", 1)[-1]
        if any(w in leaf for w in ("token", "secret", "password", "api_key")) and "tokens" not in leaf:
            assert secret, f"{name} looks like a credential but is not a SecretStr"
        if secret:
            assert (info.json_schema_extra or {}).get("env", "").startswith("STROP_"), name


def test_a_secret_is_redacted_in_the_saved_config_repr_and_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("STROP_ENGINE_TOKEN", raising=False)
    cfg = build_config(overrides=parse_overrides([f"--engine.token={SECRET}"]))
    assert cfg.engine.token.get_secret_value() == SECRET
    save_config(cfg, tmp_path / "config.yaml")
    assert SECRET not in (tmp_path / "config.yaml").read_text()
    assert SECRET not in repr(cfg) and SECRET not in str(cfg.model_dump()) and SECRET not in cfg.model_dump_json()
    with pytest.raises(ConfigError) as err:  # a bad config next to the secret: the error does not echo it
        build_config(overrides={"engine": {"token": SECRET}, "train": {"lr": -1}})
    assert SECRET not in str(err.value)


def test_the_token_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("STROP_ENGINE_TOKEN", SECRET)
    assert build_config().engine.token.get_secret_value() == SECRET
    assert build_config(overrides={"engine": {"token": "given"}}).engine.token.get_secret_value() == "given"
    monkeypatch.delenv("STROP_ENGINE_TOKEN")
    assert build_config().engine.token is None


def test_resume_takes_a_redacted_secret_from_the_environment_or_refuses(tmp_path, monkeypatch):
    """The saved config holds the secret redacted: resuming never turns the mask into the token."""
    monkeypatch.delenv("STROP_ENGINE_TOKEN", raising=False)
    run = tmp_path / "run"
    run.mkdir()
    save_config(build_config(overrides={"engine": {"token": SECRET}, "run": {"dir": str(run)}}), run / "config.yaml")
    with pytest.raises(ConfigError, match=r"engine\.token.*STROP_ENGINE_TOKEN"):
        resume_config(run)
    monkeypatch.setenv("STROP_ENGINE_TOKEN", "from-env")
    assert resume_config(run).engine.token.get_secret_value() == "from-env"
    monkeypatch.delenv("STROP_ENGINE_TOKEN")
    given = resume_config(run, overrides={"engine": {"token": "given"}})  # or on the command line
    assert given.engine.token.get_secret_value() == "given"
    with pytest.raises(ConfigError, match="STROP_ENGINE_TOKEN"):  # the mask typed in is no token either
        build_config(overrides={"engine": {"token": "**********"}})


@pytest.mark.timeout(300)
def test_a_run_writes_sends_and_prints_no_secret(tiny_model_dir, tmp_path, capfd, monkeypatch):
    """A whole run with engine.token set and offline wandb: no file of the run directory (config.yaml,
    wandb's own copy of the config, logs) and nothing printed holds the secret."""
    from strop.loop import train

    monkeypatch.delenv("STROP_ENGINE_TOKEN", raising=False)
    monkeypatch.setattr(
        sys, "argv", ["strop", "train", f"--engine.token={SECRET}", "--engine.token", SECRET]
    )  # wandb records argv
    run_dir = tmp_path / "run"
    cfg = tiny_overrides(
        tiny_model_dir,
        run_dir,
        engine={"token": SECRET},
        run={"trackers": ["wandb"], "save_final": False, "plot": False},
        train={"steps": 1},
        data={"eval_size": 0},
    )
    train(build_config(overrides=cfg))
    out = capfd.readouterr()
    assert SECRET not in out.out + out.err
    files = [p for p in Path(run_dir).rglob("*") if p.is_file()]
    assert any("wandb" in p.parts for p in files)
    leaked = [str(p) for p in files if SECRET.encode() in p.read_bytes()]
    assert not leaked, leaked


def test_nproc_ranks_get_secrets_by_environment_never_on_their_command_line(monkeypatch):
    from strop.cluster.launcher import secrets_to_environment

    monkeypatch.delenv("STROP_ENGINE_TOKEN", raising=False)
    cfg = build_config(overrides={"engine": {"kind": "strop", "urls": ["http://127.0.0.1:1"], "token": "t0p-s3cret"}})
    for argv in (["--engine.token=t0p-s3cret", "--train.steps=2"], ["--engine.token", "t0p-s3cret", "--train.steps=2"]):
        monkeypatch.delenv("STROP_ENGINE_TOKEN", raising=False)
        assert secrets_to_environment(cfg, argv) == ["--train.steps=2"]
        assert os.environ["STROP_ENGINE_TOKEN"] == "t0p-s3cret"
