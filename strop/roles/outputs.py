"""The outputs role: what a run writes and prints (config, metrics, trackers, progress, curves, summary, final model)."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from strop import checkpoint
from strop.config import save_config
from strop.observe.logs import FILE_ONLY
from strop.observe.metrics import memory_metrics, plot_curves, run_summary, write_summary
from strop.observe.tracking import open_trackers
from strop.parallel.gather import whole
from strop.roles.placement import RANK0
from strop.roles.rank0 import Rank0

log = logging.getLogger(__name__)

STEP_LINE = (
    ("reward_mean", "reward {:.3f}"),
    ("accuracy", "accuracy {:.1%}"),
    ("response_length_mean", "length {:.1f}"),
    ("weight_sync_fraction", "weights sent {:.1%} of a full update"),  # (delta and adapter updates)
)


def step_line(desk: Rank0, step: int, metrics: dict) -> None:
    """A step's line: in run.log always, on the terminal too when no progress bar shows the step."""
    parts = [f"strop: step {step}/{desk.cfg.train.steps}"]
    for key, text in STEP_LINE:
        value = metrics.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            parts.append(text.format(value))
    parts.append(f"{metrics['step_seconds']:.1f}s")
    shown = desk.cfg.run.progress and not desk.bar_shown  # run.progress=false: no step display at all
    log.info(", ".join(parts), extra=None if shown else FILE_ONLY)


class Outputs:
    """Rank 0's outputs: the run's header, a row of metrics per step, and at the end the summary."""

    placement = RANK0

    def __init__(self, desk: Rank0):
        self.desk = desk

    def start(self) -> None:
        """Save the config (from here on the run can be resumed) and print where the run is."""
        d = self.desk
        save_config(d.cfg, d.run_dir / "config.yaml")
        log.info(f"strop: run directory {d.run_dir}")
        if d.c.trainer.dp.processes > 1:
            log.info(f"strop: {d.c.trainer.dp.describe()}")
        log.info(f"strop: device {d.c.trainer.device}")
        log.info(f"strop: train: {d.c.trainer.describe_layout()}")

    def open_trackers(self, resume: bool, found: str | None) -> None:
        """The trackers (wandb...), told the step a resumed run continues after (-1: from step 0)."""
        d, r = self.desk, self.desk.cfg.run
        resume_step = (checkpoint.load_controller_state(found)["step"] if found else -1) if resume else None
        d.log.trackers = open_trackers(
            r.trackers,
            d.run_dir,
            d.cfg.model_dump(mode="json"),
            project=r.wandb_project,
            mode=r.wandb_mode,
            resume_step=resume_step,
        )

    def step(self, step: int, metrics: dict) -> None:
        """The step's row of metrics.jsonl, and the progress bar."""
        d = self.desk
        row = {"step": step, "step_seconds": time.perf_counter() - d.t_step, "elapsed_seconds": d.clock()}
        d.log.log(metrics | memory_metrics(d.c.trainer.device) | row)
        d.progress.update(1, reward=metrics["reward_mean"])
        step_line(d, step, metrics | row)

    def finish(self, weights: dict | None):
        """Save the final model, draw the curves, write and print the summary."""
        d = self.desk
        d.progress.close()
        cfg, c, run_dir, seconds = d.cfg, d.c, d.run_dir, d.clock()
        if cfg.run.save_final:
            c.trainer.model.save_pretrained(run_dir / "final", state_dict=whole(weights), safe_serialization=True)
            c.tokenizer.save_pretrained(run_dir / "final")
            if c.trainer.adapters is not None:  # LoRA: final/ holds the merged model, final/adapter peft's adapter
                c.trainer.adapters.save(run_dir / "final" / "adapter")
        if cfg.run.plot:
            plot_curves(d.log.rows, run_dir / "curves.png")
        summary = run_summary(d.log.rows, seconds, run_dir)
        write_summary(run_dir, summary)
        curve = " -> ".join(f"{a:.1%}" for a in summary["eval_accuracy_curve"]) or "no eval set"
        log.info(
            f"strop: {summary['steps']} steps in {seconds:.0f}s; held-out greedy accuracy {curve}; "
            f"max train/rollout logprob gap {summary['max_train_rollout_logprob_abs_diff']:.1e}; "
            f"outputs in {run_dir}"
        )
        return summary

    def failed(self, exc: BaseException) -> None:
        """A summary that says the run did not finish (rank 0 alone: the other ranks may be gone)."""
        d = self.desk
        write_summary(
            d.run_dir,
            {
                "status": "failed",
                "error": f"{type(exc).__name__}: {exc}",
                "steps": sum("reward_mean" in r for r in d.log.rows),
                "wall_seconds": round(d.clock(), 1),
            },
        )


class SamplesOutputs(Outputs):
    """``strop rollout``: the outputs of a run that trains nothing are its samples file (written by the
    rollout role): a row per step of rollout metrics, no summary."""

    placement = RANK0

    def __init__(self, desk: Rank0, samples_out: Path):
        super().__init__(desk)
        self.samples_out = samples_out

    def step(self, step: int, metrics: dict) -> None:
        d = self.desk
        row = {"step": step, "step_seconds": time.perf_counter() - d.t_step}
        d.log.log(metrics | row)
        d.progress.update(1, reward=metrics["reward_mean"])
        step_line(d, step, metrics | row)

    def finish(self, weights: None) -> Path:
        log.info(f"strop: {self.desk.cfg.train.steps} steps of scored samples -> {self.samples_out}")
        return self.samples_out

    def failed(self, exc: BaseException) -> None:
        pass  # no summary: nothing was trained
