"""One typed config tree. Every field has a help text; ``strop train --help`` lists them.

Sources, later wins: the defaults here, a YAML file, ``--section.key=value``
overrides on the command line. Unknown keys and bad values fail before any
model loads, naming the full key (``train.lr``) and what was expected.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from strop.models import EMBEDDED_MODEL


class ConfigError(ValueError):
    """A config problem, already phrased for the user."""


REDACTED = "**********"  # a secret as written anywhere (pydantic's SecretStr mask)


def secret(env: str, description: str):
    """A secret field (a SecretStr): redacted wherever the config is written, printed or sent;
    unset, it comes from the environment variable ``env``."""
    return Field(None, validate_default=True, json_schema_extra={"env": env},
                 description=f"{description} (a secret: never written or logged; default: the environment "
                 f"variable {env})")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _secret_value(cls, value, info):
        """A secret field: unset, from its environment variable; the mask of a saved config is never
        the secret itself, so it must come from there too (a resumed run), or the config is refused."""
        env = (cls.model_fields[info.field_name].json_schema_extra or {}).get("env")
        if env is None:
            return value
        raw = value.get_secret_value() if isinstance(value, SecretStr) else value
        if raw is None or raw == "":
            return os.environ.get(env) or None
        if raw == REDACTED:
            if os.environ.get(env):
                return os.environ[env]
            raise ValueError(f"holds the redacted mask {REDACTED!r} (a saved config never holds the secret): "
                             f"set the environment variable {env}")
        return value


class ModelConfig(_Section):
    path: str = Field(
        EMBEDDED_MODEL,
        description=f"the policy: {EMBEDDED_MODEL!r} (packaged SmolLM2-135M-Instruct), "
        "a local Hugging Face model folder, or a hub id (needs network)",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="parameter dtype for engine and trainer (fp32 is faster on most CPUs)"
    )


class DataConfig(_Section):
    source: Literal["reasoning_gym", "file"] = Field(
        "reasoning_gym", description="where prompts come from: a reasoning-gym task or a JSONL/Parquet file"
    )
    task: str = Field("basic_arithmetic", description="reasoning-gym task name (source=reasoning_gym)")
    samples: str | None = Field(None, description="train only: scored samples written by `strop rollout` "
                                "(no engine, no prompts, no evaluation; step k trains on the file's step k)")
    task_options: dict[str, Any] = Field(
        default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        description="options passed to the reasoning-gym task config, as JSON",
    )
    seed: int = Field(1, description="seed of the training prompts (reasoning-gym)")
    size: int = Field(2000, gt=0, description="number of training prompts to generate (reasoning-gym)")
    eval_seed: int = Field(
        1_000_003, description="seed of the held-out prompts; must differ from data.seed (reasoning-gym)"
    )
    eval_size: int = Field(128, ge=0, description="number of held-out evaluation prompts (0 = no eval); prompts "
                           "that occur in the training data are removed first")
    eval_min_size: int = Field(
        32, ge=1, description="refuse to run when fewer held-out prompts than this remain after removing those "
        "that occur in the training data")
    eval_oversample: int = Field(
        4, ge=1, description="reasoning-gym: generate eval_size x this many eval candidates, so eval_size remain "
        "after duplicates of training prompts are removed")
    path: str | None = Field(None, description="training prompts, .jsonl or .parquet (source=file)")
    eval_path: str | None = Field(None, description="held-out prompts, .jsonl or .parquet (source=file)")
    prompt_key: str = Field("prompt", description="column holding the prompt (text or chat messages)")
    label_key: str = Field("label", description="column holding the reference answer")
    metadata_keys: list[str] = Field(
        default_factory=list, description="columns copied into Sample.metadata"
    )
    prompt_template: str = Field(
        "{prompt}", description="text prompts are formatted through this; {prompt} is the question"
    )
    system_prompt: str | None = Field(None, description="system message put before text prompts")
    apply_chat_template: bool = Field(True, description="apply the tokenizer's chat template")
    shuffle: bool = Field(True, description="shuffle training prompts every epoch")

    @model_validator(mode="after")
    def _check_source(self):
        if self.source == "file" and not self.path:
            raise ValueError("data.source='file' needs data.path (a .jsonl or .parquet file)")
        if self.source == "reasoning_gym" and self.eval_size and self.eval_seed == self.seed:
            raise ValueError("data.eval_seed must differ from data.seed so the eval set is held out")
        if "{prompt}" not in self.prompt_template:
            raise ValueError("data.prompt_template must contain '{prompt}'")
        return self


class RolloutConfig(_Section):
    prompts_per_step: int = Field(8, gt=0, description="prompts drawn per RL step")
    n_samples_per_prompt: int = Field(8, gt=0, description="responses sampled per prompt (group size)")
    temperature: float = Field(0.8, ge=0, description="sampling temperature (also applied to training logits)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    top_k: int = Field(0, ge=0, description="top-k sampling (0 = off)")
    max_new_tokens: int = Field(48, gt=0, description="response length limit")
    max_batch_size: int = Field(64, gt=0, description="embedded engine: most sequences decoded together")
    reward: str = Field(
        "math",
        description="reward function: 'math' (math-verify), 'exact_match', 'reasoning_gym', "
        "or an import path 'pkg.module:function'",
    )
    seed: int = Field(0, description="sampling seed")
    filter_max_rounds: int = Field(
        3, gt=0, description="with plugins.filter or dynamic_sampling: most rollout rounds per step to refill "
        "dropped groups")
    mode: Literal["sync", "one_step_off", "async"] = Field(
        "sync", description="'sync': generate a step's groups, then train; 'one_step_off': generate step k+1's "
        "groups while step k trains; 'async': generate continuously, each step takes the groups that finished "
        "first (docs/rollout.md)")
    max_staleness: int = Field(1, ge=0, description="async: a token sampled more than this many weight versions "
                               "before the trainer's current weights is never trained on")
    stale_groups: Literal["drop", "regenerate"] = Field(
        "drop", description="async: a group with a too-stale token is dropped, or regenerated from its prompts")
    partial: Literal["finish", "resume"] = Field(
        "finish", description="one_step_off / async, at a weight update: unfinished samples finish on the old "
        "weights, or are aborted and resumed on the new ones from the tokens they have")
    resumed_tokens: Literal["correct", "mask"] = Field(
        "correct", description="partial=resume: tokens sampled before the update are trained with the importance "
        "correction against their own logprobs (needs algo.use_rollout_logprobs, tis_cap or mis_*), or masked")
    exact_logprobs: bool = Field(
        False, description="report as the rollout's logprobs the trainer's own forward on the sampling weights "
        "(bitwise what the trainer computes: train_rollout_logprob_abs_diff is 0); costs one no-grad forward "
        "when no pre-pass runs anyway; sync mode only (docs/rollout.md)")
    over_sample: float = Field(1.0, ge=1.0, description="draw this many times the groups a step still needs; "
                               "once the step is full the rest are aborted")
    dynamic_sampling: bool = Field(False, description="drop groups whose rewards are all equal (no learning "
                                   "signal under group baselines) and top up, at most filter_max_rounds rounds")


class AlgoConfig(_Section):
    estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo"] = Field(
        "grpo", description="advantage estimator (docs/algorithms.md); 'ppo' trains a critic with GAE")
    normalize_std: bool = Field(True, description="grpo: divide group-centred rewards by the group std")
    policy_loss: Literal["ppo_clip", "gspo", "cispo", "dppo"] = Field(
        "ppo_clip", description="policy loss (docs/algorithms.md); 'dppo' bounds each token's probability change "
        "against the rollout's (algo.dppo_*), prime-rl's default")
    clip_low: float = Field(0.2, ge=0, description="clip: lower epsilon (ratio >= 1 - clip_low)")
    clip_high: float = Field(0.2, ge=0, description="clip: upper epsilon (ratio <= 1 + clip_high)")
    dual_clip: float | None = Field(None, gt=1, description="ppo_clip: cap the loss of A<0 tokens at -A*dual_clip")
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean", description="how per-token losses reduce to the step loss (docs/algorithms.md)")
    loss_agg_constant: float | None = Field(
        None, gt=0, description="seq_mean_token_sum_norm: the constant normaliser (default rollout.max_new_tokens)")
    kl_coef: float = Field(0.0, ge=0, description="weight of the KL-to-reference loss term (0 = off)")
    kl_kind: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator of the loss term")
    kl_importance_weighted: bool = Field(
        False, description="weight the KL loss by pi/pi_old (unbiased when samples come from pi_old)")
    kl_in_reward_coef: float = Field(0.0, ge=0, description="KL penalty folded into token rewards (reinforce_pp, ppo)")
    kl_in_reward_kind: Literal["k1", "k2", "k3"] = Field("k1", description="KL estimator of the reward penalty")
    ref_mode: Literal["copy", "swap"] = Field(
        "copy", description="reference policy: a frozen copy, or its weights swapped into the training model")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus weight (0 = off)")
    gamma: float = Field(1.0, ge=0, le=1, description="discount (reinforce_pp, ppo)")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda (ppo)")
    critic_lr: float = Field(1e-5, gt=0, description="ppo: critic learning rate")
    value_clip: float | None = Field(0.2, gt=0, description="ppo: value-loss clip range (null = unclipped)")
    use_rollout_logprobs: bool = Field(False, description="the engine's logprobs serve as the old policy")
    tis_cap: float | None = Field(None, gt=0, description="truncated importance sampling: cap C of pi_old/pi_rollout")
    mis_low: float | None = Field(None, ge=0, description="masked importance sampling: drop ratio < mis_low")
    mis_high: float | None = Field(None, gt=0, description="masked importance sampling: drop ratio > mis_high")
    mis_level: Literal["token", "sequence"] = Field("token", description="masked importance sampling per token or sequence")
    off_policy_correction: Literal["auto", "none", "icepop", "geo_mask"] = Field(
        "auto", description="tokens sampled by another policy (async rollout, the engine's numbers): 'icepop' (token "
        "ratio pi_old/pi_rollout kept and weighted inside [0.5, 5], AReaL's bounds; algo.mis_low / mis_high change "
        "them), 'geo_mask' (a sequence whose geometric-mean ratio leaves [0.99, 1.01] is masked, SkyRL's band); "
        "either sets the level itself (algo.mis_level is not read), "
        "'auto' (the fields tis_cap, mis_*, opsm_delta, use_rollout_logprobs, policy_loss='dppo' decide), 'none' (no "
        "correction at all: rollout.mode async / one_step_off refuse an uncorrected run unless it says so)")
    proximal: Literal["recompute", "loglinear"] = Field(
        "recompute", description="pi_old, the PPO ratio's denominator (AReaL's proximal policy): 'recompute' = the "
        "trainer's weights at the start of the step (a no-grad forward when train.mini_batches > 1, free otherwise); "
        "'loglinear' = AReaL's log-linear interpolation between the weights that sampled each token and the step's "
        "update, from the tokens' versions, with no forward. 'recompute' with algo.tis_cap / mis_* / icepop as the "
        "behaviour weight pi_old/pi_rollout is decoupled PPO; 'loglinear' refuses them (its pi_old is pi_rollout "
        "for a token one version old, so the weight is 1 there)")
    opsm_delta: float | None = Field(
        None, ge=0, description="off-policy sequence masking (DeepSeek-V3.2; slime's --opsm-delta, 1e-4 there): a "
        "sequence with negative advantage whose mean token log pi_rollout - log pi exceeds this is masked")
    dppo_mask_low: float = Field(0.2, gt=0, description="dppo: a token with A <= 0 is masked when its probability "
                                 "fell by more than this since the rollout")
    dppo_mask_high: float = Field(0.2, gt=0, description="dppo: a token with A > 0 is masked when its probability "
                                  "rose by more than this since the rollout")
    dppo_kl_coef: float = Field(1e-3, ge=0, description="dppo: weight of (log pi - log pi_rollout)^2 on every token")
    distill_teacher: str | None = Field(
        None, description="on-policy distillation: a teacher model (path or hub id; same tokenizer as the student) "
        "scores the student's sampled tokens; -algo.distill_coef x (log pi_student - log pi_teacher) per token is "
        "added to the advantages (the teacher is frozen, loaded into the trainer and split like the policy)")
    distill_teacher_url: str | None = Field(
        None, description="on-policy distillation from a teacher served elsewhere (instead of distill_teacher): its "
        "server scores the student's tokens (input-token logprobs, at temperature 1); kind: distill_teacher_kind")
    distill_teacher_kind: Literal["strop", "sglang", "vllm"] = Field(
        "strop", description="the distill_teacher_url server: strop serve, SGLang (both: /generate with "
        "input_token_logprobs) or vLLM (/v1/completions with prompt_logprobs)")
    distill_teacher_token: SecretStr | None = secret(
        "STROP_TEACHER_TOKEN", "bearer token sent to the distill_teacher_url server (strop serve --token, vLLM "
        "--api-key, SGLang --api-key; engine.token is never sent there)")
    distill_coef: float = Field(1.0, gt=0, description="on-policy distillation: weight of the reverse-KL advantage")
    distill_only: bool = Field(False, description="on-policy distillation alone: the task's advantages are dropped "
                               "(its reward is still computed and logged)")
    distill_temperature: float | None = Field(
        None, gt=0, description="the temperature the teacher's logits are scored at (default: rollout.temperature, "
        "the one the student sampled at and is scored at; slime's SGLang teacher scores at 1.0)")
    overlong_buffer: int | None = Field(
        None, gt=0, description="DAPO's overlong reward shaping: over the last this many tokens before "
        "rollout.max_new_tokens the reward falls linearly to -algo.overlong_penalty (by generated length)")
    overlong_penalty: float = Field(1.0, ge=0, description="DAPO overlong shaping: the penalty at the length limit")

    @model_validator(mode="after")
    def _check_algo(self):
        if self.mis_low is not None and self.mis_high is not None and self.mis_low >= self.mis_high:
            raise ValueError("algo.mis_low must be below algo.mis_high")
        if self.dual_clip is not None and self.policy_loss != "ppo_clip":
            raise ValueError("algo.dual_clip applies to policy_loss='ppo_clip' only")
        if self.kl_in_reward_coef and self.estimator not in ("reinforce_pp", "reinforce_pp_baseline", "ppo"):
            raise ValueError("algo.kl_in_reward_coef needs a token-level estimator (reinforce_pp*, ppo); "
                             "use algo.kl_coef for a KL loss term with grpo/dr_grpo/rloo")
        if self.use_rollout_logprobs and (self.tis_cap is not None or self.mis_low is not None
                                          or self.mis_high is not None):
            raise ValueError("algo.tis_cap / algo.mis_low / algo.mis_high correct pi_old against the engine's "
                             "logprobs; with algo.use_rollout_logprobs=true pi_old IS the engine's logprobs, so the "
                             "weight is always 1 and the correction does nothing: turn one of them off")
        # (values only, never "was it set": a saved config.yaml sets every field, and a resume must read it back)
        if self.off_policy_correction == "icepop" and self.tis_cap is not None:
            raise ValueError("algo.off_policy_correction='icepop' weighs each kept token by its own ratio between "
                             "algo.mis_low and mis_high (0.5 and 5 unless set): leave algo.tis_cap unset")
        if self.off_policy_correction in ("icepop", "geo_mask") and self.use_rollout_logprobs:
            raise ValueError(f"algo.off_policy_correction={self.off_policy_correction!r} compares pi_old with the "
                             "engine's logprobs; with algo.use_rollout_logprobs=true they are the same numbers and "
                             "nothing would ever be masked: turn one of them off")
        if (self.distill_only or self.distill_temperature is not None) and not (
                self.distill_teacher or self.distill_teacher_url):
            raise ValueError("algo.distill_only / distill_temperature need a teacher: set algo.distill_teacher (a "
                             "model) or algo.distill_teacher_url (a server)")
        if self.distill_teacher and self.distill_teacher_url:
            raise ValueError("algo.distill_teacher (a model loaded here) and algo.distill_teacher_url (a server) name "
                             "two teachers: keep one")
        if self.distill_teacher_url and self.distill_temperature not in (None, 1.0):
            raise ValueError(f"algo.distill_teacher_url: a server scores input tokens at temperature 1 (its API takes "
                             f"none), so algo.distill_temperature={self.distill_temperature} cannot be honoured; load "
                             "the teacher here (algo.distill_teacher) or set 1.0")
        if self.proximal == "loglinear" and self.use_rollout_logprobs:
            raise ValueError("algo.proximal='loglinear' interpolates pi_old between the engine's logprobs and the "
                             "current policy; algo.use_rollout_logprobs=true makes pi_old the engine's logprobs: "
                             "choose one")
        # the corrections that weigh or mask by pi_old / pi_rollout (OPSM and DPPO compare pi itself with it)
        behaviour = [x for x in self.corrections() if x.startswith(("algo.tis_cap", "algo.mis_", "algo.off_policy"))]
        if self.proximal == "loglinear" and behaviour:
            raise ValueError(f"algo.proximal='loglinear' sets pi_old = pi_rollout for every token one version old "
                             f"(every token in sync mode), so the weight pi_old/pi_rollout that {', '.join(behaviour)} "
                             "corrects by is 1 there and the correction never acts: use algo.proximal='recompute' "
                             "(pi_old from the trainer's own weights), or drop the correction")
        if self.off_policy_correction == "none" and self.corrections():
            raise ValueError("algo.off_policy_correction='none' says no correction, but "
                             f"{', '.join(self.corrections())} is set: drop one")
        if self.policy_loss == "cispo" and self.clip_low > 1:
            raise ValueError("algo.clip_low above 1 would allow negative CISPO weights")
        return self

    def corrections(self) -> list[str]:
        """The off-policy corrections this section turns on, as the settings that name them."""
        on = [f"algo.off_policy_correction={self.off_policy_correction!r}"
              if self.off_policy_correction in ("icepop", "geo_mask") else ""]
        on += [f"algo.{k}={getattr(self, k)}" for k in ("tis_cap", "mis_low", "mis_high", "opsm_delta")
               if getattr(self, k) is not None]
        on += ["algo.use_rollout_logprobs=true" if self.use_rollout_logprobs else "",
               "algo.policy_loss='dppo'" if self.policy_loss == "dppo" else ""]
        return [x for x in on if x]


OFF_POLICY_CORRECTIONS = (
    "algo.off_policy_correction='icepop' (token ratios outside [0.5, 5] masked, the rest weighted by their ratio)",
    "algo.off_policy_correction='geo_mask' (sequences whose geometric-mean ratio leaves [0.99, 1.01] masked)",
    "algo.tis_cap=C (truncated importance sampling)",
    "algo.mis_low / algo.mis_high (masked importance sampling, per token or sequence: algo.mis_level)",
    "algo.opsm_delta=D (off-policy sequence masking)",
    "algo.policy_loss='dppo' (the probability-change trust region against the rollout)",
    "algo.use_rollout_logprobs=true (the PPO ratio and its clip against the policy that sampled)",
    "algo.off_policy_correction='none' (train stale tokens as they are)",
)


class TrainConfig(_Section):
    steps: int = Field(15, gt=0, description="RL steps (rollout + one optimizer step each)")
    lr: float = Field(3e-5, gt=0, description="AdamW learning rate")
    warmup_steps: int = Field(2, ge=0, description="linear learning-rate warm-up steps")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas")
    grad_clip: float = Field(1.0, gt=0, description="clip the global gradient norm to this")
    micro_batch_size: int = Field(16, gt=0, description="samples per forward/backward (gradient accumulation)")
    mini_batches: int = Field(1, gt=0, description="optimizer steps per rollout batch (PPO-style reuse)")
    max_tokens_per_micro_batch: int | None = Field(
        None, gt=0, description="pack samples into micro-batches of at most this many tokens, with no padding "
        "(replaces micro_batch_size)")
    logprob_chunk_size: int = Field(
        1024, ge=0, description="tokens per lm_head chunk when computing logprobs (0 = full logits, more memory)")
    seed: int = Field(0, description="torch seed")
    bf16_autocast: bool = Field(
        False, description="run the trainer's forward passes under bf16 autocast (fp32 master weights and "
        "optimizer state): on GPUs, and on CPUs with bf16 matmul (avx512_bf16, AMX; 2.2x the quickstart's train "
        "step here), slow on CPUs without it")
    max_nonfinite_grad_steps: int = Field(
        3, gt=0, description="stop the run after this many optimizer steps in a row with a NaN/inf gradient "
        "norm (each such step is skipped and counted in nonfinite_grad_norm_steps)")
    activation_checkpointing: bool = Field(
        False, description="recompute each decoder layer's activations in backward instead of keeping them "
        "(transformers' gradient checkpointing, non-reentrant): activation memory drops to the layers' inputs "
        "plus one layer's, for about one more forward pass per step; policy and critic; not with context parallel")


class EvalConfig(_Section):
    every: int = Field(5, ge=0, description="evaluate every this many steps (0 = only first and last)")
    max_new_tokens: int | None = Field(None, description="eval response limit (default: rollout.max_new_tokens)")


class RunConfig(_Section):
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where policy, reference, critic, optimizer state, batches and the embedded engine "
        "live: 'auto' = cuda when available, else cpu; each process binds cuda:<local rank>")
    dir: str | None = Field(None, description="run directory (default: runs/<timestamp>)")
    save_final: bool = Field(True, description="save the final policy in Hugging Face format")
    plot: bool = Field(True, description="write a PNG plot of reward and eval accuracy")
    progress: bool = Field(True, description="show a progress bar")
    threads: int | None = Field(None, description="torch CPU threads (default: torch's choice)")
    save_every: int = Field(10, ge=0, description="save a checkpoint every this many steps and at the end, into "
                            "<run dir>/checkpoints (0 = never; `strop train --resume RUN_DIR` continues from the newest)")
    keep_checkpoints: int = Field(1, ge=1, description="keep this many newest checkpoints, remove older ones (an "
                                  "older one is removed only once the new one is complete)")
    checkpoint_policy: bool = Field(True, description="also write the policy in Hugging Face format into each "
                                    "checkpoint (policy/, which from_pretrained loads); false stores the weights once, "
                                    "in the trainer state, and `strop export CHECKPOINT OUT` writes that folder later")
    log_samples: int = Field(4, ge=0, description="per step, write this many prompts with one response each to "
                             "<run dir>/samples.jsonl (and the trackers)")
    trackers: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list, description="also send every metric to these (optional extras: pip install "
        "'strop[tensorboard]' / 'strop[wandb]'); TensorBoard writes <run dir>/tensorboard")
    wandb_project: str = Field("strop", description="Weights & Biases project")
    wandb_mode: Literal["online", "offline"] = Field(
        "offline", description="Weights & Biases mode: 'offline' writes <run dir>/wandb (upload later with "
        "`wandb sync`), 'online' streams to the server")


class EngineConfig(_Section):
    kind: Literal["embedded", "strop", "sglang", "vllm"] = Field(
        "embedded", description="where rollouts are generated: 'embedded' (in this process), 'strop' (strop serve "
        "servers), 'sglang' (SGLang servers; same native API) or 'vllm' (vLLM OpenAI servers started with "
        "--logprobs-mode processed_logprobs, and VLLM_SERVER_DEV_MODE=1 for weight reloads)")
    urls: list[str] = Field(default_factory=list, description="server URLs (kind strop / sglang / vllm), e.g. "
                            "[\"http://127.0.0.1:30000\"]; several go behind strop's router")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="the embedded engine's weights: 'auto' = model.dtype; 'bfloat16' decodes in bf16 while "
        "the trainer keeps model.dtype (fp32 weights and AdamW state), each update cast on the way in: on CPUs with "
        "bf16 matmul (avx512_bf16, AMX) the rollout is about 2.3x faster here; the logprob gap between engine and "
        "trainer grows to bf16's rounding and is reported every step (train_rollout_logprob_abs_diff). Remote "
        "servers choose their own dtype (engine.launch_args, engine.sync_dtype)")
    launch: int = Field(0, ge=0, description="start this many servers for the run (and stop them at the end) "
                        "instead of urls: kind=strop: strop serve processes (here, or Ray engine actors with "
                        "cluster.launcher=ray); kind=vllm / sglang: vLLM or SGLang servers, as Ray engine actors only")
    launch_args: list[str] = Field(default_factory=list, description="extra arguments for launched servers, e.g. "
                                   "[\"--threads=1\"] (strop serve) or [\"--dtype\", \"bfloat16\"] (vLLM)")
    launch_command: list[str] = Field(default_factory=list, description="kind=vllm / sglang: the program that "
                                      "starts one server (default: this Python's -m vllm.entrypoints.openai.api_server"
                                      " / -m sglang.launch_server), e.g. [\"/opt/vllm/bin/python\", \"-m\", "
                                      "\"vllm.entrypoints.openai.api_server\"]; strop adds the model, host, port and "
                                      "what its client needs")
    launch_env: dict[str, str] = Field(default_factory=dict, description="environment variables for launched "
                                       "servers, e.g. {VLLM_CPU_KVCACHE_SPACE: \"2\"}")
    fast_decode: bool = Field(True, description="embedded engine and strop serve: decode Llama-family models with "
                              "strop's KV-cache decoder (shared prompt prefixes, continuous batching); false uses "
                              "transformers' forward with static batches")
    share_weights: bool | None = Field(
        None, description="embedded engine, rollout.mode=sync, one process: decode from the trainer's own parameters "
        "instead of a copy of them (as TRL's generate does): one copy of the weights less in memory and no copy at "
        "an update. Unset: whenever that holds (and the fast decoder runs, engine.dtype is the model's); true where "
        "it cannot is refused naming why; false keeps the engine's own copy")
    token: SecretStr | None = secret("STROP_ENGINE_TOKEN", "bearer token sent to the remote servers (strop serve "
                                     "--token); launched servers require it, or a fresh one per run when unset")
    timeout_s: float = Field(600.0, gt=0, description="seconds one HTTP request may take")
    retries: int = Field(2, ge=0, description="retries of one request on the same server (with backoff) before "
                         "the router re-issues it to another")
    health_interval_s: float = Field(2.0, gt=0, description="how often the router probes its engines: down ones "
                                     "for re-admission, healthy ones for the weight version they report (a restart)")
    affinity: bool = Field(False, description="keep the requests of one sample on one engine (multi-turn)")
    sync_dir: str | None = Field(None, description="where weights are written for remote engines to load "
                                 "(default: <run dir>/weights; must be readable by the servers)")
    sync: Literal["auto", "disk", "delta", "broadcast"] = Field(
        "auto", description="how new weights reach remote engines: 'broadcast' (a process group of the trainer's "
        "rank 0 and the servers, through SGLang's update_weights_from_distributed; vLLM through strop's worker "
        "extension), 'disk' (safetensors written atomically and reloaded), 'delta' (through disk, only the tensors "
        "that changed, each checked by its digest; kind strop). 'auto': broadcast where the engine takes it, disk "
        "otherwise; the run prints which and why")
    sync_bucket_bytes: int = Field(64 << 20, ge=1 << 20, description="largest bucket of a weight update, in bytes: "
                                   "broadcast: a flat bucket (the extra memory on either side); disk and delta: "
                                   "what is read (under FSDP or tensor parallel: gathered) per write. A single "
                                   "larger tensor travels alone")
    sync_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="broadcast: process-group backend (auto: nccl when the trainer is on cuda, else gloo)")
    sync_pause: Literal["abort", "retract", "in_place", "wait", "keep"] = Field(
        "abort", description="broadcast: how each server pauses generation during an update (SGLang and strop "
        "serve: abort, retract, in_place; vLLM: abort, wait, keep). strop's own requests are drained first "
        "(rollout.partial), so this concerns other clients' requests")
    sync_probe: bool = Field(True, description="after every weight update, score a fixed short token sequence on "
                             "each engine and with the trainer's weights: a difference over sync_probe_tolerance "
                             "fails the step naming the engine (every engine kind; off under dp_mode=fsdp)")
    sync_probe_tolerance: float = Field(1e-3, gt=0, description="largest logprob difference the probe accepts "
                                        "(fp32 engines agree within ~1e-5; bfloat16 engines need ~0.05)")
    colocate: bool = Field(False, description="run the engines on the trainer's GPU and update them in place "
                           "(CUDA IPC, memory released while training); refused for now, see docs/serving.md")
    sync_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="broadcast: cast the weights to this dtype on the trainer's side (the engine's dtype "
        "when it differs from the trainer's, e.g. bfloat16 servers of an fp32 trainer)")

    @model_validator(mode="after")
    def _check_engine(self):
        if self.kind == "embedded" and (self.urls or self.launch):
            raise ValueError("engine.urls / engine.launch need engine.kind='strop', 'sglang' or 'vllm'")
        if self.kind != "embedded" and not self.urls and not self.launch:
            raise ValueError(f"engine.kind={self.kind!r} needs engine.urls or engine.launch=N")
        if self.launch_command and self.kind not in ("vllm", "sglang"):
            raise ValueError("engine.launch_command is the program of launched vLLM or SGLang servers (engine.kind="
                             "'vllm' or 'sglang'); strop serve is started as this Python's `strop serve`")
        if self.launch and self.urls:
            raise ValueError("give engine.urls or engine.launch, not both")
        if self.sync == "delta" and self.kind != "strop":
            raise ValueError(f"engine.sync='delta' needs strop serve servers (engine.kind='strop'): it loads a file of "
                             f"only the changed tensors, which {self.kind} cannot check tensor by tensor; use "
                             "engine.sync='broadcast' or 'disk'")
        if self.colocate:
            raise ValueError("engine.colocate: the in-place update of an engine sharing the trainer's GPU (SGLang's "
                             "update_weights_from_tensor over CUDA IPC with release/resume_memory_occupation, vLLM's "
                             "IPC transfer with sleep/wake_up) needs a GPU, and strop has not run it on one yet: it is "
                             "refused rather than shipped untested. On CPU it cannot exist (no CUDA IPC; vLLM refuses "
                             "sleep mode). Use engine.sync='broadcast' with the engines on their own devices")
        pauses = {"vllm": ("abort", "wait", "keep")}.get(self.kind, ("abort", "retract", "in_place"))
        if self.sync_pause not in pauses:
            raise ValueError(f"engine.sync_pause={self.sync_pause!r} is not a pause mode of {self.kind} servers: "
                             f"use one of {', '.join(pauses)}")
        return self


class PluginsConfig(_Section):
    rollout: str | None = Field(None, description="rollout hook 'pkg.module:fn' (a whole step's rollout; async)")
    generate: str | None = Field(None, description="generate hook (one sample, possibly multi-turn; async)")
    filter: str | None = Field(None, description="dynamic sampling filter: keep or drop a scored group")
    postprocess: str | None = Field(None, description="rollout-data postprocess, just before training")
    advantage: str | None = Field(None, description="advantage estimator hook (replaces algo.estimator)")
    policy_loss: str | None = Field(None, description="policy loss hook (replaces algo.policy_loss)")
    data_source: str | None = Field(None, description="data source hook (replaces data.source)")
    tools: str | None = Field(None, description="tools hook: your own tools for multi-turn rollouts, next to "
                              "tools.enabled (docs/tools.md)")
    agent: str | None = Field(None, description="agent hook 'pkg.module:run': your agent program, called per sample "
                              "with the proxy's base_url, a session api_key and the prompt row; it talks to the run's "
                              "engines through the OpenAI-compatible agent proxy (docs/agents.md)")


class ParallelConfig(_Section):
    dp_mode: Literal["replicate", "fsdp"] = Field(
        "replicate", description="data parallel: every rank holds the whole model (replicate; best for small "
        "models) or FSDP2 shards parameters, gradients and optimizer state")
    fsdp_mixed_precision: bool = Field(False, description="fsdp: bf16 parameters in compute, fp32 gradient reduction")
    context_parallel_size: int = Field(
        1, ge=1, description="context parallel: ranks that split every sequence's tokens (zigzag chunks, keys and "
        "values all-gathered); the processes form a (data parallel x context parallel) mesh, so --nproc must be a "
        "multiple of it")
    tensor_parallel_size: int = Field(
        1, ge=1, description="tensor parallel: ranks that split every decoder layer (q/k/v/gate/up by output, "
        "o/down by input, embedding and output projection by vocabulary; DTensor) for Llama, Mistral, Qwen2 and "
        "Qwen3; the processes form a (data parallel x tensor parallel) mesh with neighbouring ranks in one tensor-"
        "parallel group, so --nproc must be a multiple of it; it must divide the heads, KV heads and MLP width")
    sequence_parallel: bool = Field(
        True, description="with tensor_parallel_size > 1: the residual stream and the norms split over the tensor-"
        "parallel ranks by tokens between the blocks (Megatron's sequence parallel: tokens all-gathered before "
        "attention and the MLP, reduce-scattered after them), so each rank holds 1/N of those activations; off: "
        "every rank holds them whole (one all-reduce after o and down instead)")
    controller_timeout_s: float = Field(
        6 * 3600, gt=0, description="how long ranks other than 0 wait for rank 0 (rollout, evaluation, set-up) "
        "before giving up; their own collectives keep torch's default timeout")
    grad_reduce_bucket_bytes: int = Field(
        1 << 30, description="largest flat buffer of the chunked gradient all-reduce, in bytes (>= 1 MiB; "
        "the environment variable STROP_GRAD_REDUCE_BUCKET_BYTES overrides it)")


class ClusterConfig(_Section):
    launcher: Literal["local", "ray"] = Field(
        "local", description="where the processes run: 'local' (this machine: one process, or --nproc N ranks; "
        "torchrun's ranks are taken as they come) or 'ray' (trainer ranks and engines as Ray actors placed across "
        "the cluster's nodes; pip install 'strop[ray]'; docs/scale-out.md)")
    address: str | None = Field(
        None, description="ray: the cluster to join: 'auto' (the one started on this host with `ray start`), "
        "'host:port' (its head's GCS address), or unset: a local cluster started for this run and stopped with it")
    placement: Literal["colocated", "disaggregated"] = Field(
        "disaggregated", description="ray: 'disaggregated' gives every engine bundles of its own (on nodes without "
        "trainer ranks where there is room); 'colocated' puts engine i in trainer rank i's bundle")
    trainer_ranks: int = Field(1, ge=1, description="ray: trainer actors (the data x context parallel world size)")
    trainer_resources: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 1.0}, description="ray: what one trainer rank reserves, e.g. "
        "{CPU: 4, GPU: 1}, or fractions when colocated ({GPU: 0.4}); other keys are custom Ray resources")
    engine_resources: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 1.0}, description="ray: what one engine (engine.launch=N of them) reserves, "
        "e.g. {GPU: 1} or {GPU: 0.2} colocated")
    placement_timeout_s: float = Field(60.0, gt=0, description="ray: how long the plan may wait for its resources "
                                       "before the run fails naming the one that is missing")
    connect_timeout_s: float = Field(10.0, gt=0, description="ray: how long reaching cluster.address may take")
    stop_timeout_s: float = Field(30.0, gt=0, description="ray: after a trainer rank dies, how long the others "
                                  "get to stop on their own before they are killed")
    engine_restarts: int = Field(3, ge=0, description="ray: how often Ray restarts an engine actor that died (the "
                                 "router re-admits it once it holds the current weights)")

    @field_validator("trainer_resources", "engine_resources")
    @classmethod
    def _check_resources(cls, value: dict[str, float]):
        bad = {k: v for k, v in value.items() if not v >= 0}
        if bad:
            raise ValueError(f"resource amounts must be >= 0, got {bad}")
        if value.get("GPU", 0) > 1 and value["GPU"] != int(value["GPU"]):
            raise ValueError(f"GPU={value['GPU']}: more than one GPU must be a whole number")
        return value


class ToolsConfig(_Section):
    enabled: list[Literal["python", "calculator"]] = Field(
        default_factory=list, description="built-in tools the model may call; any tool makes generation multi-turn "
        "(strop.rollout.multiturn)")
    max_turns: int = Field(4, ge=1, description="model turns per sample, the final answer included")
    max_turn_tokens: int = Field(256, gt=0, description="new tokens per turn (capped by what is left of "
                                 "rollout.max_new_tokens)")
    output_chars: int = Field(2000, gt=0, description="tool output kept, in characters (a marker says what was cut)")
    output_tokens: int = Field(256, gt=0, description="tool output kept, in tokens (a marker says so)")
    sandbox: Literal["auto", "bwrap", "namespaces", "none"] = Field(
        "auto", description="isolation of the python tool: 'auto' (bubblewrap, else unshare namespaces, else "
        "refuse), one by name, or 'none' to run model code WITHOUT isolation (explicit opt-out)")
    timeout_s: float = Field(10.0, gt=0, description="wall-clock limit per tool call (the python tool's sandbox "
                             "kills the code; any other tool's result is no longer awaited and the model reads a "
                             "timeout error)")
    cpu_s: int = Field(10, gt=0, description="python tool: CPU seconds per call")
    memory_mb: int = Field(1024, gt=0, description="python tool: address space per process, MB")
    memory_total_mb: int = Field(512, gt=0, description="python tool: memory of all of a call's processes "
                                 "together, MB (a cgroup where strop may make one, else a watchdog); past it the "
                                 "call is stopped")
    tmp_mb: int = Field(64, gt=0, description="python tool: bytes a call may write to its /tmp (a tmpfs), MB")
    tmp_files: int = Field(4096, gt=0, description="python tool: files and directories a call may make in its /tmp")
    processes: int = Field(64, gt=0, description="python tool: processes per call")
    concurrency: int = Field(8, gt=0, description="python tool: calls running at once; concurrency x "
                             "(memory_total_mb + tmp_mb) must fit in half of the host's memory")
    nested_userns: bool = Field(False, description="python tool: let sandboxed code create user namespaces "
                                "(bubblewrap; off by default)")
    describe: bool = Field(True, description="append the tools' JSON schemas and the <tool_call> format to the "
                           "system prompt (turn off when your own system prompt describes the tools)")
    tool_threads: int = Field(8, gt=0, description="worker threads for tools written as plain (sync) functions; "
                              "their own pool, so slow tools never queue the engine's work")
    call_reward: float = Field(0.0, description="tool reward shaping: added per successful tool call "
                               "(negative to penalise calls), at most max_call_reward in all")
    max_call_reward: float = Field(0.0, description="cap on the absolute total of call_reward per sample")

    @model_validator(mode="after")
    def _sandbox_totals_fit(self):
        """The python tool's calls together must not be able to exhaust the host's memory (the
        OOM killer may pick the trainer); tmpfs bytes are memory too."""
        if "python" in self.enabled:
            host_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20
            worst = self.concurrency * (self.memory_total_mb + self.tmp_mb)
            if worst > host_mb // 2:
                raise ValueError(f"tools.concurrency ({self.concurrency}) x (tools.memory_total_mb "
                                 f"({self.memory_total_mb}) + tools.tmp_mb ({self.tmp_mb})) = {worst} MB is more than "
                                 f"half of this host's memory ({host_mb} MB): lower one of them")
        return self


class AgentConfig(_Section):
    workers: Literal["threads", "processes"] = Field(
        "threads", description="where agent programs run: worker threads of this process, or worker processes "
        "(spawned; the hook is imported there by its path)")
    concurrency: int = Field(64, gt=0, description="agent programs running at once (each holds one session); "
                             "below the samples generated at once, it also bounds the engine's batch")
    max_calls: int = Field(8, gt=0, description="model calls per session; a call past it gets a 400 and the "
                           "session's samples train as truncated")
    max_call_tokens: int = Field(256, gt=0, description="new tokens per call (the agent's max_tokens, if lower)")
    max_calls_in_flight: int = Field(256, gt=0, description="calls generating at once over all sessions; past it "
                                     "a call gets 429 with Retry-After (the openai SDK retries by itself; an agent "
                                     "that gives up on it is aborted, not failed); at least agent.concurrency")
    retry_after_s: float = Field(1.0, gt=0, description="the Retry-After a 429 carries")
    idle_timeout_s: float = Field(60.0, gt=0, description="a session with no call for this long is closed "
                                  "(its samples are not trained; counted in agent_sessions_idle_closed)")
    timeout_s: float = Field(600.0, gt=0, description="most seconds one agent program may run")
    reward: Literal["session", "hook"] = Field(
        "session", description="'session': the reward the agent posts (POST /v1/sessions/{id}/reward) or returns; "
        "a session without one is not trained (status no_reward); 'hook': rollout.reward scores the final "
        "assistant message")
    cut_after_tool_calls: bool = Field(True, description="a turn that calls a tool ends where its calls end: "
                                       "the model's text after them is dropped (never trained, never shown to "
                                       "the agent), as in strop's multi-turn rollout; false returns the whole turn")
    describe_tools: bool = Field(True, description="the prompt describes the request's tools (their schemas and "
                                 "the <tool_call> format in the system prompt, or the chat template's own "
                                 "rendering); turn off when the agent's system prompt describes them, as "
                                 "tools.describe does for strop's own tools")
    port: int = Field(0, ge=0, lt=65536, description="the proxy's port on 127.0.0.1 (0: any free one)")

    @model_validator(mode="after")
    def _room_for_every_agent(self):
        if self.max_calls_in_flight < self.concurrency:
            raise ValueError(f"agent.max_calls_in_flight={self.max_calls_in_flight} is below agent.concurrency="
                             f"{self.concurrency}: agents running at once would be told to retry (429) on their "
                             "first calls; raise max_calls_in_flight or lower concurrency")
        return self


class Config(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy model")
    data: DataConfig = Field(default_factory=DataConfig, description="prompt sources")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="generation and rewards")
    algo: AlgoConfig = Field(default_factory=AlgoConfig, description="advantages and policy loss")
    train: TrainConfig = Field(default_factory=TrainConfig, description="optimizer and batching")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="held-out evaluation")
    run: RunConfig = Field(default_factory=RunConfig, description="outputs")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="the rollout engine: in process or "
                                 "HTTP servers behind a router")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig,
                                     description="multi-process training (strop train --nproc N)")
    plugins: PluginsConfig = Field(default_factory=PluginsConfig, description="hooks by import path (docs/plugins.md)")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="where processes run: the local "
                                   "machine or a Ray cluster (docs/scale-out.md)")
    tools: ToolsConfig = Field(default_factory=ToolsConfig, description="tools for multi-turn rollouts "
                               "(docs/tools.md)")
    agent: AgentConfig = Field(default_factory=AgentConfig, description="agent programs behind the OpenAI-"
                               "compatible proxy (plugins.agent; docs/agents.md)")

    @model_validator(mode="after")
    def _check_cluster(self):
        c, e = self.cluster, self.engine
        if e.launch and e.kind in ("vllm", "sglang") and c.launcher != "ray":
            raise ValueError(f"engine.launch with engine.kind={e.kind!r} starts {e.kind} servers as Ray engine actors: "
                             "set cluster.launcher='ray', or start the servers yourself and give engine.urls")
        if c.launcher == "local":
            return self
        if c.placement == "colocated" and e.launch > c.trainer_ranks:
            raise ValueError(f"cluster.placement='colocated' puts engine i in trainer rank i's bundle: engine.launch="
                             f"{e.launch} engines need as many trainer ranks (cluster.trainer_ranks={c.trainer_ranks})")
        if c.placement == "colocated" and not e.launch:
            raise ValueError("cluster.placement='colocated' shares the trainer ranks' bundles with engine actors: "
                             "set engine.launch=N, or use placement='disaggregated'")
        return self

    @model_validator(mode="after")
    def _check_groups(self):
        from strop.algo.advantages import GROUP_ESTIMATORS

        if (self.rollout.n_samples_per_prompt == 1 and self.algo.estimator in GROUP_ESTIMATORS
                and not self.plugins.advantage):
            raise ValueError(f"algo.estimator={self.algo.estimator!r} compares the samples of one prompt, and "
                             "rollout.n_samples_per_prompt=1 makes every advantage 0 (nothing is learned): sample "
                             "2 or more per prompt, or use estimator 'reinforce_pp' or 'ppo'")
        r, a = self.rollout, self.algo
        if r.mode == "one_step_off" and r.max_staleness < 1:
            raise ValueError("rollout.mode='one_step_off' trains on tokens one weight version old: it needs "
                             "rollout.max_staleness >= 1")
        if r.mode != "sync" and a.off_policy_correction == "auto" and not a.corrections():
            raise ValueError(f"rollout.mode={r.mode!r} trains on tokens sampled by older weights, and no off-policy "
                             "correction is set, so they would train as if on-policy. Choose one:\n  "
                             + "\n  ".join(OFF_POLICY_CORRECTIONS))
        if a.distill_teacher_url and r.temperature != 1.0 and a.distill_temperature != 1.0:
            raise ValueError(f"algo.distill_teacher_url scores the student's tokens at temperature 1 (the servers' "
                             f"input-token logprobs ignore sampling temperature), and the student samples and is "
                             f"scored at rollout.temperature={r.temperature}: set algo.distill_temperature=1.0 to "
                             "accept the mismatch, sample at rollout.temperature=1.0, or load the teacher here "
                             "(algo.distill_teacher), which scores at the student's temperature")
        if a.distill_teacher and self.parallel.tensor_parallel_size > 1:
            raise ValueError(f"algo.distill_teacher is loaded whole into each trainer process, and "
                             f"parallel.tensor_parallel_size={self.parallel.tensor_parallel_size} would need it split "
                             "across ranks like the policy, which strop does not do yet: distil without tensor parallel")
        if a.overlong_buffer is not None and a.overlong_buffer > r.max_new_tokens:
            raise ValueError(f"algo.overlong_buffer={a.overlong_buffer} is longer than rollout.max_new_tokens="
                             f"{r.max_new_tokens}: the shaping covers the last tokens before that limit")
        if r.mode != "sync" and self.plugins.rollout:
            raise ValueError(f"rollout.mode={r.mode!r} schedules groups one by one and cannot use a rollout hook "
                             f"(plugins.rollout={self.plugins.rollout!r}), which generates whole steps; use "
                             "plugins.generate / reward / filter, or rollout.mode='sync'")
        if (r.over_sample > 1 or r.dynamic_sampling) and self.plugins.rollout:
            raise ValueError("rollout.over_sample / dynamic_sampling need the default rollout (plugins.rollout "
                             "generates whole steps its own way)")
        tools = (f"tools.enabled={self.tools.enabled}" if self.tools.enabled else
                 f"plugins.tools={self.plugins.tools!r}" if self.plugins.tools else "")
        if tools and self.plugins.generate:
            raise ValueError(f"{tools} uses strop's multi-turn generate function; "
                             f"plugins.generate={self.plugins.generate!r} would replace it: use one or the other")
        if tools and a.overlong_buffer is not None:
            raise ValueError(f"algo.overlong_buffer shapes a single response by its length against "
                             f"rollout.max_new_tokens; a multi-turn sample ({tools}) also holds tool output and "
                             "several turns' budgets: shape its reward in the reward function instead")
        if tools and r.partial == "resume":
            raise ValueError("rollout.partial='resume' continues a sample from its tokens, but a multi-turn sample "
                             f"restarts clean ({tools}): use rollout.partial='finish'")
        if self.plugins.agent:
            other = (tools or (f"plugins.generate={self.plugins.generate!r}" if self.plugins.generate else "")
                     or (f"plugins.rollout={self.plugins.rollout!r}" if self.plugins.rollout else ""))
            if other:
                raise ValueError(f"plugins.agent={self.plugins.agent!r} generates each sample through the agent "
                                 f"proxy, and {other} generates it another way: use one of them")
            if r.partial == "resume":
                raise ValueError("rollout.partial='resume' continues a sample from its tokens, but an agent session "
                                 f"(plugins.agent={self.plugins.agent!r}) restarts clean: use rollout.partial='finish'")
            if a.overlong_buffer is not None:
                raise ValueError("algo.overlong_buffer shapes a single response by its length; an agent session "
                                 "holds several calls and what the agent added between them: shape its reward in "
                                 "the agent or the reward function instead")
        if r.exact_logprobs and (r.mode != "sync" or self.data.samples):
            raise ValueError("rollout.exact_logprobs scores samples with the trainer's current weights, which are the "
                             "weights that sampled them only when this run generates each step in sync mode: "
                             + (f"rollout.mode={r.mode!r}" if r.mode != "sync" else
                                f"data.samples={self.data.samples!r} replays samples generated elsewhere")
                             + "; use rollout.mode='sync' without data.samples, or turn exact_logprobs off")
        if self.train.activation_checkpointing and self.parallel.context_parallel_size > 1:
            raise ValueError("train.activation_checkpointing with parallel.context_parallel_size > 1: strop's "
                             "context-parallel attention reads the running plan when it is called, and a recompute "
                             "in backward would run outside it; use one of them")
        if self.engine.dtype != "auto" and self.engine.kind != "embedded":
            raise ValueError(f"engine.dtype={self.engine.dtype!r} sets the embedded engine's weights; a "
                             f"{self.engine.kind} server chooses its own (engine.launch_args, and engine.sync_dtype "
                             "for what a broadcast sends): leave engine.dtype='auto'")
        if r.exact_logprobs and self.engine.dtype not in ("auto", self.model.dtype):
            raise ValueError(f"rollout.exact_logprobs reports the trainer's logprobs as the sampler's, which holds only "
                             f"when both compute with the same weights: engine.dtype={self.engine.dtype!r} samples "
                             f"from other numbers than the {self.model.dtype} trainer; turn one off")
        if self.engine.share_weights and (why := self.why_not_shared()):
            raise ValueError(f"engine.share_weights=true: {why}")
        if r.exact_logprobs and self.train.bf16_autocast:
            raise ValueError("rollout.exact_logprobs reports the trainer's logprobs as the sampler's, which holds only "
                             "when both compute with the same numbers: train.bf16_autocast computes the trainer's "
                             f"forward in bf16 while the engine samples from {self.model.dtype} weights; turn one off")
        tp = self.parallel.tensor_parallel_size
        if tp > 1 and self.parallel.context_parallel_size > 1:
            raise ValueError(f"parallel.tensor_parallel_size={tp} with parallel.context_parallel_size="
                             f"{self.parallel.context_parallel_size}: tensor parallel and strop's context parallel do "
                             "not compose yet (a (dp, cp, tp) mesh is not built); use one of them")
        if tp > 1 and r.exact_logprobs:
            raise ValueError(f"rollout.exact_logprobs gives 0 only when the trainer runs the engine's kernels; "
                             f"parallel.tensor_parallel_size={tp} sums every layer in two halves: turn one off")
        if tp > 1 and (a.kl_coef or a.kl_in_reward_coef) and a.ref_mode == "swap":
            raise ValueError(f"algo.ref_mode='swap' cannot swap into weights split by parallel.tensor_parallel_size="
                             f"{tp}; use ref_mode='copy'")
        if r.partial == "resume" and self.plugins.generate:
            raise ValueError("rollout.partial='resume' continues a sample from the tokens it has, which the default "
                             f"generate function does; plugins.generate={self.plugins.generate!r} may not: use "
                             "partial='finish'")
        if r.partial == "resume" and r.resumed_tokens == "correct" and r.mode != "sync" and not (
                a.use_rollout_logprobs or a.tis_cap is not None or a.mis_low is not None or a.mis_high is not None):
            raise ValueError("rollout.resumed_tokens='correct' trains tokens of older weights with an importance "
                             "correction: set algo.use_rollout_logprobs=true (the ratio against the rollout's own "
                             "logprobs), or algo.tis_cap / mis_low / mis_high (each with algo.proximal='recompute'); "
                             "or resumed_tokens='mask'")
        return self

    def why_not_shared(self, world: int = 1) -> str | None:
        """Why the embedded engine cannot decode from the trainer's own parameters (engine.share_weights),
        or None: it decodes while nothing else changes them, from the same numbers, in one process."""
        e = self.engine
        if e.kind != "embedded":
            return f"engine.kind={e.kind!r} runs in servers of its own"
        if self.rollout.mode != "sync":
            return (f"rollout.mode={self.rollout.mode!r} generates while the trainer changes its weights: the engine "
                    "needs a copy that changes only at an update")
        if e.dtype not in ("auto", self.model.dtype):
            return f"engine.dtype={e.dtype!r} decodes from a {e.dtype} copy of the {self.model.dtype} weights"
        if not e.fast_decode:
            return ("engine.fast_decode=false runs the model's own forward, which would run in the trainer's "
                    "train mode")
        if self.data.samples:
            return f"data.samples={self.data.samples!r} replays samples: there is no engine"
        if world > 1:
            return f"{world} processes split or replicate the trainer's weights; the engine on rank 0 needs them whole"
        return None


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _format_validation_error(err: ValidationError, origin: str) -> str:
    lines = [f"invalid config ({origin}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        else:
            got = e.get("input")
            got_text = "" if isinstance(got, dict) or key in secret_fields() else f" (got {got!r})"
            lines.append(f"  {key}: {e['msg']}{got_text}")
    return "\n".join(lines)


def load_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
    return data


def parse_overrides(args: list[str], prog: str = "strop train") -> dict:
    """Turn ``--section.key=value`` arguments into a nested dict (only what was given)."""
    from pydantic_settings import CliSettingsSource, SettingsError

    if "-h" in args or "--help" in args:  # the full usage, on request only
        return CliSettingsSource(Config, cli_parse_args=args, cli_prog_name=prog, cli_implicit_flags=False)()
    try:
        return CliSettingsSource(Config, cli_parse_args=args, cli_prog_name=prog, cli_implicit_flags=False,
                                 cli_exit_on_error=False)()
    except SettingsError as exc:
        why = str(exc).removeprefix("error parsing CLI: ")
        raise ConfigError(f"{why}\n  (`{prog} --help` lists every option)") from None


def build_config(yaml_path: str | None = None, overrides: dict | None = None, preset: str | None = None) -> Config:
    """Defaults < preset < YAML file < overrides. A YAML file may name a preset with ``preset: NAME``."""
    from strop.presets import PRESETS

    data: dict = load_yaml(yaml_path) if yaml_path else {}
    preset = preset or data.pop("preset", None)
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
        data = _deep_merge(PRESETS[preset], data)
    origin = f"file {yaml_path!r}" if yaml_path else "defaults"
    if preset:
        origin += f" + preset {preset!r}"
    if overrides:
        data = _deep_merge(data, overrides)
        origin += " + command line"
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, origin)) from None


def secret_fields(model: type[BaseModel] = Config, prefix: str = "") -> dict[str, str]:
    """Every secret field of the config tree: dotted name -> its environment variable."""
    out = {}
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out |= secret_fields(field.annotation, f"{prefix}{name}.")
        elif "env" in (field.json_schema_extra or {}):
            out[f"{prefix}{name}"] = field.json_schema_extra["env"]
    return out


def save_config(cfg: Config, path: Path) -> None:
    """Write ``cfg`` as YAML, atomically (a resumed run reads it back); secrets are written redacted."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False))
    tmp.replace(path)


# fields that may differ on resume without being allowed: where the run is and how it shows progress
RESUME_FREE = ("run.dir", "run.progress")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def _without(d: dict, keys) -> dict:
    """A copy of ``d`` without the dotted ``keys``."""
    out = copy.deepcopy(d)
    for key in keys:
        *path, name = key.split(".")
        node = out
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(name, None)
    return out


def find_run_dir(which: str, runs: Path = Path("runs")) -> Path:
    """``--resume`` target: a run directory, or ``latest`` (the newest under ./runs with a config)."""
    if which == "latest":
        found = sorted((p for p in runs.iterdir() if (p / "config.yaml").is_file()), key=lambda p: p.stat().st_mtime) \
            if runs.is_dir() else []
        if not found:
            raise ConfigError(f"--resume latest: no run directory with a config.yaml under {str(runs)!r}")
        return found[-1]
    run_dir = Path(which)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--resume {which}: not a strop run directory (no config.yaml in {str(run_dir)!r})")
    return run_dir


def resume_config(run_dir: Path, yaml_path: str | None = None, overrides: dict | None = None,
                  preset: str | None = None, allow: list[str] = ()) -> Config:
    """The config of a resumed run: the saved one (or the given file / preset) plus ``overrides``.
    A field that differs from the saved config is refused unless named in ``allow``."""
    saved = load_yaml(run_dir / "config.yaml")
    overrides = dict(overrides or {})
    given_dir = overrides.get("run", {}).get("dir")
    if given_dir is not None and Path(given_dir).resolve() != run_dir.resolve():
        raise ConfigError(f"--resume {run_dir} with --run.dir={given_dir}: a run resumes in its own directory")
    if yaml_path or preset:
        cfg = build_config(yaml_path, overrides, preset)
    else:
        try:
            cfg = Config.model_validate(_deep_merge(saved, overrides))
        except ValidationError as err:
            raise ConfigError(_format_validation_error(err, f"{run_dir / 'config.yaml'} + command line")) from None
    cfg.run.dir = str(run_dir)
    known = _flat(json.loads(Config().model_dump_json()))
    unknown = [k for k in allow if k not in known]
    if unknown:
        raise ConfigError(f"--allow-change {','.join(unknown)}: no such config field")
    secrets = secret_fields()  # never compared: the saved config holds them redacted
    try:  # the saved config as this version reads it (fields added since take their defaults)
        before = _flat(json.loads(Config.model_validate(_without(saved, secrets)).model_dump_json()))
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, str(run_dir / "config.yaml"))) from None
    after = _flat(json.loads(cfg.model_dump_json()))
    changed = [k for k in sorted(set(before) | set(after))
               if before.get(k) != after.get(k) and k not in RESUME_FREE and k not in allow and k not in secrets]
    if changed:
        lines = "\n".join(f"  {k}: {before.get(k)!r} -> {after.get(k)!r}" for k in changed)
        raise ConfigError(f"--resume {run_dir}: the config differs from the saved one:\n{lines}\n"
                          f"  (allow on purpose with --allow-change {','.join(changed)})")
    return cfg
