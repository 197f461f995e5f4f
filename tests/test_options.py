"""The list of options is frozen: a new, renamed or removed option, or a changed type or default, is a
reviewed change (torchtitan's test_no_new_cli_options.py).

Every option is a field of the config tree (strop/config.py and the sections beside their code,
``strop/<part>/config.py``) and a ``--section.key`` of ``strop train``. Each one adds to what users must
read, what a saved config holds and what a resumed run compares; so adding one is a decision, not a side
effect. When you mean to change the list, update OPTIONS below in the same change (the failure prints the
rows to paste) and say why in its description.
"""

import pytest
from pydantic import BaseModel

from strop.config import Config, parse_overrides
from strop.rollout.config import DEFAULT_TEMPLATE

# (dotted option, type, default), sorted by option
OPTIONS = [
    ("agent.concurrency", "int", 64),
    ("agent.cut_after_tool_calls", "bool", True),
    ("agent.describe_tools", "bool", True),
    ("agent.idle_timeout_s", "float", 60.0),
    ("agent.max_call_tokens", "int", 256),
    ("agent.max_calls", "int", 8),
    ("agent.max_calls_in_flight", "int", 256),
    ("agent.port", "int", 0),
    ("agent.retry_after_s", "float", 1.0),
    ("agent.reward", "Literal['session', 'hook']", "session"),
    ("agent.timeout_s", "float", 600.0),
    ("agent.workers", "Literal['threads', 'processes']", "threads"),
    ("algo.clip_high", "float", 0.2),
    ("algo.clip_low", "float", 0.2),
    ("algo.critic_lr", "float", 1e-05),
    ("algo.distill_coef", "float", 1.0),
    ("algo.distill_only", "bool", False),
    ("algo.distill_teacher", "str | None", None),
    ("algo.distill_teacher_kind", "Literal['strop', 'sglang', 'vllm']", "strop"),
    ("algo.distill_teacher_token", "pydantic.types.SecretStr | None", None),
    ("algo.distill_teacher_url", "str | None", None),
    ("algo.distill_temperature", "float | None", None),
    ("algo.dppo_kl_coef", "float", 0.001),
    ("algo.dppo_mask_high", "float", 0.2),
    ("algo.dppo_mask_low", "float", 0.2),
    ("algo.dual_clip", "float | None", None),
    ("algo.entropy_coef", "float", 0.0),
    ("algo.estimator", "Literal['grpo', 'dr_grpo', 'rloo', 'reinforce_pp', 'reinforce_pp_baseline', 'ppo']", "grpo"),
    ("algo.gamma", "float", 1.0),
    ("algo.kl_coef", "float", 0.0),
    ("algo.kl_importance_weighted", "bool", False),
    ("algo.kl_in_reward_coef", "float", 0.0),
    ("algo.kl_in_reward_kind", "Literal['k1', 'k2', 'k3']", "k1"),
    ("algo.kl_kind", "Literal['k1', 'k2', 'k3']", "k3"),
    ("algo.lam", "float", 0.95),
    ("algo.loss_agg", "Literal['token_mean', 'seq_mean_token_mean', 'seq_mean_token_sum_norm']", "token_mean"),
    ("algo.loss_agg_constant", "float | None", None),
    ("algo.mis_high", "float | None", None),
    ("algo.mis_level", "Literal['token', 'sequence']", "token"),
    ("algo.mis_low", "float | None", None),
    ("algo.normalize_std", "bool", True),
    ("algo.off_policy_correction", "Literal['auto', 'none', 'icepop', 'geo_mask']", "auto"),
    ("algo.opsm_delta", "float | None", None),
    ("algo.overlong_buffer", "int | None", None),
    ("algo.overlong_penalty", "float", 1.0),
    ("algo.policy_loss", "Literal['ppo_clip', 'gspo', 'cispo', 'dppo']", "ppo_clip"),
    ("algo.proximal", "Literal['recompute', 'loglinear']", "recompute"),
    ("algo.ref_mode", "Literal['copy', 'swap']", "copy"),
    ("algo.routing_replay", "bool", False),
    ("algo.tis_cap", "float | None", None),
    ("algo.use_rollout_logprobs", "bool", False),
    ("algo.value_clip", "float | None", 0.2),
    ("cluster.address", "str | None", None),
    ("cluster.connect_timeout_s", "float", 10.0),
    ("cluster.engine_resources", "dict[str, float]", {"CPU": 1.0}),
    ("cluster.engine_restarts", "int", 3),
    ("cluster.launcher", "Literal['local', 'ray']", "local"),
    ("cluster.placement", "Literal['colocated', 'disaggregated']", "disaggregated"),
    ("cluster.placement_timeout_s", "float", 60.0),
    ("cluster.stop_timeout_s", "float", 30.0),
    ("cluster.trainer_ranks", "int", 1),
    ("cluster.trainer_resources", "dict[str, float]", {"CPU": 1.0}),
    ("data.apply_chat_template", "bool", True),
    ("data.eval_min_size", "int", 32),
    ("data.eval_oversample", "int", 4),
    ("data.eval_path", "str | None", None),
    ("data.eval_seed", "int", 1000003),
    ("data.eval_size", "int", 128),
    ("data.label_key", "str", "label"),
    ("data.metadata_keys", "list[str]", []),
    ("data.path", "str | None", None),
    ("data.prompt_key", "str", "prompt"),
    ("data.prompt_template", "str", "{prompt}"),
    ("data.samples", "str | None", None),
    ("data.seed", "int", 1),
    ("data.shuffle", "bool", True),
    ("data.size", "int", 2000),
    ("data.source", "Literal['reasoning_gym', 'file']", "reasoning_gym"),
    ("data.system_prompt", "str | None", None),
    ("data.task", "str", "basic_arithmetic"),
    ("data.task_options", "dict[str, Any]", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    ("engine.affinity", "bool", False),
    ("engine.colocate", "bool", False),
    ("engine.compile_attention", "bool", False),
    ("engine.compile_step", "bool", False),
    ("engine.cpu_kernels", "Literal['auto', 'mkl', 'onednn', 'plain']", "auto"),
    ("engine.dtype", "Literal['auto', 'float32', 'bfloat16']", "auto"),
    ("engine.fast_decode", "bool", True),
    ("engine.health_interval_s", "float", 2.0),
    ("engine.kind", "Literal['embedded', 'strop', 'sglang', 'vllm']", "embedded"),
    ("engine.launch", "int", 0),
    ("engine.launch_args", "list[str]", []),
    ("engine.launch_command", "list[str]", []),
    ("engine.launch_env", "dict[str, str]", {}),
    ("engine.retries", "int", 2),
    ("engine.share_weights", "bool | None", None),
    ("engine.speculative", "int", 0),
    ("engine.sync", "Literal['auto', 'disk', 'delta', 'broadcast', 'adapter']", "auto"),
    ("engine.sync_backend", "Literal['auto', 'gloo', 'nccl']", "auto"),
    ("engine.sync_bucket_bytes", "int", 67108864),
    ("engine.sync_dir", "str | None", None),
    ("engine.sync_dtype", "Optional[Literal['float32', 'bfloat16', 'float16']]", None),
    ("engine.sync_pause", "Literal['abort', 'retract', 'in_place', 'wait', 'keep']", "abort"),
    ("engine.sync_probe", "bool", True),
    ("engine.sync_probe_tolerance", "float", 0.001),
    ("engine.timeout_s", "float", 600.0),
    ("engine.token", "pydantic.types.SecretStr | None", None),
    ("engine.urls", "list[str]", []),
    ("engine.verify_updates", "Literal['off', 'first', 'every']", "off"),
    ("env.max_turns", "int", 8),
    ("env.openenv", "str | None", None),
    ("env.verifiers", "str | None", None),
    ("env.verifiers_eval", "dict | None", None),
    ("eval.accuracy_threshold", "float", 1.0),
    ("eval.every", "int", 5),
    ("eval.max_new_tokens", "int | None", None),
    ("model.attn_implementation", "Optional[Literal['eager', 'sdpa', 'flash_attention_2']]", None),
    ("model.dtype", "Literal['float32', 'bfloat16']", "float32"),
    ("model.lora_alpha", "float", 32.0),
    ("model.lora_dropout", "float", 0.0),
    ("model.lora_init", "Literal['default', 'gaussian', 'pissa', 'olora']", "default"),
    ("model.lora_rank", "int", 0),
    (
        "model.lora_target_modules",
        "list[str]",
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    ("model.path", "str", "embedded:smollm2-135m-instruct"),
    ("model.revision", "str | None", None),
    ("model.trust_remote_code", "bool", False),
    ("parallel.context_parallel_size", "int", 1),
    ("parallel.controller_timeout_s", "float", 21600),
    ("parallel.dp_mode", "Literal['replicate', 'fsdp']", "replicate"),
    ("parallel.expert_parallel_size", "int", 1),
    ("parallel.fsdp_mixed_precision", "bool", False),
    ("parallel.grad_reduce_bucket_bytes", "int", 1073741824),
    ("parallel.sequence_parallel", "bool", True),
    ("parallel.tensor_parallel_size", "int", 1),
    ("plugins.advantage", "str | None", None),
    ("plugins.agent", "str | None", None),
    ("plugins.data_source", "str | None", None),
    ("plugins.filter", "str | None", None),
    ("plugins.generate", "str | None", None),
    ("plugins.policy_loss", "str | None", None),
    ("plugins.postprocess", "str | None", None),
    ("plugins.rollout", "str | None", None),
    ("plugins.tools", "str | None", None),
    ("reward.api_key", "pydantic.types.SecretStr | None", None),
    ("reward.backoff_s", "float", 0.5),
    ("reward.concurrency", "int", 8),
    ("reward.endpoint", "str | None", None),
    ("reward.max_score", "float", 1.0),
    ("reward.max_tokens", "int", 64),
    ("reward.min_score", "float", 0.0),
    ("reward.model", "str", "judge"),
    ("reward.parser", "Literal['verdict', 'number', 'yes_no']", "verdict"),
    ("reward.retries", "int", 3),
    ("reward.rule_reward", "float", 0.0),
    ("reward.template", "str", DEFAULT_TEMPLATE),
    ("reward.timeout_s", "float", 30.0),
    ("rollout.check_reward", "bool", True),
    ("rollout.dynamic_sampling", "bool", False),
    ("rollout.exact_logprobs", "bool", False),
    ("rollout.filter_max_rounds", "int", 3),
    ("rollout.max_batch_size", "int", 64),
    ("rollout.max_new_tokens", "int", 48),
    ("rollout.max_staleness", "int", 1),
    ("rollout.mode", "Literal['sync', 'one_step_off', 'async']", "sync"),
    ("rollout.n_samples_per_prompt", "int", 8),
    ("rollout.over_sample", "float", 1.0),
    ("rollout.partial", "Literal['finish', 'resume', 'keep']", "finish"),
    ("rollout.prompts_per_step", "int", 8),
    ("rollout.resumed_tokens", "Literal['correct', 'mask']", "correct"),
    ("rollout.reward", "str", "math"),
    ("rollout.sample_retries", "int", 1),
    ("rollout.seed", "int", 0),
    ("rollout.stale_groups", "Literal['wait', 'drop', 'regenerate']", "wait"),
    ("rollout.straggler_warning_seconds", "float", 60.0),
    ("rollout.temperature", "float", 0.8),
    ("rollout.top_k", "int", 0),
    ("rollout.top_p", "float", 1.0),
    ("run.checkpoint_policy", "bool", True),
    ("run.device", "Literal['auto', 'cpu', 'cuda']", "auto"),
    ("run.dir", "str | None", None),
    ("run.keep_checkpoints", "int", 1),
    ("run.log_samples", "int", 4),
    ("run.plot", "bool", True),
    ("run.progress", "bool", True),
    ("run.save_every", "int", 10),
    ("run.save_final", "bool", True),
    ("run.threads", "int | None", None),
    ("run.trackers", "list[Literal['tensorboard', 'wandb']]", []),
    ("run.wandb_mode", "Literal['online', 'offline']", "offline"),
    ("run.wandb_project", "str", "strop"),
    ("tools.call_reward", "float", 0.0),
    ("tools.concurrency", "int", 8),
    ("tools.cpu_s", "int", 10),
    ("tools.describe", "bool", True),
    ("tools.enabled", "list[Literal['python', 'calculator']]", []),
    ("tools.max_call_reward", "float", 0.0),
    ("tools.max_turn_tokens", "int", 256),
    ("tools.max_turns", "int", 4),
    ("tools.memory_mb", "int", 1024),
    ("tools.memory_total_mb", "int", 512),
    ("tools.nested_userns", "bool", False),
    ("tools.output_chars", "int", 2000),
    ("tools.output_tokens", "int", 256),
    ("tools.processes", "int", 64),
    ("tools.sandbox", "Literal['auto', 'bwrap', 'namespaces', 'none']", "auto"),
    ("tools.timeout_s", "float", 10.0),
    ("tools.tmp_files", "int", 4096),
    ("tools.tmp_mb", "int", 64),
    ("tools.tool_threads", "int", 8),
    ("train.activation_checkpointing", "bool", False),
    ("train.betas", "tuple[float, float]", (0.9, 0.99)),
    ("train.bf16_autocast", "bool", False),
    ("train.grad_clip", "float", 1.0),
    ("train.logprob_chunk_size", "int", 1024),
    ("train.lr", "float", 3e-05),
    ("train.lr_schedule", "Literal['constant', 'linear', 'cosine']", "constant"),
    ("train.max_nonfinite_grad_steps", "int", 3),
    ("train.max_tokens_per_micro_batch", "int | None", None),
    ("train.micro_batch_size", "int", 16),
    ("train.min_lr_ratio", "float", 0.0),
    ("train.mini_batches", "int", 1),
    ("train.seed", "int", 0),
    ("train.shared_prefix", "bool | None", None),
    ("train.steps", "int", 15),
    ("train.warmup_steps", "int", 2),
    ("train.weight_decay", "float", 0.0),
]


def _type_name(annotation) -> str:
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def options(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, object]]:
    """Every option of the config tree as (dotted name, type, default), sorted by name."""
    found = []
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            found += options(field.annotation, f"{prefix}{name}.")
        else:
            default = field.get_default(call_default_factory=True)
            found.append((f"{prefix}{name}", _type_name(field.annotation), default))
    return sorted(found)


def test_no_new_options():
    now = options()
    added = [row for row in now if row not in OPTIONS]
    gone = [row for row in OPTIONS if row not in now]
    assert not added and not gone, (
        "the config's options changed; a new, renamed or removed option, or a changed type or default, is a "
        "reviewed change: if you meant it, update OPTIONS in tests/test_options.py (and say why in the "
        "option's description).\n  now (add or replace in OPTIONS):\n"
        + "\n".join(f"    {r!r}," for r in added)
        + "\n  before (remove from OPTIONS):\n"
        + "\n".join(f"    {r!r}," for r in gone)
    )
    assert OPTIONS == sorted(OPTIONS), "keep OPTIONS sorted by option name"


def test_every_option_is_on_the_command_line(capsys):
    with pytest.raises(SystemExit):
        parse_overrides(["--help"])
    out = capsys.readouterr().out
    missing = [name for name, _, _ in OPTIONS if f"--{name} " not in out and f"--{name}\n" not in out]
    assert not missing, missing
