"""The checkpoint role: every rank writes its trainer state, rank 0 adds the rest and renames the folder into
place; a resumed run reads them back (strop.checkpoint)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from strop import checkpoint
from strop.engines.base import Seeded
from strop.parallel.gather import whole
from strop.parallel.runtime import Control
from strop.roles.placement import CONTROL, EVERY_RANK, Placed
from strop.roles.rank0 import Rank0
from strop.roles.rollout import Rollout
from strop.train.trainer import Trainer

log = logging.getLogger(__name__)


class Checkpoints:
    """Every rank's part of checkpoints: its trainer state; rank 0's part is ``record``'s."""

    placement = EVERY_RANK

    def __init__(self, control: Control, trainer: Trainer, record: Placed, save_every: int, last_step: int):
        self.control, self.trainer, self.record = control, trainer, record
        self.save_every, self.last_step = save_every, last_step

    def latest(self, resume: bool) -> str | None:
        """Resuming, the newest complete checkpoint (None: there is none, the run starts again from step 0)."""
        return self.record.latest(resume)

    def restore(self, found: str) -> int:
        """Every rank loads its state, then the engine gets the checkpoint's weights. Returns its step."""
        self.control.on_every_rank(checkpoint.check_rank_file, found, self.control.rank)  # fail all ranks, not one
        checkpoint.load_trainer(found, self.trainer)
        weights = self.trainer.weights()
        return self.record.restore(found, weights)

    def after(self, step: int, weights) -> None:
        """Save after every ``run.save_every``-th step and the last."""
        if self.save_every and (step % self.save_every == 0 or step == self.last_step):
            tmp = Path(self.record.begin(step))
            checkpoint.save_trainer(tmp, self.trainer)  # collective: returns on rank 0 once every rank has written
            self.record.finish(step, tmp, weights)


class CheckpointRecord:
    """Rank 0's part of checkpoints: the controller state (sampler, engine sampling state, clock, log sizes,
    what the rollout holds), the folder's completion, and a resume's side of all of it."""

    placement = CONTROL

    def __init__(self, desk: Rank0, rollout: Rollout):
        self.desk, self.rollout = desk, rollout

    def latest(self, resume: bool) -> str | None:
        run_dir = self.desk.run_dir
        found = checkpoint.latest(run_dir) if resume else None
        if resume and found is None:
            log.info(
                f"strop: resume: no complete checkpoint in {run_dir / checkpoint.CHECKPOINTS}; "
                "starting again from step 0"
            )
            checkpoint.cut_logs(run_dir, {})
        return str(found) if found is not None else None

    def restore(self, found: str, weights: dict) -> int:
        """Rank 0's side of a resume: logs cut back to the checkpoint, sampler, engine sampling state,
        clock; the engine gets the checkpoint's weights. Returns the checkpoint's step."""
        d, c = self.desk, self.desk.c
        state = checkpoint.load_controller_state(found)
        checkpoint.cut_logs(d.run_dir, state["logs"])
        d.log.reload()
        if c.sampler is not None:
            c.sampler.load_state_dict(state["sampler"])
        self.rollout.load(state["rollout"], state["step"])
        generator = c.engine.generator if isinstance(c.engine, Seeded) else None
        if generator is not None and state["engine_rng"] is not None:
            generator.set_state(state["engine_rng"])
        elif c.engine is not None:
            log.info(
                "strop: resume: the engine's sampling state lives in its servers and is not restored; the "
                "steps that follow are not bitwise those of an uninterrupted run"
            )
        world = c.trainer.dp.processes
        if state.get("world", 1) != world:  # DCP reshards; the sums run in another order
            log.info(
                f"strop: resume: saved by {state.get('world', 1)} processes, resumed by {world}: "
                "the run continues, but not bitwise as it would have"
            )
        d.clock.start -= state["elapsed_seconds"]
        if c.engine is not None:
            d.loop.run(c.weight_update()(weights, version=state["weight_version"]))
        d.progress.update(state["step"])
        log.info(f"strop: resumed from {found} at step {state['step']} of {d.cfg.train.steps}")
        return state["step"]

    def begin(self, step: int) -> str:
        self.t_checkpoint = time.perf_counter()
        return str(checkpoint.begin(self.desk.run_dir, step))

    def finish(self, step: int, tmp: Path, weights: dict) -> None:
        """Complete the checkpoint every rank wrote its part of into ``tmp``."""
        d, c = self.desk, self.desk.c
        generator = c.engine.generator if isinstance(c.engine, Seeded) else None
        rollout = self.rollout.hold()  # what it holds; nothing new starts until release()
        try:
            state = {
                "step": step,
                "weight_version": step,
                "world": c.trainer.dp.processes,
                "sampler": c.sampler.state_dict() if c.sampler is not None else None,
                "engine_rng": generator.get_state() if generator is not None else None,
                "elapsed_seconds": d.clock(),
                "logs": checkpoint.log_sizes(d.run_dir),
                "rollout": rollout,
            }  # None in sync mode: it holds nothing between steps
        finally:
            self.rollout.release()
        weights = whole(weights) if d.cfg.run.checkpoint_policy else None  # (`strop export` writes it from the state)
        path = checkpoint.finish(
            d.run_dir,
            tmp,
            step,
            controller_state=state,
            weights=weights,
            model=c.trainer.model,
            tokenizer=c.tokenizer,
            keep=d.cfg.run.keep_checkpoints,
        )
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        log.info(f"strop: checkpoint {path} ({size / 2**30:.2f} GiB) in {time.perf_counter() - self.t_checkpoint:.1f}s")
