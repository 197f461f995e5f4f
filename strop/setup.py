"""Turn a validated Config into the live objects of a run, checking inputs before any model loads."""

from __future__ import annotations

import copy
import datetime as _dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from strop.config import Config
from strop.data.sources import PromptSampler, PromptSet, read_prompt_file, reasoning_gym_rows
from strop.engines.embedded import EmbeddedEngine
from strop.parallel.collectives import resolve_bucket_bytes
from strop.parallel.runtime import device_mesh_groups, parallel_layout
from strop.data.sources import DataError, PromptRow, _row_from_record
from strop.plugins import call_hook_sync, load_hook
from strop.rollout.generate import resolve_reward, rollout as default_rollout
from strop.train.model import load_model, load_tokenizer, resolve_model_path
from strop.train.trainer import Trainer
from strop.types import SamplingParams


@dataclass
class Components:
    tokenizer: Any
    train_prompts: PromptSet
    eval_prompts: PromptSet | None
    sampler: PromptSampler
    reward_fn: Callable
    hooks: dict[str, Callable]  # loaded plugins by hook name (rollout, generate, filter, postprocess, ...)
    engine: EmbeddedEngine
    trainer: Trainer
    sampling: SamplingParams
    eval_sampling: SamplingParams
    final_state: dict | None = None  # the policy's latest full weights (what the engine holds)


def _rows(cfg: Config, which: str, data_source: Callable | None = None):
    d = cfg.data
    if data_source is not None:
        records = call_hook_sync("data_source", data_source, config=d, split=which)
        rows = [_row_from_record(r, f"data_source hook {cfg.plugins.data_source} ({which}) row {i}",
                                 "prompt", "label", []) if not isinstance(r, PromptRow) else r
                for i, r in enumerate(records)]
        for r, rec in zip(rows, records):  # the hook's metadata travels as given
            if isinstance(rec, dict) and isinstance(rec.get("metadata"), dict):
                r.metadata = dict(rec["metadata"])
        if which == "train" and not rows:
            raise DataError(f"data_source hook {cfg.plugins.data_source}: no training rows")
        return rows or None
    if d.source == "reasoning_gym":
        if which == "eval":
            return reasoning_gym_rows(d.task, d.eval_seed, d.eval_size, d.task_options) if d.eval_size else None
        return reasoning_gym_rows(d.task, d.seed, d.size, d.task_options)
    if which == "eval":
        if not d.eval_path:
            return None
        rows = read_prompt_file(d.eval_path, d.prompt_key, d.label_key, d.metadata_keys)
        return rows[: d.eval_size] if d.eval_size else None
    return read_prompt_file(d.path, d.prompt_key, d.label_key, d.metadata_keys)


def _context_window(model_path: str) -> int:
    from transformers import AutoConfig

    return int(getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", 2048))


def make_trainer(cfg: Config, policy, tokenizer, hooks: dict) -> Trainer:
    r = cfg.rollout
    dp_group = cp_group = None
    if dist.is_initialized():
        dp_group, cp_group = device_mesh_groups(cfg.parallel.context_parallel_size)
    return Trainer(policy, pad_token_id=tokenizer.pad_token_id, train=cfg.train, algo=cfg.algo,
                   temperature=r.temperature, max_new_tokens=r.max_new_tokens,
                   advantage_fn=hooks.get("advantage"), policy_loss_fn=hooks.get("policy_loss"),
                   dp_group=dp_group, cp_group=cp_group,
                   bucket_bytes=resolve_bucket_bytes(cfg.parallel.grad_reduce_bucket_bytes),
                   dp_mode=cfg.parallel.dp_mode, fsdp_mixed_precision=cfg.parallel.fsdp_mixed_precision)


def build_worker(cfg: Config) -> Trainer:
    """A data-parallel rank other than the controller: the policy and its trainer, nothing else."""
    model_path = resolve_model_path(cfg.model.path)
    hooks = {name: load_hook(name, path) for name, path in cfg.plugins.model_dump().items() if path}
    torch.manual_seed(cfg.train.seed)
    policy = load_model(model_path, dtype=getattr(torch, cfg.model.dtype))  # same weights as rank 0
    return make_trainer(cfg, policy, load_tokenizer(model_path), hooks)


def build(cfg: Config) -> Components:
    """Everything a run needs. Cheap checks first: run dir, model path, data, reward, then the weights."""
    check_run_dir(cfg)
    resolve_bucket_bytes(cfg.parallel.grad_reduce_bucket_bytes)
    parallel_layout(dist.get_world_size() if dist.is_initialized() else 1, cfg.parallel.context_parallel_size)
    model_path = resolve_model_path(cfg.model.path)  # a missing path fails here
    tokenizer = load_tokenizer(model_path)
    reward_fn = resolve_reward(cfg.rollout.reward)
    # every hook is imported and its signature checked here, before any model loads
    hooks = {name: load_hook(name, path) for name, path in cfg.plugins.model_dump().items() if path}
    hooks.setdefault("rollout", default_rollout)
    context_window = _context_window(model_path)
    max_new = max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens or 0)
    max_prompt = context_window - max_new
    if max_prompt <= 0:
        raise ValueError(f"rollout.max_new_tokens={max_new} leaves no room in the {context_window}-token context window")
    prompt_kw = dict(template=cfg.data.prompt_template, system_prompt=cfg.data.system_prompt,
                     apply_chat_template=cfg.data.apply_chat_template, max_prompt_tokens=max_prompt)
    train_prompts = PromptSet(_rows(cfg, "train", hooks.get("data_source")), tokenizer, name=cfg.data.path or f"{cfg.data.task} (train)", **prompt_kw)
    eval_rows = _rows(cfg, "eval", hooks.get("data_source"))
    eval_prompts = PromptSet(eval_rows, tokenizer, name=cfg.data.eval_path or f"{cfg.data.task} (eval)", **prompt_kw) if eval_rows else None

    torch.manual_seed(cfg.train.seed)
    dtype = getattr(torch, cfg.model.dtype)
    policy = load_model(model_path, dtype=dtype)
    engine_model = copy.deepcopy(policy)  # the engine holds its own copy; weights reach it by update
    for p in engine_model.parameters():
        p.requires_grad_(False)
    stop_ids = sorted({tokenizer.eos_token_id, *([tokenizer.pad_token_id] if tokenizer.pad_token_id is not None else [])} - {None})
    engine = EmbeddedEngine(engine_model, pad_token_id=tokenizer.pad_token_id, default_stop_token_ids=stop_ids,
                            max_batch_size=cfg.rollout.max_batch_size, context_window=context_window,
                            seed=cfg.rollout.seed)
    r = cfg.rollout
    trainer = make_trainer(cfg, policy, tokenizer, hooks)
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, stop_token_ids=stop_ids)
    eval_sampling = SamplingParams(temperature=0.0, max_new_tokens=cfg.eval.max_new_tokens or r.max_new_tokens,
                                   stop_token_ids=stop_ids)
    return Components(tokenizer, train_prompts, eval_prompts, PromptSampler(len(train_prompts), cfg.data.seed, cfg.data.shuffle),
                      reward_fn, hooks, engine, trainer, sampling, eval_sampling)


def check_run_dir(cfg: Config) -> None:
    """Refuse an existing, non-empty run directory: a run never writes over another's outputs."""
    if cfg.run.dir and Path(cfg.run.dir).exists() and any(Path(cfg.run.dir).iterdir()):
        raise FileExistsError(f"run.dir={cfg.run.dir!r} already exists and is not empty; choose a new one")


def make_run_dir(cfg: Config) -> Path:
    check_run_dir(cfg)
    if cfg.run.dir:
        run_dir = Path(cfg.run.dir)
    else:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = Path("runs") / stamp
        n = 1
        while run_dir.exists():
            run_dir, n = Path("runs") / f"{stamp}-{n}", n + 1
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir
