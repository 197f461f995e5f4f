"""The trainer's modules: the policy, its frozen reference and PPO's critic, each split like the policy over the
run's mesh (strop.parallel.parallelize: tensor parallel, then FSDP2) before the trainer gets them, and each filled
with its own slices of the weights' files when the model arrives on the meta device (strop.parallel.loading)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from strop.parallel import context as context_parallel
from strop.parallel.loading import load_shards
from strop.parallel.parallelize import parallelize
from strop.rule_reasons import LORA_NOT_SPLIT
from strop.train.critic import ValueModel
from strop.train.lora import Adapters, add_adapters
from strop.train.logprob import LogprobModule


@dataclass
class Modules:
    model: nn.Module  # the causal LM the optimizer steps
    policy: nn.Module  # it, as the module the strategy wrapped (LogprobModule)
    ref: nn.Module | None = None  # a frozen copy of the initial policy (algo.ref_mode='copy')
    ref_state: dict[str, torch.Tensor] | None = None  # its initial weights to swap in (ref_mode='swap')
    critic: nn.Module | None = None  # PPO's value model
    teacher: nn.Module | None = None  # on-policy distillation's frozen teacher
    adapters: Adapters | None = None  # LoRA (model.lora_rank): what trains; the model with them off is the reference
    ref_off: bool = False  # the KL reference is ``model`` with its adapters switched off (LoRA)


def build_modules(
    model: nn.Module,
    strategy,
    algo,
    train,
    weights_path: str | None = None,
    teacher: nn.Module | None = None,
    lora=None,
) -> Modules:
    """The modules for ``model`` (whole, or on the meta device with ``weights_path``): copies first (reference,
    critic), from the whole model or its skeleton, then each split over ``strategy``'s mesh as its dims say
    (:func:`strop.parallel.parallelize.parallelize`), noted by ``strategy`` and, from meta, loaded.
    ``teacher`` (whole, loaded by the caller) is frozen and split like the reference. ``lora``: the model
    section when ``model.lora_rank`` > 0: adapters are added (strop.train.lora) before the split, so FSDP shards
    them with the base weights they adapt, and the reference is the model with them off (no copy)."""
    device, meta = strategy.device, any(p.is_meta for p in model.parameters())
    kl = algo.kl_coef + algo.kl_in_reward_coef > 0
    lora_on = lora is not None and bool(lora.lora_rank)  # (its reference is the model with adapters off: no swap)
    if kl and not lora_on and algo.ref_mode == "swap" and (strategy.mode == "fsdp" or strategy.tp_size > 1 or meta):
        raise ValueError(
            "algo.ref_mode='swap' cannot swap into sharded weights (FSDP, tensor parallel, loading into "
            "shards); use ref_mode='copy'"
        )
    if meta and weights_path is None:
        raise ValueError("a model on the meta device needs weights_path: the files each rank reads its slices from")
    if strategy.cp_size > 1:
        context_parallel.enable(model)  # before the reference / critic copies, so they use it too
    if getattr(train, "activation_checkpointing", False):  # before the copies: the critic recomputes too
        if strategy.cp_size > 1:
            raise ValueError("activation checkpointing does not work with context parallel")
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5 (the older name is deprecated)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def split(module: nn.Module) -> nn.Module:
        return strategy.track(parallelize(module, strategy.dims, strategy.mesh, device.type, strategy.expert_mesh))

    def wrap(module: nn.Module, rename) -> nn.Module:
        module = split(module)
        if meta:
            load_shards(module, weights_path, device, rename)
            strategy.track(module)  # loading may have made new parameter objects
        return module

    adapters = None
    if lora_on:
        if strategy.tp_size > 1:  # (the config's rules refuse it first)
            raise ValueError(
                f"model.lora_rank={lora.lora_rank}: this run has tensor parallel {strategy.tp_size}: {LORA_NOT_SPLIT}"
            )
        if algo.estimator == "ppo":  # (the config's rules refuse it first)
            raise ValueError("LoRA adapters go on a model without a critic")
        if meta:  # the adapters go on the whole model: each rank reads it whole, then FSDP shards it with them
            load_shards(model, weights_path, device)
            meta = False
        adapters = add_adapters(
            model, lora.lora_rank, lora.lora_alpha, lora.lora_dropout, list(lora.lora_target_modules), lora.lora_init
        )
        model = adapters.model
    out = Modules(model=(model if meta else model.to(device)).train(), policy=None, adapters=adapters)
    if kl and adapters is not None:
        out.ref_off = True
    elif kl and algo.ref_mode == "copy":
        out.ref = wrap(LogprobModule(copy.deepcopy(model).eval().requires_grad_(False)), _under("lm."))
    elif kl:  # "swap": keep only the initial weights and swap them into the training module
        out.ref_state = {k: p.detach().clone() for k, p in model.named_parameters()}
    if algo.estimator == "ppo":  # the value head is not in the files: it starts at 0, as ValueModel's own init
        critic = ValueModel.from_causal_lm(copy.deepcopy(model))
        out.critic = wrap(
            (critic if meta else critic.to(device)).train(),
            lambda n: None if n.startswith("value_head.") else _under("backbone.", "model.")(n),
        )
    if teacher is not None:  # (never from the policy's files: wrapped, not loaded)
        if strategy.cp_size > 1:
            context_parallel.enable(teacher)
        out.teacher = split(LogprobModule(teacher.to(device).eval().requires_grad_(False)))
    out.policy = wrap(LogprobModule(out.model), _under("lm."))
    return out


def _under(prefix: str, replacement: str = ""):
    """Parameter names of a wrapper (``lm.model.layers.0...``) as the files name them (``model.layers.0...``)."""
    return lambda name: replacement + name[len(prefix) :] if name.startswith(prefix) else name
