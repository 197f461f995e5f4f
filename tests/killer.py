"""``python tests/killer.py train ...``: ``strop train`` that SIGKILLs itself at a chosen point.

``STROP_KILL_AT=PHASE:STEP`` picks the point, ``STROP_KILL_RANK`` the rank that dies (default 0):

- ``rollout:S``  during step S's generation (the engine's third sampling step of that step);
- ``backward:S`` inside the backward pass of step S's first micro-batch;
- ``save:S``     while saving step S's checkpoint: every file written, the folder not yet renamed.

Workers of ``--nproc N`` run this file too, so the point can be on any rank.
"""

import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import strop.checkpoint  # noqa: E402
import strop.cluster.local  # noqa: E402
import strop.train.policy  # noqa: E402
import strop.train.trainer  # noqa: E402
from strop.cli import main  # noqa: E402
from strop.serving.embedded import EmbeddedEngine

PHASE, _, STEP = os.environ.get("STROP_KILL_AT", "none:0").partition(":")
STEP = int(STEP or 0)
ME = os.environ.get("RANK", "0") == os.environ.get("STROP_KILL_RANK", "0")
state = {"step": 0, "samples": 0}


def die(where: str) -> None:
    print(f"killer: SIGKILL at {where}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


_step = strop.train.trainer.Trainer.step


def step(self, samples):
    state["step"] = self.steps_done + 1
    return _step(self, samples)


strop.train.trainer.Trainer.step = step

if PHASE == "rollout" and ME:
    from strop.rollout.manager import RolloutManager

    _sample = EmbeddedEngine._sample
    _batch = RolloutManager.batch

    async def batch(self, step):
        state["rollout_step"] = step
        return await _batch(self, step)

    def sample(self, *args, **kw):
        if state.get("rollout_step") == STEP:
            state["samples"] += 1
            if state["samples"] == 3:
                die(f"rollout of step {STEP}")
        return _sample(self, *args, **kw)

    EmbeddedEngine._sample = sample
    RolloutManager.batch = batch

if PHASE == "backward" and ME:
    _objective = strop.train.policy.policy_objective

    def objective(*args, **kw):
        loss, pg, tok = _objective(*args, **kw)
        if state["step"] == STEP and loss.requires_grad:
            loss.register_hook(lambda g: die(f"backward of step {STEP}"))
        return loss, pg, tok

    strop.train.policy.policy_objective = objective

if PHASE == "save" and ME:
    _fsync = strop.checkpoint._fsync_tree

    def fsync(folder):
        _fsync(folder)
        if folder.name.endswith(f"step_{STEP:06d}"):
            die(f"save of step {STEP}")

    strop.checkpoint._fsync_tree = fsync

# workers of --nproc run this file as well
_launch = strop.cluster.local.launch


def launch(nproc, argv, command, *args, **kwargs):  # the front door hands down its own program: run this file
    return _launch(nproc, argv, [sys.executable, os.path.abspath(__file__), "train"], *args, **kwargs)


strop.cluster.local.launch = launch

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
