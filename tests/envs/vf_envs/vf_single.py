"""A single-turn verifiers environment: one-digit additions and products, the reply's exact number rewarded.

81 x 2 questions are generated deterministically; ``split='eval'`` takes every fifth of them and ``'train'``
the others (disjoint)."""

import verifiers.v1 as vf

SYSTEM_PROMPT = "Reply with the number only."


def questions(split: str) -> list[tuple[str, str]]:
    pairs = [(a, b, op) for op in "+*" for a in range(1, 10) for b in range(1, 10)]
    out = [(f"What is {a} {op} {b}?", str(a + b if op == "+" else a * b)) for a, b, op in pairs]
    return [q for i, q in enumerate(out) if (i % 5 == 4) == (split == "eval")]


class ArithmeticData(vf.TaskData):
    answer: str


class ArithmeticTask(vf.Task[ArithmeticData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        """1 when the last reply is exactly the answer."""
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.reward(weight=0.1)
    async def short(self, trace: vf.Trace) -> float:
        """1 / (1 + characters of the last reply): a nudge toward a bare number."""
        return 1.0 / (1.0 + len(trace.last_reply))


class ArithmeticConfig(vf.TasksetConfig):
    split: str = "train"


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, ArithmeticConfig]):
    def load(self):
        if self.config.split not in ("train", "eval"):
            raise ValueError(f"split={self.config.split!r}: choose 'train' or 'eval'")
        for question, answer in questions(self.config.split):
            yield ArithmeticTask(
                ArithmeticData(prompt=question, answer=answer, system_prompt=SYSTEM_PROMPT), self.config.task
            )


__all__ = ["ArithmeticTaskset"]
