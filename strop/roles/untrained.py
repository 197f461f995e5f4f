"""``strop rollout``: the train side's stand-ins in a run that trains nothing. The weights never change,
so there is nothing to train, send to the engine, evaluate again or checkpoint; the rollout role writes the
samples file (strop.roles.rollout) and the outputs role reports it (strop.roles.outputs.SamplesOutputs)."""

from __future__ import annotations

from strop.roles.evaluation import Evaluation
from strop.roles.placement import EVERY_RANK, RANK0


class NoTraining:
    """The train step of a run that trains nothing: no metrics, no weights."""

    placement = EVERY_RANK

    def step(self, samples: list) -> dict:
        return {}

    def weights(self) -> None:
        return None

    def final_weights(self) -> None:
        return None


class NoSync:
    """The weights never change: the engine keeps those it started with."""

    placement = EVERY_RANK

    def update(self, step: int, weights: None, metrics: dict) -> None:
        pass


class NoCheckpoints:
    """Nothing to resume from or save: a run that trains nothing starts again."""

    placement = EVERY_RANK

    def latest(self, resume: bool) -> None:
        return None

    def after(self, step: int, weights: None) -> None:
        pass


class FirstEvaluation(Evaluation):
    """The held-out accuracy of the initial weights (step 0) only: later steps have the same weights."""

    placement = RANK0

    def after(self, step: int) -> None:
        pass
