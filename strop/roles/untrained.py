"""``strop rollout`` and ``strop eval``: the train side's stand-ins in a run that trains nothing. The weights never change,
so there is nothing to train, send to the engine, evaluate again or checkpoint; the rollout role writes the
samples file (strop.roles.rollout) and the outputs role reports it (strop.roles.outputs.SamplesOutputs)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from strop.roles.evaluation import Evaluation
from strop.roles.placement import EVERY_RANK, RANK0

log = logging.getLogger(__name__)


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


class EvaluationOnly(FirstEvaluation):
    """``strop eval``: the held-out prompts scored once, each sample written to ``samples_out`` (its prompt,
    response, reward, status and metadata: an agent's or environment's transcript, a failure's error)."""

    def __init__(self, desk, samples_out: Path):
        super().__init__(desk)
        self.samples_out = samples_out

    def at(self, step: int) -> dict:
        cfg = self.desk.cfg
        if self.desk.c.eval_prompts is None:
            raise ValueError(
                "strop eval scores the held-out prompts and this run has none: set data.eval_size (or "
                "data.eval_path; an environment's eval split: env.verifiers_eval)"
            )
        row = super().at(step)
        with open(self.samples_out, "w") as f:
            for s in (s for g in self.groups for s in g):
                f.write(
                    json.dumps(
                        {
                            "group_id": s.group_id,
                            "prompt": s.prompt,
                            "prompt_text": self.desk.c.tokenizer.decode(s.prompt_ids, skip_special_tokens=False),
                            "response": s.response_text,
                            "reward": s.reward,
                            "status": s.status.value,
                            "label": s.label,
                            "metadata": s.metadata,
                        },
                        default=str,
                    )
                    + "\n"
                )
        log.info(
            f"strop: eval of {len(self.groups)} held-out prompts: accuracy {row['eval_accuracy']:.1%} (reward at "
            f"least {cfg.eval.accuracy_threshold:g}), mean reward {row['eval_reward_mean']:.3f} -> {self.samples_out}"
        )
        return row
