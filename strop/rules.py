"""The refusals that span sections: one table of rules, each a name, the condition that breaks it and why.

A section checks its own fields (``strop/<part>/config.py``); what needs two sections is a row here,
checked in one loop when the config is validated (:func:`check_rules`), before any model loads. Each row has a
config that trips it in tests/test_rules.py. The layout rules that need the world size or the model
(tensor / context parallel divisibility) are the parallel layout's, checked where the world is known.

``cfg`` is a ``strop.config.Config``; this module does not import it (the config imports the rules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from strop.algo.config import GROUP_ESTIMATORS, OFF_POLICY_CORRECTIONS
from strop.rule_reasons import (
    LORA_NOT_SPLIT,
    adapter_sync,
    agent_rewards,
    other_generation,
    tools_setting,
    shared_prefix_off,
    why_not_compiled,
    why_no_cpu_kernels,
    why_no_routing_replay,
    why_no_speculation,
    why_not_shared,
)


@dataclass(frozen=True)
class Rule:
    """One refusal: ``broken(cfg)`` says the config breaks it, ``why(cfg)`` says so to the user."""

    name: str
    broken: Callable[[object], bool]  # the condition that breaks the rule, of the whole config
    why: Callable[[object], str]  # the refusal, phrased for the user (read only when broken)


def _corrected(a) -> bool:
    return a.use_rollout_logprobs or a.tis_cap is not None or a.mis_low is not None or a.mis_high is not None


RULES: tuple[Rule, ...] = (
    Rule(
        "launched vllm/sglang servers need ray",
        lambda c: bool(c.engine.launch and c.engine.kind in ("vllm", "sglang") and c.cluster.launcher != "ray"),
        lambda c: (
            f"engine.launch with engine.kind={c.engine.kind!r} starts {c.engine.kind} servers as Ray engine "
            "actors: set cluster.launcher='ray', or start the servers yourself and give engine.urls"
        ),
    ),
    Rule(
        "colocated engines need as many trainer ranks",
        lambda c: (
            c.cluster.launcher != "local"
            and c.cluster.placement == "colocated"
            and c.engine.launch > c.cluster.trainer_ranks
        ),
        lambda c: (
            f"cluster.placement='colocated' puts engine i in trainer rank i's bundle: engine.launch="
            f"{c.engine.launch} engines need as many trainer ranks (cluster.trainer_ranks={c.cluster.trainer_ranks})"
        ),
    ),
    Rule(
        "colocated placement needs launched engines",
        lambda c: c.cluster.launcher != "local" and c.cluster.placement == "colocated" and not c.engine.launch,
        lambda c: (
            "cluster.placement='colocated' shares the trainer ranks' bundles with engine actors: "
            "set engine.launch=N, or use placement='disaggregated'"
        ),
    ),
    Rule(
        "group estimators need groups",
        lambda c: (
            c.rollout.n_samples_per_prompt == 1 and c.algo.estimator in GROUP_ESTIMATORS and not c.plugins.advantage
        ),
        lambda c: (
            f"algo.estimator={c.algo.estimator!r} compares the samples of one prompt, and "
            "rollout.n_samples_per_prompt=1 makes every advantage 0 (nothing is learned): sample "
            "2 or more per prompt, or use estimator 'reinforce_pp' or 'ppo'"
        ),
    ),
    Rule(
        "one_step_off needs staleness",
        lambda c: c.rollout.mode == "one_step_off" and c.rollout.max_staleness < 1,
        lambda c: (
            "rollout.mode='one_step_off' trains on tokens one weight version old: it needs rollout.max_staleness >= 1"
        ),
    ),
    Rule(
        "stale tokens need a correction",
        lambda c: c.rollout.mode != "sync" and c.algo.off_policy_correction == "auto" and not c.algo.corrections(),
        lambda c: (
            f"rollout.mode={c.rollout.mode!r} trains on tokens sampled by older weights, and no off-policy "
            "correction is set, so they would train as if on-policy. Choose one:\n  "
            + "\n  ".join(OFF_POLICY_CORRECTIONS)
        ),
    ),
    Rule(
        "a teacher server scores at temperature 1",
        lambda c: (
            bool(c.algo.distill_teacher_url) and c.rollout.temperature != 1.0 and c.algo.distill_temperature != 1.0
        ),
        lambda c: (
            f"algo.distill_teacher_url scores the student's tokens at temperature 1 (the servers' "
            f"input-token logprobs ignore sampling temperature), and the student samples and is "
            f"scored at rollout.temperature={c.rollout.temperature}: set algo.distill_temperature=1.0 to "
            "accept the mismatch, sample at rollout.temperature=1.0, or load the teacher here "
            "(algo.distill_teacher), which scores at the student's temperature"
        ),
    ),
    Rule(
        "LoRA is not split by tensor parallel",
        lambda c: bool(c.model.lora_rank) and c.parallel.tensor_parallel_size > 1,
        lambda c: (
            f"model.lora_rank={c.model.lora_rank} with parallel.tensor_parallel_size="
            f"{c.parallel.tensor_parallel_size}: {LORA_NOT_SPLIT}"
        ),
    ),
    Rule(
        "adapter updates need LoRA and a server",
        lambda c: c.engine.sync == "adapter" and (not c.model.lora_rank or c.engine.kind == "embedded"),
        lambda c: (
            f"engine.sync='adapter' sends LoRA adapters to servers (strop serve merges them, vLLM and SGLang load "
            f"them at run time): it needs model.lora_rank > 0 (it is {c.model.lora_rank}) and engine.kind 'strop', "
            f"'vllm' or 'sglang' (it is {c.engine.kind!r}); the embedded engine takes the merged weights"
        ),
    ),
    Rule(
        "LoRA starts from the base weights",
        lambda c: bool(c.model.lora_rank) and c.model.lora_init in ("pissa", "olora"),
        lambda c: (
            f"model.lora_init={c.model.lora_init!r} starts the adapters from the weights' own factors and subtracts "
            "them from the base weights, so the base the trainer holds is no longer the model's: an adapter sent "
            "alone (engine.sync=adapter) would be applied over the engines' unchanged base, the KL reference "
            "(adapters off) would be the changed base, and the saved adapter would load only on it. Use "
            "lora_init 'default' or 'gaussian'"
        ),
    ),
    Rule(
        "LoRA has no critic",
        lambda c: bool(c.model.lora_rank) and c.algo.estimator == "ppo",
        lambda c: (
            f"model.lora_rank={c.model.lora_rank} with algo.estimator='ppo': PPO's critic is a copy of the policy "
            "with a value head, which LoRA does not train; use a critic-free estimator (grpo, rloo, ...) or "
            "full fine-tuning (model.lora_rank=0)"
        ),
    ),
    Rule(
        "a loaded teacher is not split by tensor parallel",
        lambda c: bool(c.algo.distill_teacher) and c.parallel.tensor_parallel_size > 1,
        lambda c: (
            f"algo.distill_teacher is loaded whole into each trainer process, and "
            f"parallel.tensor_parallel_size={c.parallel.tensor_parallel_size} would need it split "
            "across ranks like the policy, which strop does not do yet: distil without tensor parallel"
        ),
    ),
    Rule(
        "the overlong buffer fits the response limit",
        lambda c: c.algo.overlong_buffer is not None and c.algo.overlong_buffer > c.rollout.max_new_tokens,
        lambda c: (
            f"algo.overlong_buffer={c.algo.overlong_buffer} is longer than rollout.max_new_tokens="
            f"{c.rollout.max_new_tokens}: the shaping covers the last tokens before that limit"
        ),
    ),
    Rule(
        "scheduled rollouts take no rollout hook",
        lambda c: c.rollout.mode != "sync" and bool(c.plugins.rollout),
        lambda c: (
            f"rollout.mode={c.rollout.mode!r} schedules groups one by one and cannot use a rollout hook "
            f"(plugins.rollout={c.plugins.rollout!r}), which generates whole steps; use "
            "plugins.generate / reward / filter, or rollout.mode='sync'"
        ),
    ),
    Rule(
        "over-sampling needs the default rollout",
        lambda c: (c.rollout.over_sample > 1 or c.rollout.dynamic_sampling) and bool(c.plugins.rollout),
        lambda c: (
            "rollout.over_sample / dynamic_sampling need the default rollout (plugins.rollout "
            "generates whole steps its own way)"
        ),
    ),
    Rule(
        "tools take no generate hook",
        lambda c: bool(tools_setting(c) and c.plugins.generate),
        lambda c: (
            f"{tools_setting(c)} uses strop's multi-turn generate function; "
            f"plugins.generate={c.plugins.generate!r} would replace it: use one or the other"
        ),
    ),
    Rule(
        "tools take no overlong shaping",
        lambda c: bool(tools_setting(c)) and c.algo.overlong_buffer is not None,
        lambda c: (
            f"algo.overlong_buffer shapes a single response by its length against "
            f"rollout.max_new_tokens; a multi-turn sample ({tools_setting(c)}) also holds tool output and "
            "several turns' budgets: shape its reward in the reward function instead"
        ),
    ),
    Rule(
        "tools restart a sample clean",
        lambda c: bool(tools_setting(c)) and c.rollout.partial == "resume",
        lambda c: (
            "rollout.partial='resume' continues a sample from its tokens, but a multi-turn sample "
            f"restarts clean ({tools_setting(c)}): use rollout.partial='finish'"
        ),
    ),
    Rule(
        "an agent generates alone",
        lambda c: bool(c.plugins.agent and other_generation(c)),
        lambda c: (
            f"plugins.agent={c.plugins.agent!r} generates each sample through the agent "
            f"proxy, and {other_generation(c)} generates it another way: use one of them"
        ),
    ),
    Rule(
        "kept samples need the embedded engine",
        lambda c: c.rollout.partial == "keep" and c.rollout.mode != "sync" and c.engine.kind != "embedded",
        lambda c: (
            "rollout.partial='keep' freezes the requests in the engine across a weight update and needs each "
            f"token's weight version back; engine.kind={c.engine.kind!r} answers one version per request "
            "(vLLM's /v1/completions, SGLang's /generate): use rollout.partial='resume' (its abort pause) or "
            "'finish' (wait), or engine.kind='embedded'"
        ),
    ),
    Rule(
        "the judge is the one reward",
        lambda c: bool(c.reward.endpoint) and (agent_rewards(c) or "reward" in c.rollout.model_fields_set),
        lambda c: (
            f"reward.endpoint={c.reward.endpoint!r} scores every sample with its judge, "
            + (
                f"but with agent.reward='session' each session's reward is what plugins.agent={c.plugins.agent!r} gives: "
                "set agent.reward='hook' to have the judge score each session's last answer"
                if agent_rewards(c)
                else f"and rollout.reward={c.rollout.reward!r} names another reward: set one of them"
            )
        ),
    ),
    Rule(
        "an environment's turns fit its session",
        lambda c: bool(c.env.openenv) and c.env.max_turns > c.agent.max_calls,
        lambda c: (
            f"env.max_turns={c.env.max_turns} model turns per episode, but a session takes agent.max_calls="
            f"{c.agent.max_calls} calls: raise agent.max_calls or lower env.max_turns"
        ),
    ),
    Rule(
        "an agent session restarts clean",
        lambda c: bool(c.plugins.agent) and c.rollout.partial == "resume",
        lambda c: (
            "rollout.partial='resume' continues a sample from its tokens, but an agent session "
            f"(plugins.agent={c.plugins.agent!r}) restarts clean: use rollout.partial='finish'"
        ),
    ),
    Rule(
        "an agent session takes no overlong shaping",
        lambda c: bool(c.plugins.agent) and c.algo.overlong_buffer is not None,
        lambda c: (
            "algo.overlong_buffer shapes a single response by its length; an agent session "
            "holds several calls and what the agent added between them: shape its reward in "
            "the agent or the reward function instead"
        ),
    ),
    Rule(
        "exact logprobs need sync generation here",
        lambda c: c.rollout.exact_logprobs and (c.rollout.mode != "sync" or bool(c.data.samples)),
        lambda c: (
            "rollout.exact_logprobs scores samples with the trainer's current weights, which are the "
            "weights that sampled them only when this run generates each step in sync mode: "
            + (
                f"rollout.mode={c.rollout.mode!r}"
                if c.rollout.mode != "sync"
                else f"data.samples={c.data.samples!r} replays samples generated elsewhere"
            )
            + "; use rollout.mode='sync' without data.samples, or turn exact_logprobs off"
        ),
    ),
    Rule(
        "activation checkpointing is not with context parallel",
        lambda c: c.train.activation_checkpointing and c.parallel.context_parallel_size > 1,
        lambda c: (
            "train.activation_checkpointing with parallel.context_parallel_size > 1: strop's "
            "context-parallel attention reads the running plan when it is called, and a recompute "
            "in backward would run outside it; use one of them"
        ),
    ),
    Rule(
        "shared prefix needs a masked row",
        lambda c: c.train.shared_prefix is True and bool(shared_prefix_off(c)),
        lambda c: f"train.shared_prefix=true: {shared_prefix_off(c)}; leave it unset (on where it holds) or false",
    ),
    Rule(
        "engine.dtype is the embedded engine's",
        lambda c: c.engine.dtype != "auto" and c.engine.kind != "embedded",
        lambda c: (
            f"engine.dtype={c.engine.dtype!r} sets the embedded engine's weights; a "
            f"{c.engine.kind} server chooses its own (engine.launch_args, and engine.sync_dtype "
            "for what a broadcast sends): leave engine.dtype='auto'"
        ),
    ),
    Rule(
        "exact logprobs need the engine's dtype",
        lambda c: c.rollout.exact_logprobs and c.engine.dtype not in ("auto", c.model.dtype),
        lambda c: (
            f"rollout.exact_logprobs reports the trainer's logprobs as the sampler's, which holds only "
            f"when both compute with the same weights: engine.dtype={c.engine.dtype!r} samples "
            f"from other numbers than the {c.model.dtype} trainer; turn one off"
        ),
    ),
    Rule(
        "shared weights need one sync process",
        lambda c: bool(c.engine.share_weights and why_not_shared(c)),
        lambda c: f"engine.share_weights=true: {why_not_shared(c)}",
    ),
    Rule(
        "verified updates need engines that report their tensors",
        lambda c: c.engine.verify_updates != "off" and c.engine.kind in ("vllm", "sglang"),
        lambda c: (
            f"engine.verify_updates={c.engine.verify_updates!r} compares a digest of every tensor each engine "
            f"holds with the trainer's; the embedded engine and strop serve report them, but engine.kind="
            f"{c.engine.kind!r} reports digests of its own fused or repacked tensors (SGLang fuses linear weights, "
            "vLLM's CPU build repacks them), which the trainer cannot reproduce: there the weight probe "
            "(engine.sync_probe) is the receipt. Check the transport with engine.kind='strop', or set "
            "verify_updates='off'"
        ),
    ),
    Rule(
        "verified updates need whole weights",
        lambda c: c.engine.verify_updates != "off" and adapter_sync(c),
        lambda c: (
            f"engine.verify_updates={c.engine.verify_updates!r} with the adapter transport (engine.sync="
            f"{c.engine.sync!r}, model.lora_rank={c.model.lora_rank}): it sends the LoRA adapter alone and merges "
            "it over the base weights each server already holds, so noise over those is beyond what it sends. "
            "Check the transport with engine.sync='disk', 'delta' or 'broadcast' (the merged weights), or set "
            "verify_updates='off'"
        ),
    ),
    Rule(
        "exact logprobs are not with bf16 autocast",
        lambda c: c.rollout.exact_logprobs and c.train.bf16_autocast,
        lambda c: (
            "rollout.exact_logprobs reports the trainer's logprobs as the sampler's, which holds only "
            "when both compute with the same numbers: train.bf16_autocast computes the trainer's "
            f"forward in bf16 while the engine samples from {c.model.dtype} weights; turn one off"
        ),
    ),
    Rule(
        "tensor parallel is not with context parallel",
        lambda c: c.parallel.tensor_parallel_size > 1 and c.parallel.context_parallel_size > 1,
        lambda c: (
            f"parallel.tensor_parallel_size={c.parallel.tensor_parallel_size} with "
            f"parallel.context_parallel_size={c.parallel.context_parallel_size}: tensor parallel and strop's context "
            "parallel do not compose yet (a (dp, cp, tp) mesh is not built); use one of them"
        ),
    ),
    Rule(
        "exact logprobs are not with tensor parallel",
        lambda c: c.parallel.tensor_parallel_size > 1 and c.rollout.exact_logprobs,
        lambda c: (
            f"rollout.exact_logprobs gives 0 only when the trainer runs the engine's kernels; "
            f"parallel.tensor_parallel_size={c.parallel.tensor_parallel_size} sums every layer in two halves: "
            "turn one off"
        ),
    ),
    Rule(
        "a swapped reference is not split by tensor parallel",
        lambda c: (
            c.parallel.tensor_parallel_size > 1
            and bool(c.algo.kl_coef or c.algo.kl_in_reward_coef)
            and c.algo.ref_mode == "swap"
        ),
        lambda c: (
            f"algo.ref_mode='swap' cannot swap into weights split by parallel.tensor_parallel_size="
            f"{c.parallel.tensor_parallel_size}; use ref_mode='copy'"
        ),
    ),
    Rule(
        "speculation needs strop's own fp32 decoder",
        lambda c: bool(c.engine.speculative and why_no_speculation(c)),
        lambda c: f"engine.speculative={c.engine.speculative}: {why_no_speculation(c)}",
    ),
    Rule(
        "cpu kernels are the embedded decoder's",
        lambda c: c.engine.cpu_kernels != "auto" and bool(why_no_cpu_kernels(c)),
        lambda c: f"engine.cpu_kernels={c.engine.cpu_kernels!r}: {why_no_cpu_kernels(c)}",
    ),
    Rule(
        "compiled attention is the embedded decoder's",
        lambda c: c.engine.compile_attention and bool(why_not_compiled(c, "attention")),
        lambda c: f"engine.compile_attention=true: {why_not_compiled(c, 'attention')}",
    ),
    Rule(
        "the compiled step is the embedded decoder's",
        lambda c: c.engine.compile_step and bool(why_not_compiled(c, "step")),
        lambda c: f"engine.compile_step=true: {why_not_compiled(c, 'step')}",
    ),
    Rule(
        "routing replay needs the engine's routes",
        lambda c: c.algo.routing_replay and bool(why_no_routing_replay(c)),
        lambda c: f"algo.routing_replay=true: {why_no_routing_replay(c)}",
    ),
    Rule(
        "resumed samples need the default generate",
        lambda c: c.rollout.partial == "resume" and bool(c.plugins.generate),
        lambda c: (
            "rollout.partial='resume' continues a sample from the tokens it has, which the default "
            f"generate function does; plugins.generate={c.plugins.generate!r} may not: use partial='finish'"
        ),
    ),
    Rule(
        "corrected resumed tokens need a correction",
        lambda c: (
            c.rollout.partial in ("resume", "keep")
            and c.rollout.resumed_tokens == "correct"
            and c.rollout.mode != "sync"
            and not _corrected(c.algo)
        ),
        lambda c: (
            "rollout.resumed_tokens='correct' trains tokens of older weights with an importance "
            "correction: set algo.use_rollout_logprobs=true (the ratio against the rollout's own "
            "logprobs), or algo.tis_cap / mis_low / mis_high (each with algo.proximal='recompute'); "
            "or resumed_tokens='mask'"
        ),
    ),
)


def check_rules(cfg) -> None:
    """Refuse ``cfg`` (a ValueError, which the config reports as invalid) by the first rule it breaks."""
    for rule in RULES:
        if rule.broken(cfg):
            raise ValueError(rule.why(cfg))
