"""The rollout role: each step's scored samples, made on rank 0 and handed to every rank.

:class:`Rollout` generates them with the rollout manager (strop.rollout.manager) in the run's event loop;
:class:`SamplesFileRollout` is its file-backed stand-in for a train-only run (``data.samples``): the
samples ``strop rollout`` wrote, step by step, with no engine.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from strop.engines.base import Speculating
from strop.observe.metrics import rollout_metrics
from strop.observe.tracking import sample_rows
from strop.plugins import call_hook_sync
from strop.roles.placement import CONTROL
from strop.roles.rank0 import Rank0
from strop.rollout.manager import RolloutManager, describe as describe_rollout
from strop.rollout.samples_file import write_header, write_samples

log = logging.getLogger(__name__)


class Rollout:
    """The step's samples from the engine. ``samples_out`` (``strop rollout``): every step's scored
    samples are also written there, as they come, before the postprocess hook."""

    placement = CONTROL

    def __init__(self, desk: Rank0, samples_out: Path | None = None):
        self.desk, self.cfg, self.c = desk, desk.cfg, desk.c
        self.manager = RolloutManager(desk.cfg, desk.c, desk.ctx)
        desk.stop_rollout = self.manager.close
        self.samples_out = samples_out
        if samples_out is not None:
            r = self.cfg.rollout
            write_header(
                samples_out,
                {
                    "temperature": r.temperature,
                    "top_p": r.top_p,
                    "top_k": r.top_k,
                    "max_new_tokens": r.max_new_tokens,
                    "model": self.cfg.model.path,
                },
            )

    def announce(self) -> None:
        """Print where the samples come from: the model, the prompts, the reward, the engine, how the rollout runs."""
        c, cfg = self.c, self.cfg
        log.info(f"strop: model {cfg.model.path}")
        log.info(f"strop: data: {describe_data(cfg, c)}")
        if cfg.env.kind and cfg.agent.reward == "session":
            log.info(f"strop: reward: the environment's own (env.{cfg.env.kind}={getattr(cfg.env, cfg.env.kind)!r})")
        elif cfg.reward.endpoint:
            rc = cfg.reward
            log.info(
                f"strop: reward: the judge at {rc.endpoint} (model {rc.model!r}, parser {rc.parser}, "
                f"{rc.concurrency} calls at once, {rc.retries} retries, {rc.timeout_s:g}s each)"
            )
        else:
            log.info(f"strop: reward: {cfg.rollout.reward}")
        if cfg.engine.kind != "embedded":
            urls = ", ".join(e.url for e in c.engine.engines)
            how = f"{len(c.servers)} launched strop serve processes" if c.servers else cfg.engine.kind
            log.info(f"strop: engine: router over {how}: {urls}")
        else:
            log.info(f"strop: engine: embedded, {c.engine.decode_path}")
        log.info(f"strop: {describe_rollout(cfg)}")

    def next(self, step: int) -> tuple[list, dict]:
        """The samples step ``step`` trains on (trainable ones only) and the rollout's metrics."""
        d = self.desk
        d.t_step, d.ctx.step = time.perf_counter(), step
        groups, managed = self._groups(step)
        if not any(s.status.trainable for g in groups for s in g):
            failed = managed.get("groups_failed", 0)
            raise RuntimeError(
                f"step {step}: no trainable sample after {managed['groups_drawn']} prompts "
                "(every group filtered out, or every sample aborted/failed"
                + (
                    f"; {failed} groups had a sample that failed past rollout.sample_retries="
                    f"{self.cfg.rollout.sample_retries}: see failed_samples.jsonl"
                    if failed
                    else ""
                )
                + ")"
            )
        histogram = managed.pop("staleness_histogram")
        if self.cfg.rollout.mode != "sync":
            with open(d.run_dir / "staleness.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "tokens_by_staleness": histogram}) + "\n")
        metrics = rollout_metrics(groups, time.perf_counter() - d.t_step, self.cfg.eval.accuracy_threshold) | managed
        if isinstance(self.c.engine, Speculating):  # drafted tokens: how many stood, tokens per forward pass
            metrics |= self.c.engine.take_speculation_stats()
        samples = [s for g in groups for s in g if s.status.trainable]  # aborted / failed never train
        d.log.samples(sample_rows(groups, self.c.tokenizer, self.cfg.run.log_samples, step), step)
        if self.samples_out is not None:
            write_samples(self.samples_out, samples, step)
        if "postprocess" in self.c.hooks:
            samples = call_hook_sync("postprocess", self.c.hooks["postprocess"], samples=samples, step=step)
        self._check_accounts()
        return samples, metrics

    def _groups(self, step: int) -> tuple[list, dict]:
        return self.desk.loop.run(self.manager.batch(step))

    def _check_accounts(self) -> None:
        self.desk.loop.run(self.manager.accounts())

    # ---- what rank 0's other roles ask of the rollout -------------------------------------------
    def update_weights(self, update, version: int) -> None:
        """``update()`` (the engine's update to weight ``version``) around what is generating."""
        self.desk.loop.run(self.manager.update_weights(update, version))

    def hold(self) -> dict | None:
        """For a checkpoint: what the rollout holds (None: nothing); nothing new starts until :meth:`release`."""
        return self.desk.loop.run(self.manager.pause())

    def release(self) -> None:
        self.desk.loop.run(self.manager.resume())

    def load(self, state: dict | None, step: int) -> None:
        """Take back what :meth:`hold` returned, in a run resumed after ``step``."""
        self.desk.loop.run(self.manager.load(state, step))


def describe_data(cfg, c) -> str:
    """The prompts of a run in words: their source (a file, a reasoning-gym task, the data_source hook) and how many,
    then the held-out set's."""
    d = cfg.data
    train = len(c.train_prompts) if c.train_prompts is not None else 0
    held = len(c.eval_prompts) if c.eval_prompts is not None else 0
    if cfg.env.kind == "verifiers":
        split = f"its split {cfg.env.verifiers_eval}" if cfg.env.verifiers_eval else "its last tasks, never trained on"
        return f"the tasks of env.verifiers={cfg.env.verifiers!r}: {train} training, {held} held-out ({split})"
    if cfg.env.kind == "openenv":
        return (
            f"episodes of env.openenv={cfg.env.openenv!r}: {train} training seeds, {held} held-out seeds "
            f"(disjoint), up to {cfg.env.max_turns} steps each"
        )
    if cfg.plugins.data_source:
        return f"data_source hook {cfg.plugins.data_source}: {train} training prompts, {held} held-out"
    if d.source == "file":
        evals = (
            f"{held} held-out from {d.eval_path}"
            if held
            else "no held-out set (data.eval_size=0)"
            if d.eval_path
            else "no held-out set (data.eval_path names one)"
        )
        return f"file {d.path}: {train} training prompts; {evals}"
    return (
        f"reasoning-gym task {d.task!r} (options {d.task_options}): {train} training prompts (data.seed={d.seed}); "
        + (f"{held} held-out (data.eval_seed={d.eval_seed})" if held else "no held-out set (data.eval_size=0)")
    )


class SamplesFileRollout(Rollout):
    """Train only (``data.samples``): the file's samples of each step, grouped again; no engine."""

    placement = CONTROL

    def __init__(self, desk: Rank0):
        self.desk, self.cfg, self.c = desk, desk.cfg, desk.c
        self.samples_out = None

    def announce(self) -> None:
        log.info(f"strop: model {self.cfg.model.path}")
        log.info(f"strop: train only: samples of {len(self.c.replay)} steps from {self.cfg.data.samples}")

    def _groups(self, step: int) -> tuple[list, dict]:
        by_group: dict[int, list] = {}
        for s in self.c.replay[step]:
            by_group.setdefault(s.group_id, []).append(s)
        groups = list(by_group.values())
        return groups, {"groups_drawn": len(groups), "staleness_histogram": {}}

    def _check_accounts(self) -> None:
        pass  # nothing is generated

    def update_weights(self, update, version: int) -> None:
        raise RuntimeError("train only: there is no engine to update")

    def hold(self) -> None:
        return None  # it holds nothing between steps

    def release(self) -> None:
        pass

    def load(self, state: dict | None, step: int) -> None:
        pass
