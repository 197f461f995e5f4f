"""What rank 0's roles share: the run's parts, its directory, the event loop, the metrics log, the clock,
the progress bar and the rollout context."""

from __future__ import annotations

import sys

from strop.config import Config
from strop.observe.metrics import MetricsLog, Progress, Timer
from strop.rollout.event_loop import EventLoopThread
from strop.rollout.generate import RolloutContext
from strop.setup import Components


class Rank0:
    """Rank 0's side of a run, shared by its roles. ``loop`` (the run's one event loop, in its own thread)
    is started by :meth:`start_loop` once every role is made: a failure before leaves nothing running."""

    def __init__(self, cfg: Config, c: Components):
        self.cfg, self.c, self.run_dir = cfg, c, c.run_dir
        self.log, self.clock = MetricsLog(self.run_dir), Timer()
        self.ctx = RolloutContext(
            engine=c.engine,
            tokenizer=c.tokenizer,
            config=cfg,
            generate=c.hooks.get("generate"),
            reward=c.reward_fn,
            filter=c.hooks.get("filter"),
            run_dir=self.run_dir,
            # (reward.endpoint: the judge's counts, calls, retries and failures by cause, join each step's metrics)
            extra=dict(c.rollout_extra) | ({"judge": c.reward_fn.__self__} if cfg.reward.endpoint else {}),
            sample_retries=cfg.rollout.sample_retries,
        )
        # the bar on a terminal only: in a file or a pipe the step lines say the same (strop.roles.outputs)
        self.bar_shown = cfg.run.progress and sys.stderr.isatty()
        self.progress = Progress(cfg.train.steps, enabled=self.bar_shown)
        self.t_step = 0.0  # when the step being made started (its rollout)
        self.loop: EventLoopThread | None = None
        self.stop_rollout = None  # the rollout's close() coroutine function, run in the loop at close

    def start_loop(self) -> None:
        """The event loop; a wait on it is as long as the other ranks wait for rank 0."""
        self.loop = EventLoopThread(self.cfg.parallel.controller_timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop generating, close the logs, the engine and launched servers, then the event loop;
        each wait on the loop at most ``timeout_s``."""
        self.progress.close()
        try:
            self.log.close()
            if self.stop_rollout is not None:
                self.loop.run(self.stop_rollout(), timeout_s)
        finally:
            try:
                self.c.close(lambda coroutine: self.loop.run(coroutine, timeout_s))
            finally:
                self.loop.close(timeout_s)
