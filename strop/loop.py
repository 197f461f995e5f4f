"""The driver: rollout → rewards → advantages → train → sync weights → log → eval, per step."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import torch

from strop.algo.advantages import grpo_advantages
from strop.config import Config, save_config
from strop.observe.metrics import MetricsLog, Progress, Timer, plot_curves, write_summary
from strop.rollout.generate import RolloutContext, rollout_groups
from strop.setup import Components, build, make_run_dir


def evaluate(c: Components, ctx: RolloutContext) -> float:
    """Greedy accuracy on the held-out prompts (fraction with reward 1)."""
    groups = [c.eval_prompts.make_group(i, 1, group_id=-1 - i) for i in range(len(c.eval_prompts))]
    asyncio.run(rollout_groups(ctx, groups, c.eval_sampling, c.reward_fn))
    return sum(1.0 for g in groups if g[0].reward is not None and g[0].reward >= 1.0) / len(groups)


def rollout_metrics(samples, seconds: float) -> dict:
    rewards = [s.reward for s in samples if s.reward is not None]
    lengths = [s.response_length for s in samples]
    return {
        "reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
        "accuracy": sum(r >= 1.0 for r in rewards) / max(len(rewards), 1),
        "response_length_mean": statistics.fmean(lengths),
        "truncated_fraction": sum(s.status.value == "truncated" for s in samples) / len(samples),
        "rollout_tokens_per_s": sum(lengths) / seconds,
        "rollout_seconds": seconds,
    }


def train(cfg: Config) -> dict:
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    c = build(cfg)  # every input is checked here, before the run directory exists
    run_dir = make_run_dir(cfg)
    print(f"strop: run directory {run_dir}", flush=True)
    save_config(cfg, run_dir / "config.yaml")
    log, clock = MetricsLog(run_dir), Timer()
    ctx = RolloutContext(engine=c.engine, tokenizer=c.tokenizer, config=cfg)
    progress = Progress(cfg.train.steps, enabled=cfg.run.progress)
    evals: list[float] = []

    def maybe_eval(step: int, force: bool = False) -> None:
        if c.eval_prompts is None or not (force or (cfg.eval.every and step % cfg.eval.every == 0)):
            return
        t = time.perf_counter()
        evals.append(evaluate(c, ctx))
        log.log({"step": step, "eval_accuracy": evals[-1], "eval_seconds": time.perf_counter() - t})
        progress.update(eval_acc=evals[-1])

    try:
        _steps(cfg, c, ctx, log, clock, progress, maybe_eval)
    except BaseException as exc:  # leave a summary that says the run did not finish, then re-raise
        write_summary(run_dir, {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                                "steps": sum("reward_mean" in r for r in log.rows), "wall_seconds": round(clock(), 1)})
        raise
    finally:
        progress.close()
    return finish(cfg, c, run_dir, log, evals, clock())


def _steps(cfg, c, ctx, log, clock, progress, maybe_eval) -> None:
    maybe_eval(0, force=True)
    for step in range(1, cfg.train.steps + 1):
        t_step, ctx.step = time.perf_counter(), step
        groups = [c.train_prompts.make_group(i, cfg.rollout.n_samples_per_prompt, gid)
                  for i, gid in c.sampler.draw(cfg.rollout.prompts_per_step)]
        t = time.perf_counter()
        asyncio.run(rollout_groups(ctx, groups, c.sampling, c.reward_fn))
        samples = [s for g in groups for s in g if s.status.trainable]  # aborted / failed never train
        metrics = rollout_metrics([s for g in groups for s in g], time.perf_counter() - t)
        rewards = torch.tensor([s.reward for s in samples])
        advantages = grpo_advantages(rewards, torch.tensor([s.group_id for s in samples]),
                                     normalize_std=cfg.algo.normalize_std)
        metrics |= c.trainer.step(samples, advantages)
        asyncio.run(c.engine.update_weights(c.trainer.state_dict(), version=step))
        metrics |= {"step": step, "step_seconds": time.perf_counter() - t_step, "elapsed_seconds": clock()}
        log.log(metrics)
        progress.update(1, reward=metrics["reward_mean"])
        if step < cfg.train.steps:
            maybe_eval(step)
    maybe_eval(cfg.train.steps, force=True)


def finish(cfg: Config, c: Components, run_dir: Path, log: MetricsLog, evals: list[float], seconds: float) -> dict:
    if cfg.run.save_final:
        c.trainer.model.save_pretrained(run_dir / "final", safe_serialization=True)
        c.tokenizer.save_pretrained(run_dir / "final")
    if cfg.run.plot:
        plot_curves(log.rows, run_dir / "curves.png")
    train_rows = [r for r in log.rows if "reward_mean" in r]
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
    print(f"strop: {summary['steps']} steps in {seconds:.0f}s; held-out accuracy "
          f"{summary['eval_accuracy_first']} -> {summary['eval_accuracy_last']}; outputs in {run_dir}", flush=True)
    return summary
