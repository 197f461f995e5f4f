"""Rank 0's part of a run (strop.loop drives it): the event loop, rollout, engine sync, evaluation,
checkpoints' controller state and every output."""

from __future__ import annotations

import json
import time
from pathlib import Path

from strop import checkpoint
from strop.config import Config, save_config
from strop.serving.probe import reference_logprobs
from strop.observe.metrics import (MetricsLog, Progress, Timer, memory_metrics, plot_curves, rollout_metrics,
                                   run_summary, write_summary)
from strop.observe.tracking import open_trackers, sample_rows
from strop.parallel.gather import whole
from strop.plugins import call_hook_sync
from strop.rollout.event_loop import EventLoopThread
from strop.rollout.generate import RolloutContext, rollout_groups
from strop.rollout.manager import RolloutManager, describe as describe_rollout
from strop.rollout.samples_file import write_samples
from strop.setup import Components


class Controller:
    """Rank 0's part of a run: the event loop, rollout, engine sync, evaluation and every output."""

    def __init__(self, cfg: Config, c: Components):
        self.cfg, self.c, self.run_dir = cfg, c, c.run_dir
        self.log, self.clock = MetricsLog(self.run_dir), Timer()
        self.ctx = RolloutContext(engine=c.engine, tokenizer=c.tokenizer, config=cfg, generate=c.hooks.get("generate"),
                                  reward=c.reward_fn, filter=c.hooks.get("filter"), run_dir=self.run_dir,
                                  extra=dict(c.rollout_extra))
        self.progress = Progress(cfg.train.steps, enabled=cfg.run.progress)
        self.manager = RolloutManager(cfg, c, self.ctx)
        self.samples_out: Path | None = None  # rollout only: where the scored samples go
        # one event loop for the whole run, in its own thread; a wait on it is as long as the other ranks
        # wait for rank 0 (started last: a failure above leaves nothing running)
        self.loop = EventLoopThread(cfg.parallel.controller_timeout_s)

    def start(self, resume: bool = False) -> str | None:
        """Print where the run is, open the trackers, evaluate step 0; resuming, return the newest
        complete checkpoint instead (None: there is none, the run starts again from step 0)."""
        save_config(self.cfg, self.run_dir / "config.yaml")  # first: from here on the run can be resumed
        print(f"strop: run directory {self.run_dir}", flush=True)
        if self.c.trainer.dp.processes > 1:
            print(f"strop: {self.c.trainer.dp.describe()}", flush=True)
        print(f"strop: device {self.c.trainer.device}", flush=True)
        if self.c.replay is not None:
            print(f"strop: train only: samples of {len(self.c.replay)} steps from {self.cfg.data.samples}", flush=True)
        elif self.cfg.engine.kind != "embedded":
            urls = ", ".join(e.url for e in self.c.engine.engines)
            how = f"{len(self.c.servers)} launched strop serve processes" if self.c.servers else self.cfg.engine.kind
            print(f"strop: engine: router over {how}: {urls}", flush=True)
        else:
            print(f"strop: engine: embedded, {self.c.engine.decode_path}", flush=True)
        if self.c.replay is None:
            print(f"strop: {describe_rollout(self.cfg)}", flush=True)
        found = checkpoint.latest(self.run_dir) if resume else None
        resume_step = None
        if resume:
            if found is None:
                print(f"strop: resume: no complete checkpoint in {self.run_dir / checkpoint.CHECKPOINTS}; "
                      "starting again from step 0", flush=True)
                checkpoint.cut_logs(self.run_dir, {})
            resume_step = checkpoint.load_controller_state(found)["step"] if found else -1  # -1: from step 0
        r = self.cfg.run
        self.log.trackers = open_trackers(r.trackers, self.run_dir, self.cfg.model_dump(mode="json"),
                                          project=r.wandb_project, mode=r.wandb_mode, resume_step=resume_step)
        if found is None:
            self.evaluate(step=0)
        return str(found) if found is not None else None

    def restore(self, found: str, weights: dict) -> int:
        """Rank 0's side of a resume: logs cut back to the checkpoint, sampler, engine sampling state,
        clock; the engine gets the checkpoint's weights. Returns the checkpoint's step."""
        state = checkpoint.load_controller_state(found)
        checkpoint.cut_logs(self.run_dir, state["logs"])
        self.log.reload()
        if self.c.sampler is not None:
            self.c.sampler.load_state_dict(state["sampler"])
        self.loop.run(self.manager.load(state["rollout"], state["step"]))
        generator = getattr(self.c.engine, "generator", None)
        if generator is not None and state["engine_rng"] is not None:
            generator.set_state(state["engine_rng"])
        elif self.c.engine is not None:
            print("strop: resume: the engine's sampling state lives in its servers and is not restored; the "
                  "steps that follow are not bitwise those of an uninterrupted run", flush=True)
        world = self.c.trainer.dp.processes
        if state.get("world", 1) != world:  # DCP reshards; the sums run in another order
            print(f"strop: resume: saved by {state.get('world', 1)} processes, resumed by {world}: "
                  "the run continues, but not bitwise as it would have", flush=True)
        self.clock.start -= state["elapsed_seconds"]
        if self.c.engine is not None:
            self.loop.run(self.c.engine.update_weights(weights, version=state["weight_version"]))
        self.progress.update(state["step"])
        print(f"strop: resumed from {found} at step {state['step']} of {self.cfg.train.steps}", flush=True)
        return state["step"]

    def begin_checkpoint(self, step: int) -> str:
        self.t_checkpoint = time.perf_counter()
        return str(checkpoint.begin(self.run_dir, step))

    def checkpoint(self, step: int, tmp: Path, weights: dict) -> None:
        """Complete the checkpoint every rank wrote its part of into ``tmp``."""
        generator = getattr(self.c.engine, "generator", None)
        rollout = self.loop.run(self.manager.pause())  # what it holds; nothing new starts until resume()
        try:
            state = {"step": step, "weight_version": step, "world": self.c.trainer.dp.processes,
                     "sampler": self.c.sampler.state_dict() if self.c.sampler is not None else None,
                     "engine_rng": generator.get_state() if generator is not None else None,
                     "elapsed_seconds": self.clock(), "logs": checkpoint.log_sizes(self.run_dir),
                     "rollout": rollout}  # None in sync mode: it holds nothing between steps
        finally:
            self.loop.run(self.manager.resume())
        weights = whole(weights) if self.cfg.run.checkpoint_policy else None  # (`strop export` writes it from the state)
        path = checkpoint.finish(self.run_dir, tmp, step, controller_state=state, weights=weights,
                                 model=self.c.trainer.model, tokenizer=self.c.tokenizer,
                                 keep=self.cfg.run.keep_checkpoints)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        print(f"strop: checkpoint {path} ({size / 2**30:.2f} GiB) in {time.perf_counter() - self.t_checkpoint:.1f}s",
              flush=True)

    def rollout(self, step: int) -> tuple[list, dict]:
        self.t_step, self.ctx.step = time.perf_counter(), step
        if self.c.replay is not None:  # train only: the file's samples of this step, grouped again
            by_group: dict[int, list] = {}
            for s in self.c.replay[step]:
                by_group.setdefault(s.group_id, []).append(s)
            groups = list(by_group.values())
            managed = {"groups_drawn": len(groups), "staleness_histogram": {}}
        else:
            groups, managed = self.loop.run(self.manager.batch(step))
        if not any(s.status.trainable for g in groups for s in g):
            raise RuntimeError(f"step {step}: no trainable sample after {managed['groups_drawn']} prompts "
                               "(every group filtered out, or every sample aborted/failed)")
        histogram = managed.pop("staleness_histogram")
        if self.cfg.rollout.mode != "sync":
            with open(self.run_dir / "staleness.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "tokens_by_staleness": histogram}) + "\n")
        metrics = rollout_metrics(groups, time.perf_counter() - self.t_step) | managed
        samples = [s for g in groups for s in g if s.status.trainable]  # aborted / failed never train
        self.log.samples(sample_rows(groups, self.c.tokenizer, self.cfg.run.log_samples, step), step)
        if self.samples_out is not None:
            write_samples(self.samples_out, samples, step)
        if "postprocess" in self.c.hooks:
            samples = call_hook_sync("postprocess", self.c.hooks["postprocess"], samples=samples, step=step)
        if self.c.replay is None:
            self.loop.run(self.manager.accounts())
        return samples, metrics

    def after_step(self, step: int, weights: dict, metrics: dict) -> None:
        t = time.perf_counter()
        if self.c.engine is not None:  # (train only has none)
            # (partial=resume: what is generating is aborted around the update and continues after it)
            self.loop.run(self.manager.update_weights(lambda: self.c.engine.update_weights(weights, version=step), step))
            if getattr(self.c.engine, "probe_ids", None):  # every engine computes with the trainer's weights
                ids = self.c.engine.probe_ids
                reference = reference_logprobs(self.c.trainer.model, ids)
                metrics["weight_probe_max_diff"] = self.loop.run(self.c.engine.probe(ids, reference,
                                                                                self.c.engine.probe_tolerance))
        metrics["weight_sync_seconds"] = time.perf_counter() - t
        if getattr(self.c.engine, "bytes_full", 0):  # the delta form: what moved against a full sync
            metrics["weight_sync_bytes"] = self.c.engine.bytes_sent
            metrics["weight_sync_fraction"] = self.c.engine.bytes_sent / self.c.engine.bytes_full
        self.log.log(metrics | memory_metrics(self.c.trainer.device) | {
            "step": step, "step_seconds": time.perf_counter() - self.t_step, "elapsed_seconds": self.clock()})
        self.progress.update(1, reward=metrics["reward_mean"])
        if step == self.cfg.train.steps or (self.cfg.eval.every and step % self.cfg.eval.every == 0):
            self.evaluate(step)

    def evaluate(self, step: int) -> None:
        """Greedy accuracy on the held-out prompts (fraction with reward 1), logged at ``step``."""
        c = self.c
        if c.eval_prompts is None:
            return
        t = time.perf_counter()
        groups = [c.eval_prompts.make_group(i, 1, group_id=-1 - i) for i in range(len(c.eval_prompts))]
        groups = self.loop.run(rollout_groups(self.ctx, groups, c.eval_sampling, apply_filter=False))
        accuracy = sum(1.0 for g in groups if g[0].reward is not None and g[0].reward >= 1.0) / len(groups)
        row = {"step": step, "eval_accuracy": accuracy, "eval_seconds": time.perf_counter() - t}
        if any("tool_calls" in g[0].metadata for g in groups):  # multi-turn: how often the answer used a tool
            row["eval_tool_call_fraction"] = sum(g[0].metadata.get("tool_calls", 0) > 0 for g in groups) / len(groups)
        if any("agent_session" in g[0].metadata for g in groups):  # agents: calls per session, how sessions ended
            row["eval_agent_calls_per_session"] = sum(g[0].metadata.get("session_calls", 0) for g in groups) / len(groups)
            row["eval_agent_multi_call_fraction"] = sum(g[0].metadata.get("session_calls", 0) > 1
                                                        for g in groups) / len(groups)
        self.log.log(row)
        self.progress.update(eval_acc=accuracy)

    def finish(self, weights: dict | None) -> dict:
        """Save the final model, draw the curves, write and print the summary."""
        self.progress.close()
        cfg, c, run_dir, seconds = self.cfg, self.c, self.run_dir, self.clock()
        if cfg.run.save_final:
            c.trainer.model.save_pretrained(run_dir / "final", state_dict=whole(weights), safe_serialization=True)
            c.tokenizer.save_pretrained(run_dir / "final")
        if cfg.run.plot:
            plot_curves(self.log.rows, run_dir / "curves.png")
        summary = run_summary(self.log.rows, seconds, run_dir)
        write_summary(run_dir, summary)
        curve = " -> ".join(f"{a:.1%}" for a in summary["eval_accuracy_curve"]) or "no eval set"
        print(f"strop: {summary['steps']} steps in {seconds:.0f}s; held-out greedy accuracy {curve}; "
              f"max train/rollout logprob gap {summary['max_train_rollout_logprob_abs_diff']:.1e}; "
              f"outputs in {run_dir}", flush=True)
        return summary

    def failed(self, exc: BaseException) -> None:
        write_summary(self.run_dir, {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                                     "steps": sum("reward_mean" in r for r in self.log.rows),
                                     "wall_seconds": round(self.clock(), 1)})

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop generating, close the logs, the engine and launched servers, then the event loop;
        each wait on the loop at most ``timeout_s``."""
        self.progress.close()
        try:
            self.log.close()
            self.loop.run(self.manager.close(), timeout_s)
        finally:
            try:
                self.c.close(lambda coroutine: self.loop.run(coroutine, timeout_s))
            finally:
                self.loop.close(timeout_s)
