"""Reward functions in the shapes other frameworks document (TRL, verl, slime), written as their users
write them: strop must take them unchanged (strop/rollout/reward_adapters.py, docs/migrating.md)."""

import re


# ---- TRL (GRPOTrainer reward_funcs): completions and dataset columns as keyword lists ----
def reward_len(completions, **kwargs):
    """TRL's documentation example: prefer completions of about 20 characters."""
    return [-abs(20 - len(completion)) for completion in completions]


def trl_accuracy(completions, solution, **kwargs):
    """A reward that reads the dataset's ``solution`` column (TRL passes every column by name)."""
    return [1.0 if c.strip().endswith(str(s)) else 0.0 for c, s in zip(completions, solution)]


def trl_answer_column(completions, answer, **kwargs):
    """Reads the label under the data's own label column name (data.label_key=answer)."""
    return [1.0 if str(a) in c else 0.0 for c, a in zip(completions, answer)]


def trl_chat_len(prompts, completions, **kwargs):
    """Conversational format: prompts and completions are message lists."""
    return [float(len(c[0]["content"]) + len(p)) for p, c in zip(prompts, completions)]


def trl_needs_column(completions, difficulty, **kwargs):
    return [float(d) for d in difficulty]


def any_keywords(**kwargs):
    """Ambiguous from its parameters: declared with the ``trl:`` prefix."""
    return [float(len(ids)) for ids in kwargs["completion_ids"]]


def trl_quickstart(completions, ground_truth, **kwargs):
    """For the one-step runs: 1 when the answer shows up, else the share of even characters."""
    return [
        1.0 if str(g) in c else sum(ord(x) % 2 == 0 for x in c) / max(len(c), 1)
        for c, g in zip(completions, ground_truth)
    ]


# ---- verl (custom_reward_function): compute_score(data_source, solution_str, ground_truth, extra_info) ----
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A custom score in verl's shape, importable by module path; returns verl's dict form."""
    found = re.findall(r"-?\d+", solution_str)
    score = 1.0 if found and found[-1] == str(ground_truth) else 0.0
    return {"score": score + (0.5 if data_source == "arith" else 0.0), "acc": score}


def verl_no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}


# ---- slime (--custom-rm-path): async def fn(args, sample) / fn(args, samples) with --group-rm ----
async def slime_rm(args, sample):
    bonus = sample.metadata.get("bonus", 0.0)
    return (1.0 if str(sample.label) in sample.response else 0.0) + bonus


async def slime_group_rm(args, samples):
    longest = max(len(s.response) for s in samples)
    return [len(s.response) / longest for s in samples]


async def slime_quickstart(args, sample):
    assert args.rollout.n_samples_per_prompt > 0  # args: the run's config
    text = sample.response
    return 1.0 if str(sample.label) in text else sum(ord(x) % 2 == 0 for x in text) / max(len(text), 1)


def no_known_shape(x, y):
    return 0.0
