"""The driver: rollout → rewards → advantages → train → sync weights → log → eval, per step."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from strop import checkpoint
from strop.cluster.process import resolve_device, stop_on_signals
from strop.config import Config
from strop.controller import Controller
from strop.parallel.runtime import Control, process_group
from strop.rollout.samples_file import write_header
from strop.setup import Components, build


def train(cfg: Config, resume: bool = False) -> dict | None:
    """Run RL on every rank of this job (one program: rank 0 also rolls out, evaluates and writes).
    ``resume``: continue the run in ``cfg.run.dir`` from its newest checkpoint (strop.checkpoint)."""
    with stop_on_signals() as closing:
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        device = resolve_device(cfg.run.device)
        with process_group(device):
            return _run(cfg, resume, device, closing)


def _run(cfg: Config, resume: bool, device: torch.device, closing) -> dict | None:
    control = Control(cfg.parallel.controller_timeout_s)
    c = build(cfg, device, control, resume=resume)  # every input is checked before the run directory exists
    return _train(cfg, resume, control, c, closing)


def _train(cfg: Config, resume: bool, control: Control, c: Components, closing) -> dict | None:
    run, error = None, None
    try:
        run = control.on_controller(lambda: Controller(cfg, c), share=False)  # None on the other ranks
        found = control.on_controller(lambda: run.start(resume))  # the checkpoint to resume from, or None
        first = 1
        if found is not None:  # every rank loads its state, then the engine gets the checkpoint's weights
            control.on_every_rank(checkpoint.check_rank_file, found, control.rank)  # fail all ranks, not one
            checkpoint.load_trainer(found, c.trainer)
            weights = c.trainer.weights()
            first = control.on_controller(lambda: run.restore(found, weights), serving=weights) + 1
            del weights
        for step in range(first, cfg.train.steps + 1):
            samples, metrics = control.on_controller(lambda: run.rollout(step))  # rank 0 generates, all receive
            metrics |= c.trainer.step(samples)  # every rank: advantages, loss, optimizer step(s)
            weights = c.trainer.weights()  # sharded (FSDP, TP): gathered a bucket at a time as rank 0 reads
            control.on_controller(lambda: run.after_step(step, weights, metrics), share=False,
                                  serving=weights)  # sync engine, log, evaluate
            if cfg.run.save_every and (step % cfg.run.save_every == 0 or step == cfg.train.steps):
                save_checkpoint(control, run, c, step, weights)
            del weights
        weights = c.trainer.weights() if cfg.run.save_final else None
        return control.on_controller(lambda: run.finish(weights), share=False, serving=weights)
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
        run = Controller(cfg, c)
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
    control.on_controller(lambda: run.checkpoint(step, Path(tmp), weights), share=False, serving=weights)
