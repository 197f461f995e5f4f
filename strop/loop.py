"""The driver: the run's story, read top to bottom by every rank (slime's ``train.py``).

Each step: rollout (rank 0 generates and scores, every rank receives the samples), the train step
(every rank), engine sync, outputs, evaluation, checkpoints. Each is a role (strop.roles) whose class
declares once where it works: rank 0 only, every rank, or rank 0 with its result handed to every rank
through the control channel (strop.roles.placement). ``strop train --data.samples`` (train only) and
``strop rollout`` (rollout only) are this same story with one side replaced by its stand-in: a
rollout that reads the samples file, or a train side that trains nothing while the rollout writes it.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from strop.process import resolve_device, stop_on_signals
from strop.config import Config
from strop.observe.logs import FILE_ONLY, close_run_log, console
from strop.parallel.runtime import Control, process_group
from strop.roles.checkpoints import CheckpointRecord, Checkpoints
from strop.roles.evaluation import Evaluation
from strop.roles.outputs import Outputs, SamplesOutputs
from strop.roles.placement import Placed
from strop.roles.rank0 import Rank0
from strop.roles.rollout import Rollout, SamplesFileRollout
from strop.roles.sync import EngineSync
from strop.roles.train import TrainStep
from strop.roles.untrained import EvaluationOnly, FirstEvaluation, NoCheckpoints, NoSync, NoTraining
from strop.setup import Components, build

log = logging.getLogger(__name__)


@dataclass
class Roles:
    """The cast of a run, each :class:`Placed` where its class says; ``desk``: what rank 0's roles
    share (strop.roles.rank0), None on the other ranks."""

    rollout: Placed
    train: Placed
    sync: Placed
    outputs: Placed
    evaluation: Placed
    checkpoints: Placed
    desk: Rank0 | None = None


def train(cfg: Config, resume: bool = False) -> dict | None:
    """Run RL on every rank of this job (one program: rank 0 also rolls out, evaluates and writes).
    ``resume``: continue the run in ``cfg.run.dir`` from its newest checkpoint (strop.checkpoint)."""
    console()  # its lines on the terminal, unless the caller set up strop's logging
    with stop_on_signals() as closing, _run_log_closed():
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        device = resolve_device(cfg.run.device)
        with process_group(device):
            control = Control(cfg.parallel.controller_timeout_s)
            c = build(cfg, device, control, resume=resume)  # every input is checked before the run directory exists
            return drive(cfg, c, control, closing, resume=resume)


def rollout_only(cfg: Config, out: Path | None = None) -> Path:
    """``strop rollout``: what a sync run would generate and score, step by step, written to ``out``
    (default <run dir>/rollout_samples.jsonl) with no training. The weights never change, so this is
    the run's first step exactly (and later steps on the initial weights)."""
    if cfg.rollout.mode != "sync":
        raise ValueError(
            f"strop rollout generates without training: rollout.mode={cfg.rollout.mode!r} has "
            "no weight updates to be ahead of; use rollout.mode=sync"
        )
    console()
    with stop_on_signals() as closing, _run_log_closed():
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        device = resolve_device(cfg.run.device)
        control = Control()
        c = build(cfg, device, control)
        return drive(cfg, c, control, closing, samples_out=out, trains=False)


def evaluate_only(cfg: Config, out: Path | None = None) -> dict:
    """``strop eval``: the held-out prompts scored once on the model as it is (greedy, as a run's evaluation
    scores them), each sample written to ``out`` (default <run dir>/eval_samples.jsonl); returns the metrics."""
    console()
    with stop_on_signals() as closing, _run_log_closed():
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        device = resolve_device(cfg.run.device)
        c = build(cfg, device, Control())
        return drive(cfg, c, Control(), closing, samples_out=out, trains=False, evaluates=True)


def story(cfg: Config, roles: Roles, resume: bool = False):
    """The run, on every rank: start (or resume), then each step, then the end."""
    roles.outputs.start()  # the config first: from here on the run can be resumed
    roles.rollout.announce()
    found = roles.checkpoints.latest(resume)  # the checkpoint to resume from, or None
    roles.outputs.open_trackers(resume, found)
    first = 1
    if found is None:
        roles.evaluation.at(0)
    else:  # every rank loads its state, then the engine gets the checkpoint's weights
        first = roles.checkpoints.restore(found) + 1
    for step in range(first, cfg.train.steps + 1):
        samples, metrics = roles.rollout.next(step)  # rank 0 generates, all receive
        metrics |= roles.train.step(samples)  # every rank: advantages, loss, optimizer step(s)
        weights = roles.train.weights()  # sharded (FSDP, TP): gathered a bucket at a time as rank 0 reads
        roles.sync.update(step, weights, metrics)
        roles.outputs.step(step, metrics)
        roles.evaluation.after(step)
        roles.checkpoints.after(step, weights)
        del weights
    return roles.outputs.finish(roles.train.final_weights())


def drive(
    cfg: Config,
    c: Components,
    control: Control,
    closing,
    resume: bool = False,
    samples_out: Path | None = None,
    trains: bool = True,
    evaluates: bool = False,
):
    """Cast the roles (``trains=False``: the train side's stand-ins, the samples to ``samples_out``), tell
    the story, and stop everything the run started however it ends."""
    roles, error = None, None
    try:
        roles = cast(cfg, c, control) if trains else cast_untrained(cfg, c, control, samples_out, evaluates)
        if evaluates:  # strop eval: the start lines, then the one evaluation
            roles.outputs.start()
            roles.rollout.announce()
            return roles.evaluation.at(0)
        return story(cfg, roles, resume)
    except BaseException as exc:  # leave a summary that says the run did not finish, then re-raise
        error = exc
        if roles is not None and roles.outputs.here is not None:
            after(error, roles.outputs.here.failed, exc)
        log.error(f"strop: the run failed: {type(exc).__name__}: {exc}", extra=FILE_ONLY)  # the caller says it
        raise
    finally:
        closing()
        shut_down(roles, c, error)


@contextmanager
def _run_log_closed():
    """The run's run.log (opened with its directory, strop.observe.run_dir) closed however the run ends."""
    try:
        yield
    finally:
        close_run_log()


def cast(cfg: Config, c: Components, control: Control) -> Roles:
    """The roles of a training run; train only (``data.samples``): the rollout reads the samples file."""
    rollout = SamplesFileRollout if cfg.data.samples else Rollout
    here = control.on_controller(_rank0_cast, cfg, c, rollout, share=False) or {}  # None on the other ranks
    record = Placed(control, CheckpointRecord, here.get("record"))
    return Roles(
        rollout=Placed(control, rollout, here.get("rollout")),
        train=Placed(control, TrainStep, TrainStep(cfg, c.trainer)),
        sync=Placed(control, EngineSync, here.get("sync")),
        outputs=Placed(control, Outputs, here.get("outputs")),
        evaluation=Placed(control, Evaluation, here.get("evaluation")),
        checkpoints=Placed(
            control, Checkpoints, Checkpoints(control, c.trainer, record, cfg.run.save_every, cfg.train.steps)
        ),
        desk=here.get("desk"),
    )


def _rank0_cast(cfg: Config, c: Components, rollout_role: type) -> dict:
    desk = Rank0(cfg, c)
    rollout = rollout_role(desk)
    here = {
        "desk": desk,
        "rollout": rollout,
        "sync": EngineSync(desk, rollout),
        "outputs": Outputs(desk),
        "evaluation": Evaluation(desk),
        "record": CheckpointRecord(desk, rollout),
    }
    desk.start_loop()  # last: a failure above leaves nothing running
    return here


def cast_untrained(
    cfg: Config, c: Components, control: Control, samples_out: Path | None, evaluates: bool = False
) -> Roles:
    """The roles of ``strop rollout``: the train side's stand-ins (strop.roles.untrained); the rollout writes
    every step's samples to ``samples_out``. ``evaluates`` (``strop eval``): the evaluation writes them."""
    here = control.on_controller(_rank0_untrained_cast, cfg, c, samples_out, evaluates, share=False) or {}
    return Roles(
        rollout=Placed(control, Rollout, here.get("rollout")),
        train=Placed(control, NoTraining, NoTraining()),
        sync=Placed(control, NoSync, NoSync()),
        outputs=Placed(control, SamplesOutputs, here.get("outputs")),
        evaluation=Placed(control, EvaluationOnly if evaluates else FirstEvaluation, here.get("evaluation")),
        checkpoints=Placed(control, NoCheckpoints, NoCheckpoints()),
        desk=here.get("desk"),
    )


def _rank0_untrained_cast(cfg: Config, c: Components, samples_out: Path | None, evaluates: bool) -> dict:
    desk = Rank0(cfg, c)
    out = Path(samples_out) if samples_out else desk.run_dir / f"{'eval' if evaluates else 'rollout'}_samples.jsonl"
    here = {
        "desk": desk,
        "rollout": Rollout(desk, None if evaluates else out),
        "outputs": SamplesOutputs(desk, out),
        "evaluation": EvaluationOnly(desk, out) if evaluates else FirstEvaluation(desk),
    }
    desk.start_loop()
    return here


def after(error: BaseException | None, fn, *args) -> None:
    """``fn(*args)``. After ``error`` (the run's own), a failure of ``fn`` is printed, never raised
    in the place of ``error``."""
    try:
        fn(*args)
    except Exception as exc:
        if error is None:
            raise
        log.error(
            f"strop: after {type(error).__name__}: {error}: {getattr(fn, '__qualname__', fn)} failed too: "
            f"{type(exc).__name__}: {exc}"
        )


def shut_down(roles: Roles | None, c: Components, error: BaseException | None = None) -> None:
    """Stop everything the run started: rank 0's event loop, the engine, launched servers (what
    build started, when rank 0's roles were never made)."""
    desk = roles.desk if roles is not None else None
    after(error, desk.close if desk is not None else c.close)
