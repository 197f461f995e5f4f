"""The driver: rollout → rewards → advantages → train → sync weights → log → eval, per step."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import torch

from strop.config import Config, save_config
from strop.observe.metrics import MetricsLog, Progress, Timer, plot_curves, write_summary
from strop.plugins import call_hook, call_hook_sync
from strop.rollout.generate import RolloutContext, rollout_groups
from strop.parallel.runtime import broadcast_object, init_from_env
from strop.setup import Components, build, build_worker, make_run_dir


def train(cfg: Config) -> dict | None:
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    rank, _ = init_from_env()
    if rank != 0:  # a data-parallel rank: train on what the controller sends until it says stop
        trainer = build_worker(cfg)
        while (samples := broadcast_object()) is not None:
            trainer.step(samples)
            trainer.state_dict()  # FSDP gathers the full weights for rank 0's engine: every rank joins
        return None
    c = build(cfg)  # every input is checked here, before the run directory exists
    run_dir = make_run_dir(cfg)
    print(f"strop: run directory {run_dir}", flush=True)
    t = c.trainer
    if t.world > 1:
        print(f"strop: {t.world} processes = data parallel {t.dp_size} ({t.dp_mode}) x context parallel {t.cp_size}",
              flush=True)
    save_config(cfg, run_dir / "config.yaml")
    log, clock = MetricsLog(run_dir), Timer()
    ctx = RolloutContext(engine=c.engine, tokenizer=c.tokenizer, config=cfg, generate=c.hooks.get("generate"),
                         reward=c.reward_fn, filter=c.hooks.get("filter"))
    progress = Progress(cfg.train.steps, enabled=cfg.run.progress)
    try:
        evaluate(c, ctx, log, progress, step=0)
        for step in range(1, cfg.train.steps + 1):
            t_step, ctx.step = time.perf_counter(), step
            groups, drawn = asyncio.run(rollout_step(cfg, c, ctx))
            metrics = rollout_metrics(groups, time.perf_counter() - t_step) | {"groups_drawn": drawn}
            samples = [s for g in groups for s in g if s.status.trainable]  # aborted / failed never train
            if "postprocess" in c.hooks:
                samples = call_hook_sync("postprocess", c.hooks["postprocess"], samples=samples, step=step)
            metrics |= c.trainer.step(broadcast_object(samples))  # every rank: advantages, loss, optimizer step(s)
            c.final_state = c.trainer.state_dict()  # the full weights, gathered if sharded
            asyncio.run(c.engine.update_weights(c.final_state, version=step))
            log.log(metrics | {"step": step, "step_seconds": time.perf_counter() - t_step, "elapsed_seconds": clock()})
            progress.update(1, reward=metrics["reward_mean"])
            if step == cfg.train.steps or (cfg.eval.every and step % cfg.eval.every == 0):
                evaluate(c, ctx, log, progress, step)
    except BaseException as exc:  # leave a summary that says the run did not finish, then re-raise
        write_summary(run_dir, {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                                "steps": sum("reward_mean" in r for r in log.rows), "wall_seconds": round(clock(), 1)})
        raise
    finally:
        progress.close()
        broadcast_object(None)  # data-parallel ranks stop
    return finish(cfg, c, run_dir, log, clock())


async def rollout_step(cfg: Config, c: Components, ctx: RolloutContext) -> tuple[list, int]:
    """Groups for one step through the rollout hook; refill groups a filter dropped, a few rounds at most."""
    groups, drawn = [], 0
    for _ in range(cfg.rollout.filter_max_rounds if "filter" in c.hooks else 1):
        want = cfg.rollout.prompts_per_step - len(groups)
        new = [c.train_prompts.make_group(i, cfg.rollout.n_samples_per_prompt, gid) for i, gid in c.sampler.draw(want)]
        drawn += len(new)
        groups += await call_hook("rollout", c.hooks["rollout"], ctx=ctx, groups=new, sampling=c.sampling)
        if len(groups) >= cfg.rollout.prompts_per_step:
            break
    if not any(s.status.trainable for g in groups for s in g):
        raise RuntimeError(f"step {ctx.step}: no trainable sample after {drawn} prompts "
                           "(every group filtered out, or every sample aborted/failed)")
    return groups, drawn


def evaluate(c: Components, ctx: RolloutContext, log: MetricsLog, progress: Progress, step: int) -> None:
    """Greedy accuracy on the held-out prompts (fraction with reward 1), logged at ``step``."""
    if c.eval_prompts is None:
        return
    t = time.perf_counter()
    groups = [c.eval_prompts.make_group(i, 1, group_id=-1 - i) for i in range(len(c.eval_prompts))]
    groups = asyncio.run(rollout_groups(ctx, groups, c.eval_sampling, apply_filter=False))
    accuracy = sum(1.0 for g in groups if g[0].reward is not None and g[0].reward >= 1.0) / len(groups)
    log.log({"step": step, "eval_accuracy": accuracy, "eval_seconds": time.perf_counter() - t})
    progress.update(eval_acc=accuracy)


def rollout_metrics(groups, seconds: float) -> dict:
    samples = [s for g in groups for s in g]
    rewards = [s.reward for s in samples if s.reward is not None]
    lengths = [s.response_length for s in samples]
    return {
        "reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
        "accuracy": sum(r >= 1.0 for r in rewards) / max(len(rewards), 1),
        "response_length_mean": statistics.fmean(lengths),
        "response_length_min": min(lengths),
        "response_length_max": max(lengths),
        "truncated_fraction": sum(s.status.value == "truncated" for s in samples) / len(samples),
        "failed_fraction": sum(s.status.value in ("failed", "aborted") for s in samples) / len(samples),
        "zero_advantage_group_fraction": sum(len({s.reward for s in g}) == 1 for g in groups) / len(groups),
        "rollout_tokens_per_s": sum(lengths) / seconds,
        "rollout_seconds": seconds,
    }


def finish(cfg: Config, c: Components, run_dir: Path, log: MetricsLog, seconds: float) -> dict:
    if cfg.run.save_final:
        c.trainer.model.save_pretrained(run_dir / "final", state_dict=c.final_state, safe_serialization=True)
        c.tokenizer.save_pretrained(run_dir / "final")
    if cfg.run.plot:
        plot_curves(log.rows, run_dir / "curves.png")
    train_rows = [r for r in log.rows if "reward_mean" in r]
    evals = [r["eval_accuracy"] for r in log.rows if "eval_accuracy" in r]
    summary = {
        "status": "completed",
        "steps": len(train_rows),
        "wall_seconds": round(seconds, 1),
        "eval_accuracy_first": evals[0] if evals else None,
        "eval_accuracy_last": evals[-1] if evals else None,
        "eval_accuracy_curve": evals,
        "reward_mean_first": train_rows[0]["reward_mean"] if train_rows else None,
        "reward_mean_last": train_rows[-1]["reward_mean"] if train_rows else None,
        "max_train_rollout_logprob_abs_diff": max((r["train_rollout_logprob_abs_diff"] for r in train_rows), default=None),
        "run_dir": str(run_dir),
    }
    write_summary(run_dir, summary)
    curve = " -> ".join(f"{a:.1%}" for a in evals) or "no eval set"
    print(f"strop: {summary['steps']} steps in {seconds:.0f}s; held-out greedy accuracy {curve}; "
          f"max train/rollout logprob gap {summary['max_train_rollout_logprob_abs_diff']:.1e}; "
          f"outputs in {run_dir}", flush=True)
    return summary
