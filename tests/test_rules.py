"""Every rule of strop/rules.py, the refusals that span config sections, has a config here that breaks it:
that rule and no earlier one fires, with its message, and the config is refused before any model loads."""

import pytest

from strop.config import Config, ConfigError, build_config
from strop.rule_reasons import why_not_shared
from strop.rules import RULES, check_rules

RAY = {"launcher": "ray"}
TOOLS = {"tools": {"enabled": ["calculator"]}}
AGENT = {"agent": "my.agent:run"}

# rule name -> (overrides that break it, a piece of its message)
CASES = {
    "launched vllm/sglang servers need ray": (
        {"engine": {"kind": "vllm", "launch": 1}},
        "starts vllm servers as Ray engine actors",
    ),
    "colocated engines need as many trainer ranks": (
        {"cluster": {**RAY, "placement": "colocated", "trainer_ranks": 1}, "engine": {"kind": "strop", "launch": 2}},
        "engine.launch=2 engines need as many trainer ranks (cluster.trainer_ranks=1)",
    ),
    "colocated placement needs launched engines": (
        {"cluster": {**RAY, "placement": "colocated"}},
        "shares the trainer ranks' bundles with engine actors",
    ),
    "group estimators need groups": ({"rollout": {"n_samples_per_prompt": 1}}, "makes every advantage 0"),
    "one_step_off needs staleness": (
        {"rollout": {"mode": "one_step_off", "max_staleness": 0}},
        "it needs rollout.max_staleness >= 1",
    ),
    "stale tokens need a correction": ({"rollout": {"mode": "async"}}, "no off-policy correction is set"),
    "a teacher server scores at temperature 1": (
        {"algo": {"distill_teacher_url": "http://127.0.0.1:1"}},
        "scored at rollout.temperature=0.8",
    ),
    "LoRA is not split by tensor parallel": (
        {"model": {"lora_rank": 8}, "parallel": {"tensor_parallel_size": 2}},
        "model.lora_rank=8 with parallel.tensor_parallel_size=2: LoRA adapters train on data-parallel and context",
    ),
    "adapter updates need LoRA and a server": (
        {"engine": {"kind": "sglang", "urls": ["http://127.0.0.1:1"], "sync": "adapter"}},
        "engine.sync='adapter' sends LoRA adapters to servers (strop serve merges them, vLLM and SGLang load them",
    ),
    "LoRA starts from the base weights": (
        {"model": {"lora_rank": 8, "lora_init": "pissa"}},
        "model.lora_init='pissa' starts the adapters from the weights' own factors",
    ),
    "LoRA has no critic": ({"model": {"lora_rank": 8}, "algo": {"estimator": "ppo"}}, "PPO's critic is a copy"),
    "a loaded teacher is not split by tensor parallel": (
        {"algo": {"distill_teacher": "teacher"}, "parallel": {"tensor_parallel_size": 2}},
        "distil without tensor parallel",
    ),
    "the overlong buffer fits the response limit": (
        {"algo": {"overlong_buffer": 100}},
        "algo.overlong_buffer=100 is longer than rollout.max_new_tokens=48",
    ),
    "scheduled rollouts take no rollout hook": (
        {"rollout": {"mode": "async"}, "algo": {"off_policy_correction": "none"}, "plugins": {"rollout": "my.r:f"}},
        "schedules groups one by one and cannot use a rollout hook",
    ),
    "over-sampling needs the default rollout": (
        {"rollout": {"over_sample": 2.0}, "plugins": {"rollout": "my.r:f"}},
        "rollout.over_sample / dynamic_sampling need the default rollout",
    ),
    "tools take no generate hook": (
        {**TOOLS, "plugins": {"generate": "my.g:f"}},
        "uses strop's multi-turn generate function",
    ),
    "tools take no overlong shaping": (
        {**TOOLS, "algo": {"overlong_buffer": 8}},
        "a multi-turn sample (tools.enabled=['calculator'])",
    ),
    "tools restart a sample clean": ({**TOOLS, "rollout": {"partial": "resume"}}, "a multi-turn sample restarts clean"),
    "an agent generates alone": (
        {"plugins": {**AGENT, "generate": "my.g:f"}},
        "and plugins.generate='my.g:f' generates it another way",
    ),
    "the judge is the one reward": (
        {"reward": {"endpoint": "http://127.0.0.1:9/v1"}, "rollout": {"reward": "math"}},
        "and rollout.reward='math' names another reward: set one of them",
    ),
    "an environment's turns fit its session": (
        {"env": {"openenv": "my.env:Env", "max_turns": 9}},
        "env.max_turns=9 model turns per episode, but a session takes agent.max_calls=8",
    ),
    "an agent session restarts clean": (
        {"plugins": AGENT, "rollout": {"partial": "resume"}},
        "an agent session (plugins.agent='my.agent:run')",
    ),
    "an agent session takes no overlong shaping": (
        {"plugins": AGENT, "algo": {"overlong_buffer": 8}},
        "an agent session holds several calls",
    ),
    "exact logprobs need sync generation here": (
        {"rollout": {"exact_logprobs": True}, "data": {"samples": "s.jsonl"}},
        "data.samples='s.jsonl' replays samples generated elsewhere",
    ),
    "activation checkpointing is not with context parallel": (
        {"train": {"activation_checkpointing": True}, "parallel": {"context_parallel_size": 2}},
        "a recompute in backward would run outside it",
    ),
    "speculation needs strop's own fp32 decoder": (
        {"engine": {"speculative": 4, "dtype": "bfloat16"}},
        "in bfloat16 compute one row at a time",
    ),
    "compiled attention is the embedded decoder's": (
        {"engine": {"compile_attention": True}, "rollout": {"exact_logprobs": True}},
        "decodes every step batch-invariant",
    ),
    "the compiled step is the embedded decoder's": (
        {"engine": {"compile_step": True, "kind": "vllm", "urls": ["http://127.0.0.1:9"]}},
        "servers run their own decode step",
    ),
    "cpu kernels are the embedded decoder's": (
        {"engine": {"cpu_kernels": "mkl", "dtype": "bfloat16"}},
        "MKL's packed sgemm computes float32 only",
    ),
    "shared prefix needs a masked row": (
        {"train": {"shared_prefix": True}, "parallel": {"context_parallel_size": 2}},
        "has no place for a prefix shared by several samples",
    ),
    "engine.dtype is the embedded engine's": (
        {"engine": {"kind": "strop", "launch": 1, "dtype": "bfloat16"}},
        "a strop server chooses its own",
    ),
    "exact logprobs need the engine's dtype": (
        {"engine": {"dtype": "bfloat16"}, "rollout": {"exact_logprobs": True}},
        "samples from other numbers than the float32 trainer",
    ),
    "shared weights need one sync process": (
        {"engine": {"share_weights": True, "fast_decode": False}},
        "engine.share_weights=true: engine.fast_decode=false runs the model's own forward",
    ),
    "exact logprobs are not with bf16 autocast": (
        {"train": {"bf16_autocast": True}, "rollout": {"exact_logprobs": True}},
        "forward in bf16 while the engine samples",
    ),
    "tensor parallel is not with context parallel": (
        {"parallel": {"tensor_parallel_size": 2, "context_parallel_size": 2}},
        "do not compose yet",
    ),
    "exact logprobs are not with tensor parallel": (
        {"parallel": {"tensor_parallel_size": 2}, "rollout": {"exact_logprobs": True}},
        "sums every layer in two halves",
    ),
    "a swapped reference is not split by tensor parallel": (
        {"parallel": {"tensor_parallel_size": 2}, "algo": {"kl_coef": 0.1, "ref_mode": "swap"}},
        "cannot swap into weights split by parallel.tensor_parallel_size=2",
    ),
    "routing replay needs the engine's routes": (
        {"algo": {"routing_replay": True}, "engine": {"fast_decode": False}},
        "engine.fast_decode=false decodes with the model's own forward, which records no routes",
    ),
    "resumed samples need the default generate": (
        {"rollout": {"partial": "resume"}, "plugins": {"generate": "my.g:f"}},
        "plugins.generate='my.g:f' may not: use partial='finish'",
    ),
    "verified updates need engines that report their tensors": (
        {"engine": {"kind": "vllm", "urls": ["http://127.0.0.1:1"], "verify_updates": "first"}},
        "reports digests of its own fused or repacked tensors",
    ),
    "verified updates need whole weights": (
        {"model": {"lora_rank": 8}, "engine": {"kind": "strop", "launch": 1, "verify_updates": "first"}},
        "with the adapter transport",
    ),
    "kept samples need the embedded engine": (
        {
            "rollout": {"mode": "async", "partial": "keep"},
            "algo": {"use_rollout_logprobs": True},
            "engine": {"kind": "vllm", "urls": ["http://127.0.0.1:1"]},
        },
        "engine.kind='vllm' answers one version per request",
    ),
    "corrected resumed tokens need a correction": (
        {"rollout": {"mode": "async", "partial": "resume"}, "algo": {"opsm_delta": 0.1}},
        "trains tokens of older weights with an importance correction",
    ),
}


def test_every_rule_has_a_case_and_every_case_a_rule():
    names = [r.name for r in RULES]
    assert len(names) == len(set(names)), "two rules share a name"
    assert sorted(names) == sorted(CASES), "each rule of strop/rules.py needs a config here that breaks it"


def _unchecked(overrides: dict) -> Config:
    """``overrides`` over the defaults, each section validated, the rules not checked."""
    return Config.model_construct(
        **{
            name: field.annotation.model_validate(overrides.get(name, {}))
            for name, field in Config.model_fields.items()
        }
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_rule_fires_first_with_its_message(name):
    overrides, message = CASES[name]
    broken = [r.name for r in RULES if r.broken(_unchecked(overrides))]
    assert broken[:1] == [name], broken
    with pytest.raises(ConfigError, match="<root>: Value error, ") as err:
        build_config(overrides=overrides)
    assert message in str(err.value)
    with pytest.raises(ValueError) as direct:
        check_rules(_unchecked(overrides))
    assert message in str(direct.value) and str(direct.value) in str(err.value)


def test_an_agents_own_reward_leaves_no_room_for_the_judge():
    with pytest.raises(ConfigError, match="set agent.reward='hook' to have the judge score each session's last"):
        build_config(overrides={"reward": {"endpoint": "http://127.0.0.1:9/v1"}, "plugins": AGENT})
    cfg = build_config(
        overrides={"reward": {"endpoint": "http://127.0.0.1:9/v1"}, "plugins": AGENT, "agent": {"reward": "hook"}}
    )
    assert cfg.reward.endpoint and cfg.agent.reward == "hook"


def test_the_defaults_break_no_rule():
    assert not [r.name for r in RULES if r.broken(Config())]
    assert why_not_shared(Config()) is None
    assert why_not_shared(Config(), world=2) == (
        "2 processes split or replicate the trainer's weights; the engine on rank 0 needs them whole"
    )


@pytest.mark.parametrize("dp_mode", ["replicate", "fsdp"])
def test_lora_on_data_and_context_parallel_ranks_breaks_no_rule_and_beside_tensor_parallel_does(dp_mode):
    lora = {"model": {"lora_rank": 8}}
    for split in ({"dp_mode": dp_mode}, {"dp_mode": dp_mode, "context_parallel_size": 2}):
        assert not [r.name for r in RULES if r.broken(build_config(overrides={**lora, "parallel": split}))]
    beside_tp = _unchecked({**lora, "parallel": {"dp_mode": dp_mode, "tensor_parallel_size": 2}})
    assert [r.name for r in RULES if r.broken(beside_tp)] == ["LoRA is not split by tensor parallel"]


@pytest.mark.parametrize(
    "engine,reason",
    [
        ({"kind": "vllm", "urls": ["http://127.0.0.1:9"]}, "vLLM --speculative-config"),
        ({"kind": "sglang", "urls": ["http://127.0.0.1:9"]}, "SGLang --speculative-algorithm"),
        ({"kind": "strop", "urls": ["http://127.0.0.1:9"]}, "start them with strop serve --speculative N"),
        ({"fast_decode": False}, "has no draft verification"),
        ({"dtype": "bfloat16"}, "in bfloat16 compute one row at a time"),
    ],
)
def test_speculation_is_refused_where_strop_does_not_decode_it_exactly_and_fast(engine, reason):
    with pytest.raises(ConfigError, match="engine.speculative=4: ") as err:
        build_config(overrides={"engine": {"speculative": 4, **engine}})
    assert reason in str(err.value)
    build_config(overrides={"engine": {"speculative": 0, **engine}})  # (each alone is a valid run)


@pytest.mark.parametrize(
    "overrides",
    [
        {"engine": {"speculative": 4}},
        {"engine": {"speculative": 4, "kind": "strop", "launch": 1}},
        {"engine": {"speculative": 4}, "rollout": {"exact_logprobs": True}},
        {"engine": {"speculative": 4}, "rollout": {"mode": "async"}, "algo": {"use_rollout_logprobs": True}},
    ],
)
def test_speculation_composes_with_the_embedded_engine_launched_servers_exact_logprobs_and_async(overrides):
    assert build_config(overrides=overrides).engine.speculative == 4


@pytest.mark.parametrize(
    "engine,reason",
    [
        ({"kind": "vllm", "urls": ["http://127.0.0.1:9"]}, "servers run their own kernels"),
        ({"kind": "sglang", "urls": ["http://127.0.0.1:9"]}, "servers run their own kernels"),
        ({"kind": "strop", "urls": ["http://127.0.0.1:9"]}, "start them with strop serve --cpu-kernels"),
        ({"fast_decode": False}, "the model's own forward"),
        ({"dtype": "bfloat16"}, "use onednn or plain"),
    ],
)
def test_a_cpu_kernel_is_refused_where_it_would_not_run(engine, reason):
    with pytest.raises(ConfigError, match="engine.cpu_kernels='mkl': ") as err:
        build_config(overrides={"engine": {"cpu_kernels": "mkl", **engine}})
    assert reason in str(err.value)
    build_config(overrides={"engine": {"cpu_kernels": "auto", **engine}})  # (each alone is a valid run)


@pytest.mark.parametrize(
    "overrides",
    [
        {"engine": {"cpu_kernels": "onednn", "dtype": "bfloat16"}},
        {"engine": {"cpu_kernels": "plain", "kind": "strop", "launch": 1, "speculative": 4}},
        {"engine": {"cpu_kernels": "mkl"}, "rollout": {"exact_logprobs": True}},
        {"engine": {"cpu_kernels": "onednn"}, "rollout": {"mode": "async"}, "algo": {"use_rollout_logprobs": True}},
    ],
)
def test_cpu_kernels_compose_with_bf16_launched_servers_speculation_exact_logprobs_and_async(overrides):
    cfg = build_config(overrides=overrides)
    assert cfg.engine.cpu_kernels == overrides["engine"]["cpu_kernels"]


@pytest.mark.parametrize("option,what", [("compile_attention", "attention"), ("compile_step", "decode step")])
@pytest.mark.parametrize(
    "overrides,reason",
    [
        ({"engine": {"kind": "vllm", "urls": ["http://127.0.0.1:9"]}}, "servers run their own {what}"),
        ({"engine": {"kind": "sglang", "urls": ["http://127.0.0.1:9"]}}, "servers run their own {what}"),
        ({"engine": {"kind": "strop", "urls": ["http://127.0.0.1:9"]}}, "strop serve --{flag}"),
        ({"engine": {"fast_decode": False}}, "the model's own forward"),
        ({"rollout": {"exact_logprobs": True}}, "each row attending alone"),
    ],
)
def test_compiled_attention_and_step_are_refused_where_they_would_not_run(overrides, reason, option, what):
    engine = overrides.get("engine", {})
    with pytest.raises(ConfigError, match=f"engine.{option}=true: ") as err:
        build_config(overrides={**overrides, "engine": {option: True, **engine}})
    assert reason.format(what=what, flag=option.replace("_", "-")) in str(err.value)
    build_config(overrides=overrides)  # (each alone is a valid run)


@pytest.mark.parametrize("option", ["compile_attention", "compile_step"])
@pytest.mark.parametrize(
    "overrides",
    [
        {"engine": {"dtype": "bfloat16", "cpu_kernels": "onednn"}},
        {"engine": {"kind": "strop", "launch": 1, "speculative": 4}},
        {"rollout": {"mode": "async"}, "algo": {"use_rollout_logprobs": True}},
        {"engine": {"compile_attention": True, "compile_step": True}},
    ],
)
def test_compiled_attention_and_step_compose_with_bf16_kernels_launched_servers_speculation_and_async(
    overrides, option
):
    cfg = build_config(overrides={**overrides, "engine": {option: True, **overrides.get("engine", {})}})
    assert getattr(cfg.engine, option) is True and cfg.engine.kind in ("embedded", "strop")
