"""Turn a validated Config into the live objects of a run, checking inputs before any model loads: the assembly
of parts that each build themselves from their settings (the prompt rows: strop.data.rows; the tools:
strop.rollout.toolbox; the run directory: strop.observe.run_dir; ...)."""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from strop import checkpoint
from strop.config import Config, ConfigError
from strop.agents.rollout import AgentRollout, generate as agent_generate
from strop.data.rows import prompt_rows
from strop.data.sources import DataError, PromptSampler, PromptSet
from strop.engines.base import Closable, Engine
from strop.engines.config import DECODER_OPTIONS
from strop.engines.http import check_reachable
from strop.engines.teacher import RemoteTeacher
from strop.serving.embedded import EmbeddedEngine
from strop.serving.kvdecode import unsupported_reason
from strop.setup_remote import remote_engine
from strop.parallel.collectives import resolve_bucket_bytes
from strop.parallel.dims import ParallelDims
from strop.parallel.runtime import Control
from strop.parallel.strategy import make_strategy
from strop.observe.logs import close_run_log
from strop.observe.run_dir import check_run_dir, make_run_dir
from strop.observe.tracking import require_trackers
from strop.plugins import check_signature, load_hook
from strop.rule_reasons import why_not_shared
from strop.envs.wiring import environment_hooks
from strop.rollout.reward_check import check_reward
from strop.rollout.generate import resolve_reward, rollout as default_rollout
from strop.rollout.multiturn import generate as multiturn_generate
from strop.rollout.samples_file import read_samples
from strop.rollout.toolbox import make_tools
from strop.models import load_config, load_model, load_tokenizer, meta_model, resolve_model_path
from strop.parallel.loading import unloadable
from strop.train.modules import build_modules
from strop.sync.base import WeightSync
from strop.sync.choose import choose_sync
from strop.tools import describe_tools
from strop.train.trainer import Trainer
from strop.types import SamplingParams

log = logging.getLogger(__name__)


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
    weight_sync: WeightSync | None = None  # the embedded engine's transport (a router holds its own)

    def weight_update(self) -> Callable:
        """The engine's update, ``(weights, version=...)``: through the embedded engine's transport
        (strop.sync.inprocess), or a router's own ``update_weights``, which hands it to the transport
        strop.sync.choose picked for its servers."""
        return self.weight_sync.update if self.weight_sync is not None else self.engine.update_weights

    def close(self, run=None) -> None:
        """Stop what the run started: the router's health checks and connections (``run(coroutine)``
        runs it in the run's event loop, where they were made), launched servers, and the run's run.log."""
        close = self.engine.close if isinstance(self.engine, Closable) else None
        agent = self.rollout_extra.get("agent")
        try:
            if agent is not None and run is not None:
                run(agent.close())
            if close is not None and run is not None:
                run(close())
        finally:
            try:
                for server in self.servers:
                    server.stop()
            finally:
                close_run_log()  # (the lines after it belong to no run: a program may build another)


@dataclass
class _Prepared:
    """What a rank loaded before any collective: checked inputs, the policy's weights; rank 0's data and reward."""

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


def _context_window(model_path: str, options: dict) -> int:
    return int(getattr(load_config(model_path, **options), "max_position_embeddings", 2048))


def prepare(cfg: Config, device: torch.device, controller: bool = True, resume: bool = False) -> _Prepared:
    """Every check and load that needs no other rank. Cheap checks first: run dir, layout, data,
    reward, plugins; the model path (converting the embedded model on a cold cache) after them."""
    if controller and resume:  # before anything loads or is written
        check_resumable(Path(cfg.run.dir))
    # (env.verifiers / env.openenv: the environment's tasks are the prompts)
    hooks = {n: load_hook(n, path) for n, path in cfg.plugins.model_dump().items() if path} | environment_hooks(cfg)
    reward_fn = train_rows = eval_rows = engine_model = replay = tools = None
    if controller and cfg.data.samples:  # train only: samples from a file, no prompts or engine
        if not resume:
            check_run_dir(cfg)
        replay = _read_replay(cfg)
    elif controller:
        reward_fn, tools, train_rows, eval_rows = _check_controller_inputs(cfg, hooks, resume)
    opts = cfg.model.load_options()  # attn_implementation, trust_remote_code, revision
    model_path = resolve_model_path(cfg.model.path, cfg.model.revision)  # a missing path fails here
    dims = ParallelDims.from_config(cfg.parallel)
    if dims.tp > 1 or dims.ep > 1:  # heads or experts that do not divide: said before the model loads
        dims.check_model(load_config(model_path, **opts))
    tokenizer = load_tokenizer(model_path, **opts)
    torch.manual_seed(cfg.train.seed)
    dtype = getattr(torch, cfg.model.dtype)
    weights, why = shard_source(dims, model_path, cfg.model.revision)
    if weights and cfg.model.lora_rank:
        weights, why = None, "LoRA adds its adapters to the whole model, then it is split with them"
    policy = meta_model(model_path, dtype=dtype, **opts) if weights else None
    if weights and (why := unloadable(policy, weights)):
        weights = None
    if not weights:
        policy = load_model(model_path, dtype=dtype, **opts)  # same weights on every rank
    if (weights or why) and dist.get_rank() == 0:  # (split: several ranks, so a process group)
        log.info(
            "strop: trainer weights: "
            + (
                f"each rank reads only its own slices of {weights}"
                if weights
                else f"every rank loads the whole model before it is split: {why}"
            )
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    why_not = why_not_shared(cfg, world) or (  # (one process from here on: the policy is loaded whole)
        f"strop's fast decoder cannot run this model ({reason}), and the fallback runs the model's own forward"
        if (reason := unsupported_reason(policy))
        else None
    )
    if cfg.engine.share_weights and why_not:
        raise ConfigError(f"engine.share_weights=true: {why_not}")
    if controller and cfg.engine.share_weights is not False and why_not is None:  # the trainer's own module
        engine_model = policy
    elif controller and cfg.engine.kind == "embedded" and not replay:  # the engine's copy, before the trainer shards
        engine_model = (load_model(model_path, dtype=dtype, **opts) if weights else copy.deepcopy(policy)).to(device)
        if cfg.engine.dtype != "auto":  # (bf16 decoding beside an fp32 trainer: updates are cast as they load)
            engine_model.to(dtype=getattr(torch, cfg.engine.dtype))
        engine_model.requires_grad_(False)
    return _Prepared(
        policy,
        model_path,
        tokenizer,
        hooks,
        reward_fn,
        train_rows,
        eval_rows or None,
        engine_model,
        replay,
        tools,
        weights,
    )


def check_resumable(run_dir: Path) -> None:
    """Refuse to resume a run that finished without a complete checkpoint: resuming would start it again from
    step 0 over its metrics and final model. (A run stopped before its first checkpoint starts again.)"""
    summary = run_dir / "summary.json"
    try:
        completed = json.loads(summary.read_text()).get("status") == "completed" if summary.is_file() else False
    except (ValueError, AttributeError):
        completed = False
    finished = completed or (run_dir / "final").exists()
    if finished and checkpoint.latest(run_dir) is None:
        raise ConfigError(
            f"--resume {run_dir}: the run finished and has no checkpoint to resume from (nothing complete in "
            f"{run_dir / checkpoint.CHECKPOINTS}); it is left as it is. Start a new run with another run.dir "
            "(run.save_every=N keeps checkpoints to resume from)"
        )


def _check_controller_inputs(cfg: Config, hooks: dict, resume: bool) -> tuple:
    """Rank 0's cheap checks before any model loads (run dir, layout, trackers, reward, tools, agent, prompts);
    sets the generate and rollout hooks. Returns the reward, the tools, and the train and eval rows."""
    if not resume:
        check_run_dir(cfg)
    resolve_bucket_bytes(cfg.parallel.grad_reduce_bucket_bytes)
    ParallelDims.from_config(cfg.parallel)  # the layout's refusals, before anything loads
    require_trackers(cfg.run.trackers)
    if cfg.engine.urls:  # servers the user named must answer now, not as a first step that fails every sample
        check_reachable(cfg.engine.urls)
    reward_fn = resolve_reward(cfg.rollout.reward, cfg)  # (reward.endpoint: its judge)
    tools = None
    if cfg.tools.enabled or "tools" in hooks:  # the sandbox and the tools hook: checked before the model loads
        hooks["generate"] = multiturn_generate
        tools = make_tools(cfg, hooks.get("tools"))
    if "agent" in hooks:  # each sample is a run of the user's agent against the agent proxy
        if cfg.agent.reward == "hook" and check_signature("reward", reward_fn) == "group":
            raise ConfigError(
                f"agent.reward='hook' scores each session's last answer alone; rollout.reward="
                f"{cfg.rollout.reward!r} scores whole groups: use a per-sample reward, or post "
                "rewards from the agent (agent.reward='session')"
            )
        hooks["generate"] = agent_generate
    hooks.setdefault("rollout", default_rollout)
    train_rows, eval_rows = prompt_rows(cfg, hooks.get("data_source"))
    check_reward(cfg, reward_fn, train_rows, eval_rows)
    return reward_fn, tools, train_rows, eval_rows


def shard_source(dims: ParallelDims, model_path: str, revision: str | None = None) -> tuple[str | None, str | None]:
    """(the folder of safetensors files each rank reads its slices from, None) when the trainer's weights are
    split (FSDP over several ranks, or tensor parallel) and such files exist; (None, why not) when they are
    split all the same; (None, None) when they are not split."""
    if not dims.sharded:
        return None, None
    folder = Path(model_path)
    if not folder.exists():  # a hub id: the files in the local cache (downloaded once, as from_pretrained would)
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(model_path, revision=revision, allow_patterns=["*.json", "*.safetensors"]))
    if (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file():
        return str(folder), None
    return None, f"{model_path} has no safetensors files"


def _read_replay(cfg: Config) -> dict:
    """``data.samples``: the samples of each step; the rollout settings must match the file's."""
    rollout, steps = read_samples(cfg.data.samples)
    if rollout.get("temperature") != cfg.rollout.temperature:
        raise DataError(
            f"data.samples={cfg.data.samples!r} was sampled at rollout.temperature="
            f"{rollout.get('temperature')}, this run has {cfg.rollout.temperature}: the trainer scales "
            "logits by it, so the logprobs would not compare; set --rollout.temperature to match"
        )
    missing = [k for k in range(1, cfg.train.steps + 1) if k not in steps]
    if missing:
        raise DataError(
            f"data.samples={cfg.data.samples!r} has samples for steps {sorted(steps)}, but "
            f"train.steps={cfg.train.steps} needs step {missing[0]}"
        )
    return steps


def load_teacher(cfg: Config, tokenizer):
    """On-policy distillation's teacher (``algo.distill_teacher``), in the model's dtype; refused unless it
    shares the student's tokenizer (the same token ids mean the same text), naming both and the first difference."""
    path = resolve_model_path(cfg.algo.distill_teacher)
    opts = {"trust_remote_code": cfg.model.trust_remote_code}  # (the student's revision is not the teacher's)
    theirs = load_tokenizer(path, **opts)
    mine_vocab, their_vocab = tokenizer.get_vocab(), theirs.get_vocab()
    if mine_vocab != their_vocab:
        diff = sorted(set(mine_vocab.items()) ^ set(their_vocab.items()), key=lambda kv: (kv[1], kv[0]))[0]
        raise ConfigError(
            f"algo.distill_teacher={cfg.algo.distill_teacher!r} has another tokenizer than the student "
            f"model.path={cfg.model.path!r} ({len(their_vocab)} against {len(mine_vocab)} tokens; first "
            f"difference: token {diff[0]!r} = id {diff[1]} in one only): a teacher scores the student's "
            "token ids, so both must share a tokenizer"
        )
    dtype = getattr(torch, cfg.model.dtype)
    return load_model(path, dtype=dtype, attn_implementation=cfg.model.attn_implementation, **opts)


def make_trainer(
    cfg: Config, policy, tokenizer, hooks: dict, device: torch.device, weights: str | None = None
) -> Trainer:
    """The trainer over this run's mesh (a collective under several ranks): its modules split by
    strop.parallel.parallelize before it gets them."""
    dims = ParallelDims.from_config(
        cfg.parallel, bucket_bytes=resolve_bucket_bytes(cfg.parallel.grad_reduce_bucket_bytes)
    )
    strategy = make_strategy(dims, dims.build_mesh(device.type), device)
    teacher = load_teacher(cfg, tokenizer) if cfg.algo.distill_teacher else None
    remote_teacher = None
    if cfg.algo.distill_teacher_url:
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise ConfigError(
                "algo.distill_teacher_url is asked by the trainer process for the step's samples; with "
                f"{dist.get_world_size()} trainer processes every one would ask for all of them: run one "
                "process, or load the teacher (algo.distill_teacher), which is split like the policy"
            )
        token = cfg.algo.distill_teacher_token
        remote_teacher = RemoteTeacher(
            cfg.algo.distill_teacher_url,
            cfg.algo.distill_teacher_kind,
            token=token.get_secret_value() if token else None,
        )
        remote_teacher.check_tokenizer(tokenizer, f"the student model.path={cfg.model.path!r}")  # as load_teacher
    modules = build_modules(policy, strategy, cfg.algo, cfg.train, weights, teacher, lora=cfg.model)
    if modules.adapters is not None:
        log.info(modules.adapters.describe(cfg.model, modules.ref_off))
    return Trainer(
        modules,
        pad_token_id=tokenizer.pad_token_id,
        train=cfg.train,
        algo=cfg.algo,
        rollout=cfg.rollout,
        parallel=strategy,
        hooks=hooks,
        teacher=remote_teacher,
    )


def build(
    cfg: Config, device: torch.device | None = None, control: Control | None = None, resume: bool = False
) -> Components:
    """Everything a run needs, on every rank. Set-up failures on any rank stop every rank before
    the first collective; rank 0 creates the run directory only once every rank is ready."""
    device = device or torch.device("cpu")
    control = control or Control()
    controller = control.rank == 0
    p = control.on_every_rank(prepare, cfg, device, controller, resume)
    trainer = make_trainer(cfg, p.policy, p.tokenizer, p.hooks, device, p.weights)
    parts = control.on_controller(_controller_parts, cfg, p, trainer, device, resume, share=False)
    return parts if controller else Components(trainer=trainer, hooks=p.hooks)


def _controller_parts(
    cfg: Config, p: _Prepared, trainer: Trainer, device: torch.device, resume: bool = False
) -> Components:
    tokenizer, r = p.tokenizer, cfg.rollout
    if p.replay is not None:  # train only: no prompts, no engine
        return Components(
            trainer=trainer,
            tokenizer=tokenizer,
            hooks=p.hooks,
            replay=p.replay,
            run_dir=make_run_dir(cfg, resume=resume),
        )
    context_window = _context_window(p.model_path, cfg.model.load_options())
    max_new = max(r.max_new_tokens, cfg.eval.max_new_tokens or 0)
    max_prompt = context_window - max_new
    if max_prompt <= 0:
        raise ValueError(
            f"rollout.max_new_tokens={max_new} leaves no room in the {context_window}-token context window"
        )
    train_prompts, eval_prompts = _prompt_sets(cfg, p, max_prompt)
    stop_ids = sorted({tokenizer.eos_token_id, tokenizer.pad_token_id} - {None})
    run_dir = make_run_dir(cfg, create=False, resume=resume)
    engine, servers, weight_sync = _engine(cfg, p, run_dir, train_prompts, context_window, stop_ids, device)
    sampling = SamplingParams(
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop_token_ids=stop_ids,
    )
    extra = dict(p.tools or {})
    if "agent" in p.hooks:
        extra["agent"] = AgentRollout(
            cfg, engine, tokenizer, p.hooks["agent"], context_window=context_window, stop_token_ids=stop_ids
        )
    eval_sampling = SamplingParams(
        temperature=0.0, max_new_tokens=cfg.eval.max_new_tokens or r.max_new_tokens, stop_token_ids=stop_ids
    )
    try:
        run_dir = make_run_dir(cfg, resume=resume)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return Components(
        trainer=trainer,
        tokenizer=tokenizer,
        train_prompts=train_prompts,
        eval_prompts=eval_prompts,
        sampler=PromptSampler(len(train_prompts), cfg.data.seed, cfg.data.shuffle),
        reward_fn=p.reward_fn,
        hooks=p.hooks,
        engine=engine,
        sampling=sampling,
        eval_sampling=eval_sampling,
        run_dir=run_dir,
        servers=servers,
        rollout_extra=extra,
        weight_sync=weight_sync,
    )


def _prompt_sets(cfg: Config, p: _Prepared, max_prompt: int) -> tuple[PromptSet, PromptSet | None]:
    """The train and eval prompts, templated and tokenized (the tools described in the system prompt when asked)."""
    system_prompt = cfg.data.system_prompt
    if p.tools and cfg.tools.describe:  # the model is told which tools exist and how to call them
        system_prompt = describe_tools(system_prompt, p.tools["tools"])
    prompt_kw = dict(
        template=cfg.data.prompt_template,
        system_prompt=system_prompt,
        apply_chat_template=cfg.data.apply_chat_template,
        max_prompt_tokens=max_prompt,
    )
    train_rows, eval_rows = p.train_rows, p.eval_rows
    train_prompts = PromptSet(train_rows, p.tokenizer, name=cfg.data.path or f"{cfg.data.task} (train)", **prompt_kw)
    eval_prompts = (
        PromptSet(eval_rows, p.tokenizer, name=cfg.data.eval_path or f"{cfg.data.task} (eval)", **prompt_kw)
        if eval_rows
        else None
    )
    return train_prompts, eval_prompts


def _engine(
    cfg: Config, p: _Prepared, run_dir: Path, train_prompts: PromptSet, context_window: int, stop_ids, device
) -> tuple:
    """The run's engine, the servers it launched and the embedded engine's weight transport (None for a router,
    whose transport is its own)."""
    r, e = cfg.rollout, cfg.engine
    if e.kind == "embedded":
        engine = EmbeddedEngine(
            p.engine_model,
            pad_token_id=p.tokenizer.pad_token_id,
            default_stop_token_ids=stop_ids,
            max_batch_size=r.max_batch_size,
            context_window=context_window,
            seed=r.seed,
            fast_decode=e.fast_decode,
            shared=p.engine_model is p.policy,
            batch_invariant=r.exact_logprobs,  # a sample's tokens do not depend on the batch it ran in
            **e.model_dump(include=set(DECODER_OPTIONS)),  # (strop serve's flags)
        )
        weight_sync = choose_sync(cfg, [engine], run_dir, [], device)
        weight_sync.connect(engine)
        return engine, [], weight_sync
    engine, servers = remote_engine(cfg, p.model_path, run_dir, probe_ids=train_prompts.prompt_ids[0], device=device)
    return engine, servers, None  # the router's transport is its own
