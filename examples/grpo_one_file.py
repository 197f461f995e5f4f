"""GRPO in one file, built from strop's own pieces: read it top to bottom to see what one RL step does.

    python examples/grpo_one_file.py [--model PATH] [--steps N] [--prompts N] [--samples N]
                                     [--max-new-tokens N] [--seed N]

Each step draws ``--prompts`` arithmetic problems (reasoning-gym's ``basic_arithmetic`` on two one-digit
numbers, e.g. "Calculate -5 * 9.", as ``strop train``'s default), samples ``--samples`` answers to each with
strop's in-process batching engine, scores every answer with the ``math`` reward (1 when its last \\boxed{}
answer, else its last number, equals the label as math, else 0), turns the rewards into group advantages,
takes one AdamW step on the clipped surrogate and prints one line of metrics. CPU only; the default model is
``strop train``'s, the packaged SmolLM2-135M-Instruct. ``strop train`` runs the same algorithm with every
option; this file shows the algorithm and nothing else.

The pieces: :func:`strop.models.load_model` / :func:`~strop.models.load_tokenizer` (the model),
:func:`strop.data.sources.reasoning_gym_rows` and :class:`~strop.data.sources.PromptSet` (tokenised prompts
and their :class:`strop.types.Sample` groups), :class:`strop.serving.embedded.EmbeddedEngine` (generation),
:func:`strop.rollout.rewards.math_reward`, :func:`strop.train.batch.collate` (padding),
:func:`strop.algo.advantages.grpo_advantages`, :func:`strop.train.logprob.response_logprobs`,
:func:`strop.algo.losses.ppo_clip_loss` and :func:`~strop.algo.losses.aggregate`.

Departures from textbook GRPO (Shao et al. 2024, "DeepSeekMath", section 4.1.2), and the choices it leaves open;
all but the constant learning rate (7) are ``strop train``'s defaults too:

1. **Token-level loss aggregation.** The step's loss is the sum of every response token's loss divided by the
   number of response tokens in the batch (``token_mean``, as DAPO). The paper averages over each response's
   tokens first, then over responses (``seq_mean_token_mean``), so here a long answer weighs more than a short
   one, in proportion to its length.
2. **No KL term, no reference model** (the paper's beta = 0): nothing holds the policy near its start but the
   small learning rate and the gradient-norm clip.
3. **On-policy, one optimiser step per batch.** The "old" logprobs are the current ones detached, so the ratio
   pi / pi_old is exactly 1, the clip never fires (``clip_frac`` prints 0) and the gradient is that of
   REINFORCE with the group baseline: ``-A * grad log pi`` per token. The paper's inner iterations (several
   steps on one batch) are what would make the clip matter.
4. **Std normalisation: the sample std** (divided by n - 1, as torch.std, TRL and slime), plus eps = 1e-6 in
   the denominator. A group whose rewards are all equal gets advantage 0: it teaches nothing, yet its tokens
   still count in the token-mean denominator. (Dr. GRPO drops the std: ``normalize_std=False``.)
5. **Temperature in the loss.** Answers are sampled at temperature 0.8 and the trainer scores them under the
   same ``softmax(logits / 0.8)``, the distribution they were drawn from.
6. **Answers cut at ``--max-new-tokens`` are trained on as they are**: no overlong penalty, no masking.
7. **Optimiser**: AdamW (lr 3e-5, betas 0.9 / 0.99, no weight decay) at a constant learning rate (``strop
   train`` warms up over its first 2 steps), the gradient norm clipped to 1.0.
8. **No weight transfer.** The engine decodes from the policy's own tensors (``shared=True``, as ``strop
   train``'s engine.share_weights in one process): the next step samples from the weights this step updated.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from strop.algo.advantages import grpo_advantages
from strop.algo.losses import aggregate, ppo_clip_loss
from strop.data.sources import PromptSet, reasoning_gym_rows
from strop.models import EMBEDDED_MODEL, load_model, load_tokenizer
from strop.rollout.rewards import math_reward
from strop.serving.embedded import EmbeddedEngine
from strop.train.batch import collate
from strop.train.logprob import response_logprobs
from strop.types import SamplingParams

TASK, TASK_OPTIONS = "basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
TEMPERATURE = 0.8
LR, BETAS, GRAD_CLIP = 3e-5, (0.9, 0.99), 1.0
METRICS = (
    "step",
    "reward",
    "groups_with_signal",
    "loss",
    "grad_norm",
    "response_tokens",
    "clip_frac",
    "engine_logprob_diff",
    "seconds",
)


def make_batch(
    engine: EmbeddedEngine, tokenizer, prompts: PromptSet, rows: range, n: int, sampling: SamplingParams, reward
) -> dict[str, torch.Tensor]:
    """Prompts -> sampled groups -> rewards -> advantages -> padded tensors.

    ``rows``: the prompts' indices in ``prompts`` (each one's group id is its index); ``n`` answers each.
    Returns :func:`strop.train.batch.collate`'s right-padded tensors (``input_ids``, ``attention_mask``,
    ``positions`` of the response tokens, ``loss_mask``, the engine's ``rollout_logprobs``) plus ``rewards``
    (N,), ``group_ids`` (N,) and ``advantages`` (N, 1), one scalar per answer, broadcast over its tokens."""
    samples = [s for i in rows for s in prompts.make_group(i, n, group_id=i)]
    # one call: the engine decodes every answer together, the prompt of a group prefilled once
    completions = engine.generate_batch([s.prompt_ids for s in samples], sampling)
    for s, completion in zip(samples, completions):
        s.apply_completion(completion)  # response ids, the engine's logprobs, stopped or cut at the limit
        s.response_text = tokenizer.decode(s.response_ids, skip_special_tokens=True)
        s.reward = float(reward(s))
    batch = collate(samples, tokenizer.pad_token_id)
    batch["rewards"] = torch.tensor([s.reward for s in samples])
    batch["group_ids"] = torch.tensor([s.group_id for s in samples])
    batch["advantages"] = grpo_advantages(batch["rewards"], batch["group_ids"]).unsqueeze(-1)
    return batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="GRPO in one file, from strop's pieces (see the module docstring).")
    p.add_argument(
        "--model",
        default=EMBEDDED_MODEL,
        help=f"a local Hugging Face model folder, a hub id, or {EMBEDDED_MODEL!r} (default)",
    )
    p.add_argument("--steps", type=int, default=15, help="RL steps: one batch and one optimiser step each")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (groups)")
    p.add_argument("--samples", type=int, default=8, help="answers sampled per prompt (group size)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="answer length limit")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts, the sampling and torch")
    args = p.parse_args(argv)
    for name in ("steps", "prompts", "samples", "max_new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None, reward=math_reward):
    """Run the loop; returns the trained model and each step's metrics (a dict with the keys of ``METRICS``).
    ``reward``: a function of a scored :class:`strop.types.Sample` to a float (the tests pass their own)."""
    args = parse_args(argv)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its notes on disabled timeouts, once per answer
    torch.manual_seed(args.seed)
    tokenizer, model = load_tokenizer(args.model), load_model(args.model)
    context_window = model.config.max_position_embeddings
    rows = reasoning_gym_rows(TASK, seed=args.seed, size=args.steps * args.prompts, options=TASK_OPTIONS)
    prompts = PromptSet(rows, tokenizer, max_prompt_tokens=context_window - args.max_new_tokens, name=TASK)
    stop = sorted({tokenizer.eos_token_id, tokenizer.pad_token_id} - {None})
    engine = EmbeddedEngine(
        model,
        pad_token_id=tokenizer.pad_token_id,
        default_stop_token_ids=stop,
        context_window=context_window,
        seed=args.seed,
        shared=True,
    )
    sampling = SamplingParams(temperature=TEMPERATURE, max_new_tokens=args.max_new_tokens, stop_token_ids=stop)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=0.0)
    model.train()
    history = []
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        first = (step - 1) * args.prompts
        b = make_batch(engine, tokenizer, prompts, range(first, first + args.prompts), args.samples, sampling, reward)
        mask = b["loss_mask"]
        logprobs, _ = response_logprobs(
            model, b["input_ids"], b["attention_mask"], b["positions"], temperature=TEMPERATURE
        )
        # on-policy: the old policy is this one, so the ratio is 1 and only its gradient remains (departure 3)
        per_token, info = ppo_clip_loss(logprobs, logprobs.detach(), b["advantages"])
        loss = aggregate(per_token, mask, "token_mean", num_sequences=len(mask), total_tokens=mask.sum().item())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        tokens = mask.sum().clamp(min=1)
        clipped = info["clipped_low"] | info["clipped_high"]
        signal = [bool((b["advantages"][b["group_ids"] == g] != 0).any()) for g in b["group_ids"].unique()]
        metrics = {
            "step": step,
            "reward": b["rewards"].mean().item(),
            "groups_with_signal": sum(signal) / len(signal),  # groups whose answers were scored differently
            "loss": loss.item(),
            "grad_norm": grad_norm.item(),
            "response_tokens": (tokens / len(mask)).item(),
            "clip_frac": ((clipped.float() * mask).sum() / tokens).item(),
            # the trainer's logprobs against the engine's, for the same tokens: ~0 when both run the same model
            "engine_logprob_diff": (((logprobs.detach() - b["rollout_logprobs"]).abs() * mask).sum() / tokens).item(),
            "seconds": time.perf_counter() - start,
        }
        history.append(metrics)
        print(" ".join(f"{k}={v}" if isinstance(v, int) else f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
    return model, history


if __name__ == "__main__":
    main()
