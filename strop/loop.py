"""The driver: rollout → rewards → advantages → train → sync weights → log → eval, per step."""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from strop import checkpoint
from strop.config import Config, save_config
from strop.engines.probe import reference_logprobs
from strop.observe.tracking import open_trackers, sample_rows
from strop.observe.metrics import MetricsLog, Progress, Timer, memory_metrics, plot_curves, write_summary
from strop.plugins import call_hook, call_hook_sync
from strop.rollout.generate import RolloutContext, rollout_groups
from strop.rollout.manager import RolloutManager, describe as describe_rollout
from strop.rollout.samples_file import write_header, write_samples
from strop.cluster.process import resolve_device, stop_on_signals
from strop.parallel.runtime import Control, init_from_env
from strop.setup import Components, build


def train(cfg: Config, resume: bool = False) -> dict | None:
    """Run RL on every rank of this job (one program: rank 0 also rolls out, evaluates and writes).
    ``resume``: continue the run in ``cfg.run.dir`` from its newest checkpoint (strop.checkpoint)."""
    with stop_on_signals() as closing:
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        device = resolve_device(cfg.run.device)
        init_from_env(device)
        control = Control(cfg.parallel.controller_timeout_s)
        c = build(cfg, device, control, resume=resume)  # every input is checked before the run directory exists
        return _train(cfg, resume, control, c, closing)


def _train(cfg: Config, resume: bool, control: Control, c: Components, closing) -> dict | None:
    run, error = None, None
    try:
        run = control.on_controller(lambda: _Controller(cfg, c), share=False)  # None on the other ranks
        found = control.on_controller(lambda: run.start(resume))  # the checkpoint to resume from, or None
        first = 1
        if found is not None:  # every rank loads its state, then the engine gets the checkpoint's weights
            control.on_every_rank(checkpoint.check_rank_file, found, control.rank)  # fail all ranks, not one
            checkpoint.load_trainer(found, c.trainer)
            weights = c.trainer.full_weights()
            first = control.on_controller(lambda: run.restore(found, weights)) + 1
            del weights
        for step in range(first, cfg.train.steps + 1):
            samples, metrics = control.on_controller(lambda: run.rollout(step))  # rank 0 generates, all receive
            metrics |= c.trainer.step(samples)  # every rank: advantages, loss, optimizer step(s)
            weights = c.trainer.full_weights()  # gathered from every rank's shards under FSDP
            control.on_controller(lambda: run.after_step(step, weights, metrics), share=False)  # sync engine, log, evaluate
            if cfg.run.save_every and (step % cfg.run.save_every == 0 or step == cfg.train.steps):
                save_checkpoint(control, run, c, step, weights)
            del weights
        weights = c.trainer.full_weights() if cfg.run.save_final else None
        return control.on_controller(lambda: run.finish(weights), share=False)
    except BaseException as exc:  # leave a summary that says the run did not finish, then re-raise
        error = exc
        if run is not None:
            after(error, run.failed, exc)
        raise
    finally:
        closing()
        shut_down(run, c, error)


def after(error: BaseException | None, fn, *args) -> None:
    """``fn(*args)``. After ``error`` (the run's own), a failure of ``fn`` is printed, never raised
    in the place of ``error``."""
    try:
        fn(*args)
    except Exception as exc:
        if error is None:
            raise
        print(f"strop: after {type(error).__name__}: {error}: {getattr(fn, '__qualname__', fn)} failed too: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def shut_down(run, c: Components, error: BaseException | None = None) -> None:
    """Stop everything the run started: the controller's loop, the engine, launched servers (what
    build started, when the controller was never made)."""
    after(error, run.close if run is not None else c.close)


def rollout_only(cfg: Config, out: Path | None = None) -> Path:
    """``strop rollout``: what a sync run would generate and score, step by step, written to ``out``
    (default <run dir>/rollout_samples.jsonl) with no training. The weights never change, so this is
    the run's first step exactly (and later steps on the initial weights)."""
    if cfg.rollout.mode != "sync":
        raise ValueError(f"strop rollout generates without training: rollout.mode={cfg.rollout.mode!r} has "
                         "no weight updates to be ahead of; use rollout.mode=sync")
    with stop_on_signals() as closing:
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        device = resolve_device(cfg.run.device)
        c = build(cfg, device, Control())
        return _rollout_only(cfg, c, out, closing)


def _rollout_only(cfg: Config, c: Components, out: Path | None, closing) -> Path:
    run, error = None, None
    try:
        run = _Controller(cfg, c)
        run.samples_out = Path(out) if out else run.run_dir / "rollout_samples.jsonl"
        write_header(run.samples_out, {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
                                       "top_k": cfg.rollout.top_k, "max_new_tokens": cfg.rollout.max_new_tokens,
                                       "model": cfg.model.path})
        run.start()
        for step in range(1, cfg.train.steps + 1):
            samples, metrics = run.rollout(step)
            run.log.log(metrics | {"step": step, "step_seconds": time.perf_counter() - run.t_step})
            run.progress.update(1, reward=metrics["reward_mean"])
        print(f"strop: {cfg.train.steps} steps of scored samples -> {run.samples_out}", flush=True)
        return run.samples_out
    except BaseException as exc:
        error = exc
        raise
    finally:
        closing()
        shut_down(run, c, error)


def save_checkpoint(control: Control, run, c: Components, step: int, weights: dict) -> None:
    """Every rank writes its trainer state into a temporary folder; rank 0 adds the rest and renames
    it into place (strop.checkpoint)."""
    tmp = control.on_controller(lambda: run.begin_checkpoint(step))
    checkpoint.save_trainer(Path(tmp), c.trainer)  # collective: returns on rank 0 once every rank has written
    control.on_controller(lambda: run.checkpoint(step, Path(tmp), weights), share=False)


class _Controller:
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
        # one event loop for the whole run, in its own thread: rollout goes on while the trainer works
        # (started last: a failure above leaves nothing running)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="strop-rollout", daemon=True)
        self.thread.start()

    def run(self, coroutine, timeout_s: float | None = None):
        """Run ``coroutine`` in the run's event loop and wait for its result, at most ``timeout_s``
        (default parallel.controller_timeout_s: the other ranks wait no longer for rank 0 either).
        A wait that ends without the result (time out, a signal) cancels the coroutine."""
        timeout_s = timeout_s or self.cfg.parallel.controller_timeout_s
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            if future.done():  # the coroutine's own TimeoutError (or it finished just now)
                return future.result()
            future.cancel()
            raise TimeoutError(f"{coroutine.__qualname__} did not finish within {timeout_s:g}s in the run's "
                               "event loop") from None
        except BaseException:
            future.cancel()  # a signal while waiting: the coroutine stops too
            raise

    def start(self, resume: bool = False) -> str | None:
        """Print where the run is, open the trackers, evaluate step 0; resuming, return the newest
        complete checkpoint instead (None: there is none, the run starts again from step 0)."""
        save_config(self.cfg, self.run_dir / "config.yaml")  # first: from here on the run can be resumed
        print(f"strop: run directory {self.run_dir}", flush=True)
        if self.c.trainer.dp.world > 1:
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
        self.run(self.manager.load(state["rollout"]))
        generator = getattr(self.c.engine, "generator", None)
        if generator is not None and state["engine_rng"] is not None:
            generator.set_state(state["engine_rng"])
        elif self.c.engine is not None:
            print("strop: resume: the engine's sampling state lives in its servers and is not restored; the "
                  "steps that follow are not bitwise those of an uninterrupted run", flush=True)
        if state.get("world", 1) != self.c.trainer.dp.world:  # DCP reshards; the sums run in another order
            print(f"strop: resume: saved by {state.get('world', 1)} processes, resumed by {self.c.trainer.dp.world}: "
                  "the run continues, but not bitwise as it would have", flush=True)
        self.clock.start -= state["elapsed_seconds"]
        if self.c.engine is not None:
            self.run(self.c.engine.update_weights(weights, version=state["weight_version"]))
        self.progress.update(state["step"])
        print(f"strop: resumed from {found} at step {state['step']} of {self.cfg.train.steps}", flush=True)
        return state["step"]

    def begin_checkpoint(self, step: int) -> str:
        self.t_checkpoint = time.perf_counter()
        return str(checkpoint.begin(self.run_dir, step))

    def checkpoint(self, step: int, tmp: Path, weights: dict) -> None:
        """Complete the checkpoint every rank wrote its part of into ``tmp``."""
        generator = getattr(self.c.engine, "generator", None)
        rollout = self.run(self.manager.pause())  # what it holds; nothing new starts until resume()
        try:
            state = {"step": step, "weight_version": step, "world": self.c.trainer.dp.world,
                     "sampler": self.c.sampler.state_dict() if self.c.sampler is not None else None,
                     "engine_rng": generator.get_state() if generator is not None else None,
                     "elapsed_seconds": self.clock(), "logs": checkpoint.log_sizes(self.run_dir),
                     "rollout": rollout}  # None in sync mode: it holds nothing between steps
        finally:
            self.run(self.manager.resume())
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
            groups, managed = self.run(self.manager.batch(step))
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
            self.run(self.manager.accounts())
        return samples, metrics

    def after_step(self, step: int, weights: dict, metrics: dict) -> None:
        t = time.perf_counter()
        if self.c.engine is not None:  # (train only has none)
            # (partial=resume: what is generating is aborted around the update and continues after it)
            self.run(self.manager.update_weights(lambda: self.c.engine.update_weights(weights, version=step)))
            if getattr(self.c.engine, "probe_ids", None):  # every engine computes with the trainer's weights
                ids = self.c.engine.probe_ids
                reference = reference_logprobs(self.c.trainer.model, ids)
                metrics["weight_probe_max_diff"] = self.run(self.c.engine.probe(ids, reference,
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
        groups = self.run(rollout_groups(self.ctx, groups, c.eval_sampling, apply_filter=False))
        accuracy = sum(1.0 for g in groups if g[0].reward is not None and g[0].reward >= 1.0) / len(groups)
        row = {"step": step, "eval_accuracy": accuracy, "eval_seconds": time.perf_counter() - t}
        if any("tool_calls" in g[0].metadata for g in groups):  # multi-turn: how often the answer used a tool
            row["eval_tool_call_fraction"] = sum(g[0].metadata.get("tool_calls", 0) > 0 for g in groups) / len(groups)
        self.log.log(row)
        self.progress.update(eval_acc=accuracy)

    def finish(self, weights: dict | None) -> dict:
        self.progress.close()
        return finish(self.cfg, self.c, self.run_dir, self.log, self.clock(), weights)

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
            self.run(self.manager.close(), timeout_s)
        finally:
            try:
                self.c.close(lambda coroutine: self.run(coroutine, timeout_s))
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(timeout=timeout_s)
                if not self.thread.is_alive():
                    self.loop.close()


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
        "failed_fraction": sum(s.status.value == "failed" for s in samples) / len(samples),
        "aborted_fraction": sum(s.status.value == "aborted" for s in samples) / len(samples),
        "zero_advantage_group_fraction": sum(len({s.reward for s in g}) == 1 for g in groups) / len(groups),
        "rollout_tokens_per_s": sum(lengths) / seconds,
        "rollout_seconds": seconds,
    } | failure_counts(samples) | tool_metrics(samples)


def tool_metrics(samples) -> dict:
    """Multi-turn samples (they carry ``tool_calls``): calls, errors and turns per sample."""
    multi = [s for s in samples if "tool_calls" in s.metadata]
    if not multi:
        return {}
    calls = [s.metadata["tool_calls"] for s in multi]
    return {"tool_calls_mean": statistics.fmean(calls), "tool_calls_max": max(calls),
            "tool_call_fraction": sum(c > 0 for c in calls) / len(multi),
            "tool_errors_per_call": sum(s.metadata["tool_errors"] for s in multi) / max(sum(calls), 1),
            "turns_mean": statistics.fmean(s.metadata["turns"] for s in multi)}


def failure_counts(samples) -> dict:
    """How many samples failed and why: ``failed_samples`` and ``failed/<stage>/<error type>`` counts
    (the error texts are in run_dir/failed_samples.jsonl)."""
    out = {"failed_samples": 0}
    for s in samples:
        if s.status.value == "failed":
            out["failed_samples"] += 1
            why = f"failed/{s.metadata.get('error_stage', 'rollout')}/{s.metadata.get('error', 'unknown').split(':')[0]}"
            out[why] = out.get(why, 0) + 1
    return out


def finish(cfg: Config, c: Components, run_dir: Path, log: MetricsLog, seconds: float, weights: dict | None) -> dict:
    if cfg.run.save_final:
        c.trainer.model.save_pretrained(run_dir / "final", state_dict=weights, safe_serialization=True)
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
