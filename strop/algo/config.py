"""The ``algo`` section: advantages, policy loss, KL, off-policy corrections and distillation (strop/algo/).
Torch-free: ``strop train --help`` and the config's rules (strop/rules.py) read it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, model_validator

from strop.configbase import Section, secret

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")  # need groups of >= 2 samples


class AlgoConfig(Section):
    estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo"] = Field(
        "grpo", description="advantage estimator (docs/algorithms.md); 'ppo' trains a critic with GAE"
    )
    normalize_std: bool = Field(True, description="grpo: divide group-centred rewards by the group std")
    policy_loss: Literal["ppo_clip", "gspo", "cispo", "dppo"] = Field(
        "ppo_clip",
        description="policy loss (docs/algorithms.md); 'dppo' bounds each token's probability change "
        "against the rollout's (algo.dppo_*), prime-rl's default",
    )
    clip_low: float = Field(0.2, ge=0, description="clip: lower epsilon (ratio >= 1 - clip_low)")
    clip_high: float = Field(0.2, ge=0, description="clip: upper epsilon (ratio <= 1 + clip_high)")
    dual_clip: float | None = Field(None, gt=1, description="ppo_clip: cap the loss of A<0 tokens at -A*dual_clip")
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean", description="how per-token losses reduce to the step loss (docs/algorithms.md)"
    )
    loss_agg_constant: float | None = Field(
        None, gt=0, description="seq_mean_token_sum_norm: the constant normaliser (default rollout.max_new_tokens)"
    )
    kl_coef: float = Field(0.0, ge=0, description="weight of the KL-to-reference loss term (0 = off)")
    kl_kind: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator of the loss term")
    kl_importance_weighted: bool = Field(
        False, description="weight the KL loss by pi/pi_old (unbiased when samples come from pi_old)"
    )
    kl_in_reward_coef: float = Field(0.0, ge=0, description="KL penalty folded into token rewards (reinforce_pp, ppo)")
    kl_in_reward_kind: Literal["k1", "k2", "k3"] = Field("k1", description="KL estimator of the reward penalty")
    ref_mode: Literal["copy", "swap"] = Field(
        "copy", description="reference policy: a frozen copy, or its weights swapped into the training model"
    )
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus weight (0 = off)")
    gamma: float = Field(1.0, ge=0, le=1, description="discount (reinforce_pp, ppo)")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda (ppo)")
    critic_lr: float = Field(1e-5, gt=0, description="ppo: critic learning rate")
    value_clip: float | None = Field(0.2, gt=0, description="ppo: value-loss clip range (null = unclipped)")
    use_rollout_logprobs: bool = Field(False, description="the engine's logprobs serve as the old policy")
    tis_cap: float | None = Field(None, gt=0, description="truncated importance sampling: cap C of pi_old/pi_rollout")
    mis_low: float | None = Field(None, ge=0, description="masked importance sampling: drop ratio < mis_low")
    mis_high: float | None = Field(None, gt=0, description="masked importance sampling: drop ratio > mis_high")
    mis_level: Literal["token", "sequence"] = Field(
        "token", description="masked importance sampling per token or sequence"
    )
    off_policy_correction: Literal["auto", "none", "icepop", "geo_mask"] = Field(
        "auto",
        description="tokens sampled by another policy (async rollout, the engine's numbers): 'icepop' (token "
        "ratio pi_old/pi_rollout kept and weighted inside [0.5, 5], AReaL's bounds; algo.mis_low / mis_high change "
        "them), 'geo_mask' (a sequence whose geometric-mean ratio leaves [0.99, 1.01] is masked, SkyRL's band); "
        "either sets the level itself (algo.mis_level is not read), "
        "'auto' (the fields tis_cap, mis_*, opsm_delta, use_rollout_logprobs, policy_loss='dppo' decide), 'none' (no "
        "correction at all: rollout.mode async / one_step_off refuse an uncorrected run unless it says so)",
    )
    proximal: Literal["recompute", "loglinear"] = Field(
        "recompute",
        description="pi_old, the PPO ratio's denominator (AReaL's proximal policy): 'recompute' = the "
        "trainer's weights at the start of the step (a no-grad forward when train.mini_batches > 1, free otherwise); "
        "'loglinear' = AReaL's log-linear interpolation between the weights that sampled each token and the step's "
        "update, from the tokens' versions, with no forward. 'recompute' with algo.tis_cap / mis_* / icepop as the "
        "behaviour weight pi_old/pi_rollout is decoupled PPO; 'loglinear' refuses them (its pi_old is pi_rollout "
        "for a token one version old, so the weight is 1 there)",
    )
    opsm_delta: float | None = Field(
        None,
        ge=0,
        description="off-policy sequence masking (DeepSeek-V3.2; slime's --opsm-delta, 1e-4 there): a "
        "sequence with negative advantage whose mean token log pi_rollout - log pi exceeds this is masked",
    )
    dppo_mask_low: float = Field(
        0.2,
        gt=0,
        description="dppo: a token with A <= 0 is masked when its probability fell by more than this since the rollout",
    )
    dppo_mask_high: float = Field(
        0.2,
        gt=0,
        description="dppo: a token with A > 0 is masked when its probability rose by more than this since the rollout",
    )
    dppo_kl_coef: float = Field(1e-3, ge=0, description="dppo: weight of (log pi - log pi_rollout)^2 on every token")
    distill_teacher: str | None = Field(
        None,
        description="on-policy distillation: a teacher model (path or hub id; same tokenizer as the student) "
        "scores the student's sampled tokens; -algo.distill_coef x (log pi_student - log pi_teacher) per token is "
        "added to the advantages (the teacher is frozen, loaded into the trainer and split like the policy)",
    )
    distill_teacher_url: str | None = Field(
        None,
        description="on-policy distillation from a teacher served elsewhere (instead of distill_teacher): its "
        "server scores the student's tokens (input-token logprobs, at temperature 1); kind: distill_teacher_kind",
    )
    distill_teacher_kind: Literal["strop", "sglang", "vllm"] = Field(
        "strop",
        description="the distill_teacher_url server: strop serve, SGLang (both: /generate with "
        "input_token_logprobs) or vLLM (/v1/completions with prompt_logprobs)",
    )
    distill_teacher_token: SecretStr | None = secret(
        "STROP_TEACHER_TOKEN",
        "bearer token sent to the distill_teacher_url server (strop serve --token, vLLM "
        "--api-key, SGLang --api-key; engine.token is never sent there)",
    )
    distill_coef: float = Field(1.0, gt=0, description="on-policy distillation: weight of the reverse-KL advantage")
    distill_only: bool = Field(
        False,
        description="on-policy distillation alone: the task's advantages are dropped "
        "(its reward is still computed and logged)",
    )
    distill_temperature: float | None = Field(
        None,
        gt=0,
        description="the temperature the teacher's logits are scored at (default: rollout.temperature, "
        "the one the student sampled at and is scored at; slime's SGLang teacher scores at 1.0)",
    )
    overlong_buffer: int | None = Field(
        None,
        gt=0,
        description="DAPO's overlong reward shaping: over the last this many tokens before "
        "rollout.max_new_tokens the reward falls linearly to -algo.overlong_penalty (by generated length)",
    )
    overlong_penalty: float = Field(1.0, ge=0, description="DAPO overlong shaping: the penalty at the length limit")
    routing_replay: bool = Field(
        False,
        description="routed-experts (MoE) models: the policy's forwards route each token to the experts the engine "
        "chose for it (R3), with gate weights from the live router; the engine records them",
    )

    @model_validator(mode="after")
    def _check_algo(self):
        if self.mis_low is not None and self.mis_high is not None and self.mis_low >= self.mis_high:
            raise ValueError("algo.mis_low must be below algo.mis_high")
        if self.dual_clip is not None and self.policy_loss != "ppo_clip":
            raise ValueError("algo.dual_clip applies to policy_loss='ppo_clip' only")
        if self.kl_in_reward_coef and self.estimator not in ("reinforce_pp", "reinforce_pp_baseline", "ppo"):
            raise ValueError(
                "algo.kl_in_reward_coef needs a token-level estimator (reinforce_pp*, ppo); "
                "use algo.kl_coef for a KL loss term with grpo/dr_grpo/rloo"
            )
        if self.use_rollout_logprobs and (
            self.tis_cap is not None or self.mis_low is not None or self.mis_high is not None
        ):
            raise ValueError(
                "algo.tis_cap / algo.mis_low / algo.mis_high correct pi_old against the engine's "
                "logprobs; with algo.use_rollout_logprobs=true pi_old IS the engine's logprobs, so the "
                "weight is always 1 and the correction does nothing: turn one of them off"
            )
        # (values only, never "was it set": a saved config.yaml sets every field, and a resume must read it back)
        if self.off_policy_correction == "icepop" and self.tis_cap is not None:
            raise ValueError(
                "algo.off_policy_correction='icepop' weighs each kept token by its own ratio between "
                "algo.mis_low and mis_high (0.5 and 5 unless set): leave algo.tis_cap unset"
            )
        if self.off_policy_correction in ("icepop", "geo_mask") and self.use_rollout_logprobs:
            raise ValueError(
                f"algo.off_policy_correction={self.off_policy_correction!r} compares pi_old with the "
                "engine's logprobs; with algo.use_rollout_logprobs=true they are the same numbers and "
                "nothing would ever be masked: turn one of them off"
            )
        if (self.distill_only or self.distill_temperature is not None) and not (
            self.distill_teacher or self.distill_teacher_url
        ):
            raise ValueError(
                "algo.distill_only / distill_temperature need a teacher: set algo.distill_teacher (a "
                "model) or algo.distill_teacher_url (a server)"
            )
        if self.distill_teacher and self.distill_teacher_url:
            raise ValueError(
                "algo.distill_teacher (a model loaded here) and algo.distill_teacher_url (a server) name "
                "two teachers: keep one"
            )
        if self.distill_teacher_url and self.distill_temperature not in (None, 1.0):
            raise ValueError(
                f"algo.distill_teacher_url: a server scores input tokens at temperature 1 (its API takes "
                f"none), so algo.distill_temperature={self.distill_temperature} cannot be honoured; load "
                "the teacher here (algo.distill_teacher) or set 1.0"
            )
        if self.proximal == "loglinear" and self.use_rollout_logprobs:
            raise ValueError(
                "algo.proximal='loglinear' interpolates pi_old between the engine's logprobs and the "
                "current policy; algo.use_rollout_logprobs=true makes pi_old the engine's logprobs: "
                "choose one"
            )
        # the corrections that weigh or mask by pi_old / pi_rollout (OPSM and DPPO compare pi itself with it)
        behaviour = [x for x in self.corrections() if x.startswith(("algo.tis_cap", "algo.mis_", "algo.off_policy"))]
        if self.proximal == "loglinear" and behaviour:
            raise ValueError(
                f"algo.proximal='loglinear' sets pi_old = pi_rollout for every token one version old "
                f"(every token in sync mode), so the weight pi_old/pi_rollout that {', '.join(behaviour)} "
                "corrects by is 1 there and the correction never acts: use algo.proximal='recompute' "
                "(pi_old from the trainer's own weights), or drop the correction"
            )
        if self.off_policy_correction == "none" and self.corrections():
            raise ValueError(
                "algo.off_policy_correction='none' says no correction, but "
                f"{', '.join(self.corrections())} is set: drop one"
            )
        if self.policy_loss == "cispo" and self.clip_low > 1:
            raise ValueError("algo.clip_low above 1 would allow negative CISPO weights")
        return self

    def corrections(self) -> list[str]:
        """The off-policy corrections this section turns on, as the settings that name them."""
        on = [
            f"algo.off_policy_correction={self.off_policy_correction!r}"
            if self.off_policy_correction in ("icepop", "geo_mask")
            else ""
        ]
        on += [
            f"algo.{k}={getattr(self, k)}"
            for k in ("tis_cap", "mis_low", "mis_high", "opsm_delta")
            if getattr(self, k) is not None
        ]
        on += [
            "algo.use_rollout_logprobs=true" if self.use_rollout_logprobs else "",
            "algo.policy_loss='dppo'" if self.policy_loss == "dppo" else "",
        ]
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
