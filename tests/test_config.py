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
    with pytest.raises(ConfigError, match=r"unrecognized arguments: --train\.learning_rate=0\.1") as err:
        parse_overrides(["--train.learning_rate=0.1"])
    assert "--help-all" in str(err.value)  # a hint, not the whole usage
    assert capsys.readouterr().err == ""


def test_unknown_key_prints_one_error_and_a_hint_not_the_usage(capsys):
    from strop.cli import main

    assert main(["train", "--train.learning_rate=0.1"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --train.learning_rate=0.1" in err and "--help" in err
    assert "usage:" not in err and len(err) < 300, err


def test_tis_with_rollout_logprobs_is_refused():
    for extra in ({"tis_cap": 2.0}, {"mis_low": 0.5}, {"mis_high": 2.0}):
        with pytest.raises(ConfigError, match="does nothing"):
            build_config(overrides={"algo": {"use_rollout_logprobs": True, **extra}})
    build_config(overrides={"algo": {"tis_cap": 2.0}})  # without use_rollout_logprobs it is real


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_group_estimator_with_one_sample_per_prompt_is_refused(estimator):
    with pytest.raises(ConfigError, match="every advantage 0"):
        build_config(overrides={"algo": {"estimator": estimator}, "rollout": {"n_samples_per_prompt": 1}})
    build_config(overrides={"algo": {"estimator": "reinforce_pp"}, "rollout": {"n_samples_per_prompt": 1}})


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
    assert "--nproc N" in out and "--preset NAME" in out and "dapo" in out and "--help-all" in out
    with pytest.raises(SystemExit):
        main(["train", "--help-all"])
    assert "--train.lr float" in capsys.readouterr().out


def test_preset_on_the_command_line_and_in_yaml(tmp_path):
    assert build_config(preset="dapo").algo.clip_high == 0.28
    f = tmp_path / "c.yaml"
    f.write_text("preset: gspo\ntrain:\n  steps: 3\n")
    cfg = build_config(str(f))
    assert cfg.algo.policy_loss == "gspo" and cfg.train.steps == 3
    with pytest.raises(ConfigError, match="unknown preset 'nope'"):
        build_config(preset="nope")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["--cluster.launcher=ray", "--cluster.placement=colocated"], "shares the trainer ranks' bundles with engine"),
        (
            [
                "--cluster.launcher=ray",
                "--cluster.placement=colocated",
                "--cluster.trainer_ranks=1",
                "--engine.kind=strop",
                "--engine.launch=2",
            ],
            "engine.launch=2 engines need as many trainer ranks",
        ),
        (["--engine.kind=vllm", "--engine.launch=1"], "starts vllm servers as Ray engine actors"),
        (["--engine.kind=sglang", "--engine.launch=1"], "starts sglang servers as Ray engine actors"),
        (
            ["--engine.kind=strop", "--engine.launch=1", '--engine.launch_command=["python", "-m", "x"]'],
            "launch_command is the program of launched vLLM or SGLang servers",
        ),
        (["--parallel.tensor_parallel_size=2", "--parallel.context_parallel_size=2"], "do not compose yet"),
        (["--parallel.tensor_parallel_size=2", "--rollout.exact_logprobs=true"], "sums every layer in two halves"),
        (
            ["--parallel.tensor_parallel_size=2", "--algo.kl_coef=0.1", "--algo.ref_mode=swap"],
            "cannot swap into weights split by parallel.tensor_parallel_size=2",
        ),
        (
            ["--train.activation_checkpointing=true", "--parallel.context_parallel_size=2"],
            "a recompute in backward would run outside it",
        ),
        (["--engine.kind=strop", "--engine.launch=1", "--engine.dtype=bfloat16"], "a strop server chooses its own"),
        (["--engine.dtype=bfloat16", "--rollout.exact_logprobs=true"], "samples from other numbers than the float32"),
        (["--train.bf16_autocast=true", "--rollout.exact_logprobs=true"], "forward in bf16 while the engine samples"),
    ],
)
def test_launch_placement_and_parallel_combinations_that_cannot_run_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config(None, parse_overrides(overrides))


def test_a_model_whose_heads_do_not_divide_is_refused_naming_the_counts():
    from transformers import LlamaConfig, Qwen3Config

    from strop.parallel.dims import check_tensor_parallel

    llama = LlamaConfig(
        hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536
    )  # SmolLM2-135M's shape
    check_tensor_parallel(llama, 3)  # 9, 3 and 1536 all divide by 3
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=2 must divide the model's 9 attention heads and "
        r"3 KV heads \(llama\)",
    ):
        check_tensor_parallel(llama, 2)
    with pytest.raises(ValueError, match=r"4 KV heads and 100 MLP width \(intermediate_size\) \(qwen3\)"):
        check_tensor_parallel(
            Qwen3Config(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, intermediate_size=100), 8
        )
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="model type 'gpt2' has no tensor-parallel plan"):
        check_tensor_parallel(GPT2Config(), 2)


def test_a_decoder_layer_without_a_planned_projection_is_refused_naming_it():
    from strop.parallel.tensor import tensor_parallel
    from tests.tiny import make_tiny_model

    model = make_tiny_model()
    for layer in model.model.layers:
        del layer.mlp.gate_proj
    with pytest.raises(ValueError, match="LlamaDecoderLayer has no mlp.gate_proj"):
        tensor_parallel(model, None)  # refused before the mesh is used


@pytest.mark.parametrize(
    "remove,message",
    [
        ("input_layernorm", "LlamaDecoderLayer has no input_layernorm"),
        ("norm", "LlamaModel has no final norm named 'norm'"),
    ],
)
def test_sequence_parallel_without_the_norms_it_splits_is_refused_naming_them(remove, message):
    from strop.parallel.tensor import tensor_parallel
    from tests.tiny import make_tiny_model

    model = make_tiny_model()
    for owner in model.model.layers if remove == "input_layernorm" else [model.model]:
        delattr(owner, remove)
    with pytest.raises(ValueError, match=message):
        tensor_parallel(model, None, sequence_parallel=True)  # refused before the mesh is used


def test_the_documented_tensor_parallel_gpu_config_validates_and_fits_qwen3_8b():
    from pathlib import Path

    from transformers import Qwen3Config

    from strop.parallel.dims import check_tensor_parallel, parallel_layout

    cfg = build_config(str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "tp2_fsdp4_gpu.yaml"))
    assert (cfg.parallel.tensor_parallel_size, cfg.parallel.dp_mode) == (2, "fsdp")
    assert parallel_layout(8, cfg.parallel.context_parallel_size, cfg.parallel.tensor_parallel_size) == (4, 1)
    qwen3_8b = Qwen3Config(
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        num_hidden_layers=36,
    )  # Qwen/Qwen3-8B's config.json
    check_tensor_parallel(qwen3_8b, cfg.parallel.tensor_parallel_size)
