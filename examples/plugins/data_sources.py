"""Data source hooks: prompt rows from anywhere.

strop train --plugins.data_source=examples.plugins.data_sources:two_digit_sums
"""

import random


def two_digit_sums(config, split: str) -> list[dict]:
    """'What is a + b?' with a, b < 100; the eval split uses a different seed (held out)."""
    rng = random.Random(config.seed if split == "train" else config.eval_seed)
    n = config.size if split == "train" else config.eval_size
    rows = []
    for _ in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        rows.append({"prompt": f"What is {a} + {b}?", "label": str(a + b), "metadata": {"a": a, "b": b}})
    return rows
