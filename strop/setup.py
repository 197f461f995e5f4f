"""Turn a validated Config into the live objects of a run, checking inputs before any model loads."""

from __future__ import annotations

import copy
import datetime as _dt
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from strop.config import Config, ConfigError
from strop.data.sources import (DataError, PromptRow, PromptSampler, PromptSet, _row_from_record, held_out,
                                read_prompt_file, reasoning_gym_rows)
from strop.engines.base import Engine
from strop.serving.embedded import EmbeddedEngine
from strop.serving.kvdecode import unsupported_reason
from strop.parallel.collectives import resolve_bucket_bytes
from strop.parallel.runtime import Control, device_mesh_groups, parallel_layout, tensor_parallel_mesh
from strop.observe.tracking import require_trackers
from strop.plugins import PluginError, call_hook_sync, check_signature, load_hook
from strop.rollout.generate import resolve_reward, rollout as default_rollout
from strop.models import load_model, load_tokenizer, meta_model, resolve_model_path
from strop.parallel.loading import unloadable
from strop.train.trainer import Trainer
from strop.types import SamplingParams


LABELLED_REWARDS = ("math", "exact_match")  # built-in rewards that compare with a row's label


@dataclass
class Components:
    """The live objects of a run. On ranks other than 0 only ``trainer`` is set: rank 0 (the
    controller) owns the data, the engine and every output."""

    trainer: Trainer
    tokenizer: Any = None
    train_prompts: PromptSet | None = None
    eval_prompts: PromptSet | None = None
    sampler: PromptSampler | None = None
    reward_fn: Callable | None = None
    hooks: dict[str, Callable] = field(default_factory=dict)  # loaded plugins by hook name
    engine: Engine | None = None
    sampling: SamplingParams | None = None
    eval_sampling: SamplingParams | None = None
    run_dir: Path | None = None
    servers: list = field(default_factory=list)  # strop serve processes this run started (engine.launch)
    replay: dict | None = None  # train only (data.samples): the file's samples by step
    rollout_extra: dict = field(default_factory=dict)  # RolloutContext.extra: tools and turn limits (tools.enabled)

    def close(self, run=None) -> None:
        """Stop what the run started: the router's health checks and connections (``run(coroutine)``
        runs it in the run's event loop, where they were made), and launched servers."""
        close = getattr(self.engine, "close", None)
        agent = self.rollout_extra.get("agent")
        try:
            if agent is not None and run is not None:
                run(agent.close())
            if close is not None and run is not None:
                run(close())
        finally:
            for server in self.servers:
                server.stop()


@dataclass
class _Prepared:
    """What a rank loaded before any collective: checked inputs and the policy's weights.
    The last four are rank 0's only (the controller's data, reward and engine copy)."""

    policy: Any
    model_path: str
    tokenizer: Any
    hooks: dict[str, Callable]
    reward_fn: Callable | None = None
    train_rows: list | None = None
    eval_rows: list | None = None
    engine_model: Any = None
    replay: dict | None = None
    tools: dict | None = None  # RolloutContext.extra for multi-turn rollouts (make_tools)
    weights: str | None = None  # the policy is on the meta device: its slices are read from these files


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
        if which == "eval":  # oversample: duplicates of training prompts are removed afterwards
            return reasoning_gym_rows(d.task, d.eval_seed, d.eval_size * d.eval_oversample, d.task_options) \
                if d.eval_size else None
        return reasoning_gym_rows(d.task, d.seed, d.size, d.task_options)
    if which == "eval":
        return read_prompt_file(d.eval_path, d.prompt_key, d.label_key, d.metadata_keys) if d.eval_path else None
    return read_prompt_file(d.path, d.prompt_key, d.label_key, d.metadata_keys)


def _check_labels(cfg: Config, rows, which: str) -> None:
    if cfg.rollout.reward in LABELLED_REWARDS:
        missing = [r for r in rows if r.label is None]
        if missing:
            raise DataError(f"{missing[0].where or which}: no label (key {cfg.data.label_key!r}), and "
                            f"rollout.reward={cfg.rollout.reward!r} compares answers with labels "
                            f"({len(missing)} of {len(rows)} {which} rows have none)")


def _held_out_rows(cfg: Config, train_rows, eval_rows):
    """Eval rows that never occur in the training data (by templated prompt), at most data.eval_size."""
    d = cfg.data
    kept, removed = held_out(eval_rows, train_rows, template=d.prompt_template, system_prompt=d.system_prompt,
                             size=d.eval_size)
    if removed:
        print(f"strop: held-out set: removed {removed} of {len(eval_rows)} eval prompts that occur in the training "
              f"prompts (or twice in the eval set); {len(kept)} remain", flush=True)
    if len(kept) < min(d.eval_min_size, d.eval_size or len(eval_rows), len(eval_rows)):  # a small set is fine as given
        raise DataError(f"only {len(kept)} held-out prompts remain after removing {removed} that occur in the "
                        f"training data (data.eval_min_size={d.eval_min_size}); use a larger or different eval set")
    return kept


def _context_window(model_path: str) -> int:
    from transformers import AutoConfig

    return int(getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", 2048))


def prepare(cfg: Config, device: torch.device, controller: bool = True, resume: bool = False) -> _Prepared:
    """Every check and load that needs no other rank. Cheap checks first: run dir, layout, data,
    reward, plugins; the model path (converting the embedded model on a cold cache) after them."""
    hooks = {name: load_hook(name, path) for name, path in cfg.plugins.model_dump().items() if path}
    reward_fn = train_rows = eval_rows = engine_model = replay = tools = None
    if controller and cfg.data.samples:  # train only: samples from a file, no prompts or engine
        if not resume:
            check_run_dir(cfg)
        replay = _read_replay(cfg)
    elif controller:
        if not resume:
            check_run_dir(cfg)
        resolve_bucket_bytes(cfg.parallel.grad_reduce_bucket_bytes)
        parallel_layout(dist.get_world_size() if dist.is_initialized() else 1, cfg.parallel.context_parallel_size,
                        cfg.parallel.tensor_parallel_size)
        require_trackers(cfg.run.trackers)
        reward_fn = resolve_reward(cfg.rollout.reward)
        if cfg.tools.enabled or "tools" in hooks:  # the sandbox and the tools hook: checked before the model loads
            from strop.rollout.multiturn import generate as multiturn_generate

            hooks["generate"] = multiturn_generate
            tools = make_tools(cfg, hooks.get("tools"))
        if "agent" in hooks:  # each sample is a run of the user's agent against the agent proxy
            from strop.agents.rollout import generate as agent_generate

            if cfg.agent.reward == "hook" and check_signature("reward", reward_fn) == "group":
                raise ConfigError(f"agent.reward='hook' scores each session's last answer alone; rollout.reward="
                                  f"{cfg.rollout.reward!r} scores whole groups: use a per-sample reward, or post "
                                  "rewards from the agent (agent.reward='session')")
            hooks["generate"] = agent_generate
        hooks.setdefault("rollout", default_rollout)
        train_rows = _rows(cfg, "train", hooks.get("data_source"))
        _check_labels(cfg, train_rows, "training")
        eval_rows = _rows(cfg, "eval", hooks.get("data_source")) if cfg.data.eval_size else None
        if eval_rows:
            eval_rows = _held_out_rows(cfg, train_rows, eval_rows)
            _check_labels(cfg, eval_rows, "eval")
    model_path = resolve_model_path(cfg.model.path)  # a missing path fails here
    if cfg.parallel.tensor_parallel_size > 1:  # heads that do not divide: said before the model loads
        from transformers import AutoConfig

        from strop.parallel.tensor import check_tensor_parallel

        check_tensor_parallel(AutoConfig.from_pretrained(model_path), cfg.parallel.tensor_parallel_size)
    tokenizer = load_tokenizer(model_path)
    torch.manual_seed(cfg.train.seed)
    dtype = getattr(torch, cfg.model.dtype)
    weights, why = shard_source(cfg, model_path)
    policy = meta_model(model_path, dtype=dtype) if weights else None
    if weights and (why := unloadable(policy, weights)):
        weights = None
    if not weights:
        policy = load_model(model_path, dtype=dtype)  # same weights on every rank
    if (weights or why) and dist.get_rank() == 0:  # (split: several ranks, so a process group)
        print("strop: trainer weights: " + (f"each rank reads only its own slices of {weights}" if weights else
                                            f"every rank loads the whole model before it is split: {why}"), flush=True)
    world = dist.get_world_size() if dist.is_initialized() else 1
    why_not = cfg.why_not_shared(world) or (  # (one process from here on: the policy is loaded whole)
        f"strop's fast decoder cannot run this model ({reason}), and the fallback runs the model's own forward"
        if (reason := unsupported_reason(policy)) else None)
    if cfg.engine.share_weights and why_not:
        raise ConfigError(f"engine.share_weights=true: {why_not}")
    if controller and cfg.engine.share_weights is not False and why_not is None:  # the trainer's own module
        engine_model = policy
    elif controller and cfg.engine.kind == "embedded" and not replay:  # the engine's copy, before the trainer shards
        engine_model = (load_model(model_path, dtype=dtype) if weights else copy.deepcopy(policy)).to(device)
        if cfg.engine.dtype != "auto":  # (bf16 decoding beside an fp32 trainer: updates are cast as they load)
            engine_model.to(dtype=getattr(torch, cfg.engine.dtype))
        engine_model.requires_grad_(False)
    return _Prepared(policy, model_path, tokenizer, hooks, reward_fn, train_rows, eval_rows or None, engine_model,
                     replay, tools, weights)


def shard_source(cfg: Config, model_path: str) -> tuple[str | None, str | None]:
    """(the folder of safetensors files each rank reads its slices from, None) when the trainer's weights are
    split (FSDP over several ranks, or tensor parallel) and such files exist; (None, why not) when they are
    split all the same; (None, None) when they are not split."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1 or (cfg.parallel.dp_mode != "fsdp" and cfg.parallel.tensor_parallel_size == 1):
        return None, None
    folder = Path(model_path)
    if not folder.exists():  # a hub id: the files in the local cache (downloaded once, as from_pretrained would)
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(model_path, allow_patterns=["*.json", "*.safetensors"]))
    if (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file():
        return str(folder), None
    return None, f"{model_path} has no safetensors files"


def _read_replay(cfg: Config) -> dict:
    """``data.samples``: the samples of each step; the rollout settings must match the file's."""
    from strop.rollout.samples_file import read_samples

    rollout, steps = read_samples(cfg.data.samples)
    if rollout.get("temperature") != cfg.rollout.temperature:
        raise DataError(f"data.samples={cfg.data.samples!r} was sampled at rollout.temperature="
                        f"{rollout.get('temperature')}, this run has {cfg.rollout.temperature}: the trainer scales "
                        "logits by it, so the logprobs would not compare; set --rollout.temperature to match")
    missing = [k for k in range(1, cfg.train.steps + 1) if k not in steps]
    if missing:
        raise DataError(f"data.samples={cfg.data.samples!r} has samples for steps {sorted(steps)}, but "
                        f"train.steps={cfg.train.steps} needs step {missing[0]}")
    return steps


def load_teacher(cfg: Config, tokenizer):
    """On-policy distillation's teacher (``algo.distill_teacher``), in the model's dtype; refused unless it
    shares the student's tokenizer (the same token ids mean the same text), naming both and the first difference."""
    path = resolve_model_path(cfg.algo.distill_teacher)
    theirs = load_tokenizer(path)
    mine_vocab, their_vocab = tokenizer.get_vocab(), theirs.get_vocab()
    if mine_vocab != their_vocab:
        diff = sorted(set(mine_vocab.items()) ^ set(their_vocab.items()), key=lambda kv: (kv[1], kv[0]))[0]
        raise ConfigError(f"algo.distill_teacher={cfg.algo.distill_teacher!r} has another tokenizer than the student "
                          f"model.path={cfg.model.path!r} ({len(their_vocab)} against {len(mine_vocab)} tokens; first "
                          f"difference: token {diff[0]!r} = id {diff[1]} in one only): a teacher scores the student's "
                          "token ids, so both must share a tokenizer")
    return load_model(path, dtype=getattr(torch, cfg.model.dtype))


def make_trainer(cfg: Config, policy, tokenizer, hooks: dict, device: torch.device, weights: str | None = None
                 ) -> Trainer:
    """The trainer with this rank's data- and context-parallel groups (a collective under several ranks)."""
    r = cfg.rollout
    dp_group = cp_group = None
    meshes = {}
    if dist.is_initialized() and cfg.parallel.tensor_parallel_size > 1:
        dp_group, meshes["dp_mesh"], meshes["tp_mesh"] = tensor_parallel_mesh(cfg.parallel.tensor_parallel_size,
                                                                              device.type)
    elif dist.is_initialized():
        dp_group, cp_group = device_mesh_groups(cfg.parallel.context_parallel_size, device.type)
    teacher = load_teacher(cfg, tokenizer) if cfg.algo.distill_teacher else None
    remote_teacher = None
    if cfg.algo.distill_teacher_url:
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise ConfigError("algo.distill_teacher_url is asked by the trainer process for the step's samples; with "
                              f"{dist.get_world_size()} trainer processes every one would ask for all of them: run one "
                              "process, or load the teacher (algo.distill_teacher), which is split like the policy")
        from strop.engines.teacher import RemoteTeacher

        token = cfg.algo.distill_teacher_token
        remote_teacher = RemoteTeacher(cfg.algo.distill_teacher_url, cfg.algo.distill_teacher_kind,
                                       token=token.get_secret_value() if token else None)
        remote_teacher.check_tokenizer(tokenizer, f"the student model.path={cfg.model.path!r}")  # as load_teacher
    return Trainer(policy, pad_token_id=tokenizer.pad_token_id, train=cfg.train, algo=cfg.algo,
                   temperature=r.temperature, max_new_tokens=r.max_new_tokens, teacher=teacher,
                   remote_teacher=remote_teacher,
                   advantage_fn=hooks.get("advantage"), policy_loss_fn=hooks.get("policy_loss"),
                   dp_group=dp_group, cp_group=cp_group,
                   bucket_bytes=resolve_bucket_bytes(cfg.parallel.grad_reduce_bucket_bytes),
                   dp_mode=cfg.parallel.dp_mode, fsdp_mixed_precision=cfg.parallel.fsdp_mixed_precision,
                   device=device, bf16_autocast=cfg.train.bf16_autocast, exact_logprobs=r.exact_logprobs, weights_path=weights,
                   sequence_parallel=cfg.parallel.sequence_parallel, **meshes)


def build(cfg: Config, device: torch.device | None = None, control: Control | None = None,
          resume: bool = False) -> Components:
    """Everything a run needs, on every rank. Set-up failures on any rank stop every rank before
    the first collective; rank 0 creates the run directory only once every rank is ready."""
    device = device or torch.device("cpu")
    control = control or Control()
    controller = control.rank == 0
    p = control.on_every_rank(prepare, cfg, device, controller, resume)
    trainer = make_trainer(cfg, p.policy, p.tokenizer, p.hooks, device, p.weights)
    parts = control.on_controller(_controller_parts, cfg, p, trainer, device, resume, share=False)
    return parts if controller else Components(trainer=trainer, hooks=p.hooks)


def _controller_parts(cfg: Config, p: _Prepared, trainer: Trainer, device: torch.device,
                      resume: bool = False) -> Components:
    tokenizer, r = p.tokenizer, cfg.rollout
    if p.replay is not None:  # train only: no prompts, no engine
        return Components(trainer=trainer, tokenizer=tokenizer, hooks=p.hooks, replay=p.replay,
                          run_dir=make_run_dir(cfg, resume=resume))
    context_window = _context_window(p.model_path)
    max_new = max(r.max_new_tokens, cfg.eval.max_new_tokens or 0)
    max_prompt = context_window - max_new
    if max_prompt <= 0:
        raise ValueError(f"rollout.max_new_tokens={max_new} leaves no room in the {context_window}-token context window")
    system_prompt = cfg.data.system_prompt
    if p.tools and cfg.tools.describe:  # the model is told which tools exist and how to call them
        from strop.tools import describe_tools

        system_prompt = describe_tools(system_prompt, p.tools["tools"])
    prompt_kw = dict(template=cfg.data.prompt_template, system_prompt=system_prompt,
                     apply_chat_template=cfg.data.apply_chat_template, max_prompt_tokens=max_prompt)
    train_rows, eval_rows = p.train_rows, p.eval_rows
    train_prompts = PromptSet(train_rows, tokenizer, name=cfg.data.path or f"{cfg.data.task} (train)", **prompt_kw)
    eval_prompts = PromptSet(eval_rows, tokenizer, name=cfg.data.eval_path or f"{cfg.data.task} (eval)",
                             **prompt_kw) if eval_rows else None
    stop_ids = sorted({tokenizer.eos_token_id, *([tokenizer.pad_token_id] if tokenizer.pad_token_id is not None else [])} - {None})
    run_dir = make_run_dir(cfg, create=False, resume=resume)
    if cfg.engine.kind == "embedded":
        engine, servers = EmbeddedEngine(p.engine_model, pad_token_id=tokenizer.pad_token_id,
                                         default_stop_token_ids=stop_ids, max_batch_size=r.max_batch_size,
                                         context_window=context_window, seed=r.seed,
                                         fast_decode=cfg.engine.fast_decode,
                                         shared=p.engine_model is p.policy), []
    else:
        engine, servers = remote_engine(cfg, p.model_path, run_dir, probe_ids=train_prompts.prompt_ids[0],
                                        device=device)
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, stop_token_ids=stop_ids)
    extra = dict(p.tools or {})
    if "agent" in p.hooks:
        from strop.agents.rollout import AgentRollout

        extra["agent"] = AgentRollout(cfg, engine, tokenizer, p.hooks["agent"], context_window=context_window,
                                      stop_token_ids=stop_ids)
    eval_sampling = SamplingParams(temperature=0.0, max_new_tokens=cfg.eval.max_new_tokens or r.max_new_tokens,
                                   stop_token_ids=stop_ids)
    try:
        run_dir = make_run_dir(cfg, resume=resume)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return Components(trainer=trainer, tokenizer=tokenizer, train_prompts=train_prompts, eval_prompts=eval_prompts,
                      sampler=PromptSampler(len(train_prompts), cfg.data.seed, cfg.data.shuffle),
                      reward_fn=p.reward_fn, hooks=p.hooks, engine=engine, sampling=sampling,
                      eval_sampling=eval_sampling, run_dir=run_dir, servers=servers, rollout_extra=extra)


def make_tools(cfg: Config, hook: Callable | None = None) -> dict:
    """The tools of ``tools.enabled`` (the python tool's sandbox chosen now: refused here when
    there is no isolation and it was not turned off by name), the ``plugins.tools`` hook's
    tools, and the turn limits."""
    from strop.rollout.multiturn import TurnLimits
    from strop.tools import CALCULATOR, ToolSet, python_tool
    from strop.tools.sandbox import Limits, Sandbox

    t = cfg.tools
    tools = []
    if "python" in t.enabled:
        box = Sandbox(Limits(timeout_s=t.timeout_s, cpu_s=t.cpu_s, memory_mb=t.memory_mb, processes=t.processes,
                             memory_total_mb=t.memory_total_mb, tmp_mb=t.tmp_mb, tmp_files=t.tmp_files),
                      isolation=t.sandbox, max_concurrency=t.concurrency, nested_userns=t.nested_userns)
        print(f"strop: tools: python in {box.describe()}", flush=True)
        tools.append(python_tool(box))
    if "calculator" in t.enabled:
        tools.append(CALCULATOR)
    origin = {}  # tool name -> where it came from, for errors
    if hook is not None:
        own = call_hook_sync("tools", hook, config=t)
        origin = {x.name: f"tools hook {cfg.plugins.tools}" for x in own}
        clash = sorted({x.name for x in own} & {x.name for x in tools})
        if clash:
            raise PluginError(f"tools hook {cfg.plugins.tools!r} gives tool(s) {clash}, which tools.enabled "
                              f"({t.enabled}) already has: rename yours or drop the built-in")
        tools += own
        print(f"strop: tools: {', '.join(x.name for x in own)} from {cfg.plugins.tools}", flush=True)
    return {"tools": ToolSet(tools, origin, threads=t.tool_threads, timeout_s=t.timeout_s),
            "call_reward": (t.call_reward, t.max_call_reward),
            "turn_limits": TurnLimits(max_turns=t.max_turns, max_turn_tokens=t.max_turn_tokens,
                                      output_chars=t.output_chars, output_tokens=t.output_tokens)}


def remote_engine(cfg: Config, model_path: str, run_dir: Path, probe_ids: list[int], device=None):
    """A router over HTTP engines (launched here, or at engine.urls) and the servers it launched.
    Launched servers require engine.token, or a token made for this run when none is set; they are
    stopped again if anything after their start fails."""
    import secrets

    from strop.engines.launch import launch_servers

    e = cfg.engine
    if e.launch and "STROP_ENGINE_URLS" in os.environ:  # the Ray launcher's engine actors (strop.cluster), not ours
        return _router(cfg, json.loads(os.environ["STROP_ENGINE_URLS"]), e.token.get_secret_value(), run_dir,
                       probe_ids, device), []
    token = e.token.get_secret_value() if e.token else secrets.token_urlsafe(32) if e.launch else None
    weights_dir = Path(e.sync_dir or run_dir / "weights").resolve()  # the only folder the servers may load from
    servers = launch_servers(e.launch, model_path, args=[*e.launch_args, f"--weights-dir={weights_dir}"],
                             token=token) if e.launch else []
    try:
        return _router(cfg, [s.url for s in servers] or e.urls, token, run_dir, probe_ids, device), servers
    except BaseException:
        for server in servers:
            server.stop()
        raise


def _router(cfg: Config, urls: list[str], token: str | None, run_dir: Path, probe_ids: list[int], device=None):
    """The router over the servers at ``urls``; weights reach them by broadcast or through disk (engine.sync,
    'auto' resolved here and printed with its reason). vLLM servers are probed first: one whose logprobs
    ignore the temperature is refused, and one without strop's worker extension cannot take a broadcast."""
    import asyncio

    from strop.wire.errors import EngineRequestError, EngineUnavailable
    from strop.engines.http import SGLangEngine, WeightWriter
    from strop.engines.router import Router
    from strop.engines.sync import BroadcastSync
    from strop.engines.vllm import VLLMEngine

    e = cfg.engine
    writer = WeightWriter(e.sync_dir or run_dir / "weights", bucket_bytes=e.sync_bucket_bytes)
    kind = VLLMEngine if e.kind == "vllm" else SGLangEngine
    clients = [kind(u, timeout_s=e.timeout_s, retries=e.retries, token=token, writer=writer,
                    require_checksum=e.kind == "strop") for u in urls]
    sync, why = e.sync, "engine.sync"

    async def probe():
        nonlocal sync, why
        try:
            if e.kind == "vllm":
                for c in clients:
                    await c.check_logprobs(cfg.rollout.temperature, probe_ids)
            if sync in ("auto", "broadcast") and e.kind != "strop":  # (strop serve always takes one)
                try:
                    for c in clients:
                        await c.check_broadcast()
                except EngineRequestError as exc:
                    if sync == "broadcast":
                        raise
                    sync, why = "disk", f"auto: {exc}"
                except EngineUnavailable:  # down at start: the router takes it in when it answers; an SGLang
                    if e.kind == "vllm":  # server too old for the broadcast is named at its first update
                        raise
            if sync == "auto":
                sync, why = "broadcast", f"auto: every {e.kind} server takes a broadcast"
        finally:
            for c in clients:
                await c.close()  # connections belong to the run's event loop, made later
    asyncio.run(probe())
    print(f"strop: weight sync: {sync} ({why}); receipt: {weight_receipt(e.kind, sync)}", flush=True)
    broadcast = None
    if sync == "broadcast":
        backend = e.sync_backend if e.sync_backend != "auto" else (
            "nccl" if device is not None and device.type == "cuda" else "gloo")
        broadcast = BroadcastSync(bucket_bytes=e.sync_bucket_bytes, backend=backend, timeout_s=e.timeout_s,
                                  pause_mode=e.sync_pause, dtype=e.sync_dtype,
                                  host=os.environ.get("STROP_NODE_IP", "127.0.0.1"))  # where engines reach rank 0
    router = Router(clients, writer=writer, health_interval_s=e.health_interval_s, affinity=e.affinity,
                    broadcast=broadcast, delta=sync == "delta", drain_timeout_s=e.timeout_s)
    import torch.distributed as dist

    sharded = dist.is_initialized() and dist.get_world_size() > 1 and (
        cfg.parallel.dp_mode == "fsdp" or cfg.parallel.tensor_parallel_size > 1)
    if e.sync_probe and sharded:  # the trainer's forward is a collective of every rank there, the probe rank 0's
        print("strop: weight probe: off under parallel.dp_mode=fsdp and tensor parallel (receipt: versions and "
              "checksums)", flush=True)
    router.probe_ids = list(probe_ids[:PROBE_TOKENS]) if e.sync_probe and not sharded else None
    router.probe_tolerance = e.sync_probe_tolerance
    return router


PROBE_TOKENS = 16  # tokens of the first training prompt scored by the weight probe


def weight_receipt(kind: str, sync: str) -> str:
    """How each engine kind proves it holds the weights it was sent (printed at start)."""
    if sync == "broadcast":
        return {"strop": "the checksum of the tensors each server holds (/weights_checker), and the version it reports",
                "vllm": "the checksum of every byte strop's worker extension received, that every parameter was "
                        "written, and the version each server reports (/weight_info)",
                "sglang": "the version each server reports (/model_info) after the update; SGLang's own checksums "
                          "cover its fused tensors, which the trainer cannot reproduce, so no byte-for-byte check"}[kind]
    if kind == "strop":
        return {"disk": "the checksum of the file each server loaded, and the version it reports",
                "delta": "each changed tensor's digest, checked by the server, and the version it reports"}[sync]
    route = "/model_info" if kind == "sglang" else "/weight_info"
    return (f"the version each server reports ({route}), read back after every load; {kind} reports no checksum "
            "strop can compare, so a load is not checked byte for byte")


def check_run_dir(cfg: Config) -> None:
    """Refuse an existing, non-empty run directory: a run never writes over another's outputs."""
    if cfg.run.dir and Path(cfg.run.dir).exists() and any(Path(cfg.run.dir).iterdir()):
        raise FileExistsError(f"run.dir={cfg.run.dir!r} already exists and is not empty; choose a new one")


def make_run_dir(cfg: Config, create: bool = True, resume: bool = False) -> Path:
    """The run directory (``runs/<timestamp>`` unless run.dir is set); ``create=False`` only names it.
    ``resume``: the existing run.dir, written into again."""
    if resume:
        if not cfg.run.dir or not (Path(cfg.run.dir) / "config.yaml").is_file():
            raise FileNotFoundError(f"resume: {cfg.run.dir!r} is not a strop run directory (no config.yaml)")
        return Path(cfg.run.dir)
    check_run_dir(cfg)
    if cfg.run.dir:
        run_dir = Path(cfg.run.dir)
    else:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = Path("runs") / stamp
        n = 1
        while run_dir.exists():
            run_dir, n = Path("runs") / f"{stamp}-{n}", n + 1
        if not create:
            cfg.run.dir = str(run_dir)  # the same name when it is created
    if create:
        run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir
