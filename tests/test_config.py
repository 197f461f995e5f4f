import pytest

from strop.config import Config, ConfigError, build_config, parse_overrides


def test_defaults_validate_and_every_field_has_help():
    cfg = build_config()
    assert cfg.train.steps > 0

    def walk(model_cls, prefix=""):
        for name, field in model_cls.model_fields.items():
            assert field.description, f"{prefix}{name} has no help text"
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann, f"{prefix}{name}.")

    walk(Config)


def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lr: 0.001\n  steps: 3\nrollout:\n  temperature: 0.5\n")
    cfg = build_config(str(f), parse_overrides(["--train.steps=7", "--rollout.top_k", "5"]))
    assert (cfg.train.lr, cfg.train.steps, cfg.rollout.temperature, cfg.rollout.top_k) == (0.001, 7, 0.5, 5)


def test_bad_value_names_the_key_and_expectation():
    with pytest.raises(ConfigError, match=r"train\.lr: Input should be greater than 0 \(got '-1'\)"):
        build_config(overrides=parse_overrides(["--train.lr=-1"]))
    with pytest.raises(ConfigError, match=r"train\.steps: Input should be a valid integer.*'many'"):
        build_config(overrides=parse_overrides(["--train.steps=many"]))


def test_unknown_key_in_yaml_is_named(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"train\.learning_rate: unknown key"):
        build_config(str(f))


def test_unknown_key_on_command_line(capsys):
    with pytest.raises(SystemExit):
        parse_overrides(["--train.learning_rate=0.1"])
    assert "--train.learning_rate=0.1" in capsys.readouterr().err


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="eval_seed must differ"):
        build_config(overrides={"data": {"seed": 5, "eval_seed": 5}})
    with pytest.raises(ConfigError, match="needs data.path"):
        build_config(overrides={"data": {"source": "file"}})


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit):
        parse_overrides(["--help"])
    out = capsys.readouterr().out
    for section, model in Config.model_fields.items():
        for name in model.annotation.model_fields:
            assert f"--{section}.{name}" in out


def test_missing_and_broken_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        build_config(str(tmp_path / "nope.yaml"))
    f = tmp_path / "bad.yaml"
    f.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        build_config(str(f))


def test_strop_train_help_names_presets_and_nproc(capsys):
    from strop.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--nproc N" in out and "--preset NAME" in out and "dapo" in out and "--train.lr" in out


def test_preset_on_the_command_line_and_in_yaml(tmp_path):
    assert build_config(preset="dapo").algo.clip_high == 0.28
    f = tmp_path / "c.yaml"
    f.write_text("preset: gspo\ntrain:\n  steps: 3\n")
    cfg = build_config(str(f))
    assert cfg.algo.policy_loss == "gspo" and cfg.train.steps == 3
    with pytest.raises(ConfigError, match="unknown preset 'nope'"):
        build_config(preset="nope")
