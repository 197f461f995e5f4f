"""The same GRPO step in strop and in TRL's GRPOTrainer, side by side in one run, in fp32 and in bf16.

Same model (the embedded SmolLM2-135M-Instruct), task (reasoning-gym basic_arithmetic,
strop's training rows), prompts (TRL gets exactly the prompts strop's sampler draws, in that
order), 8 prompts x 8 samples per step, response length limit, temperature, learning rate,
micro-batch size, reward (strop's math reward), no KL term, one optimizer step per batch, no
gradient checkpointing, both on this machine's CPU. Each side runs in its own process (TRL in
``.venv-trl``, made by ``scripts/setup_trl.sh``); the table reports the mean over the steps
after the first, generation seconds, generated tokens and the process's peak RSS.

Each precision is one pair of runs at equal precision:

- ``float32``: both in fp32; a third column runs strop with ``rollout.exact_logprobs=true`` (the
  trainer scores every sample: the cost of exact rollout logprobs);
- ``bfloat16``: fp32 master weights and optimizer state, bf16 compute on both sides: TRL with
  ``bf16=True`` (accelerate's CPU autocast, which also covers its ``generate``), strop with
  ``train.bf16_autocast=true`` and ``engine.dtype=bfloat16`` (the engine decodes from a bf16 copy).

The sides run in the order TRL fp32, strop fp32, strop exact, TRL bf16, strop bf16 (each pair
back to back, so drift between the pairs does not enter a ratio).

    bash scripts/setup_trl.sh && python bench/rl_step.py [--steps 3] [--new-tokens N] [--precision float32 bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL_PY = Path(os.environ.get("STROP_TRL_VENV", ROOT / ".venv-trl")) / "bin" / "python"
PROMPTS_PER_STEP, SAMPLES_PER_PROMPT = 8, 8


def settings(new_tokens: int | None) -> dict:
    from strop.config import Config

    cfg = Config()
    return {
        "max_new_tokens": new_tokens or cfg.rollout.max_new_tokens,
        "temperature": cfg.rollout.temperature,
        "lr": cfg.train.lr,
        "micro_batch_size": cfg.train.micro_batch_size,
        "seed": cfg.train.seed,
    }


def strop_side(args, out: Path) -> None:
    """`strop train` as a user runs it; per-step figures from its metrics.jsonl."""
    s = settings(args.new_tokens)
    with tempfile.TemporaryDirectory() as d:
        cmd = [
            sys.executable,
            "-m",
            "strop.cli",
            "train",
            f"--train.steps={args.steps}",
            "--data.eval_size=0",
            "--run.save_every=0",
            f"--run.dir={d}/run",
            "--run.progress=false",
            f"--rollout.prompts_per_step={PROMPTS_PER_STEP}",
            f"--rollout.n_samples_per_prompt={SAMPLES_PER_PROMPT}",
            f"--rollout.max_new_tokens={s['max_new_tokens']}",
            f"--rollout.exact_logprobs={str(args.exact).lower()}",
        ]
        if args.dtype == "bfloat16":
            cmd += ["--train.bf16_autocast=true", "--engine.dtype=bfloat16"]
        if args.device != "cpu":
            cmd += [f"--run.device={args.device}"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rows = [json.loads(x) for x in (Path(d) / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "step_seconds" in r]
    out.write_text(
        json.dumps(
            {
                "step_seconds": [r["step_seconds"] for r in rows],
                "generation_seconds": [r["rollout_seconds"] for r in rows],
                "generated_tokens": [r["response_length_mean"] * PROMPTS_PER_STEP * SAMPLES_PER_PROMPT for r in rows],
                "peak_rss_gib": max(
                    r.get("cuda_peak_allocated_gib" if args.device != "cpu" else "peak_rss_gib", 0.0) for r in rows
                ),
                "logprob_gap": [r.get("train_rollout_logprob_abs_diff") for r in rows],
                "train_seconds": [r["train_seconds"] for r in rows],
                "train_tokens": [r["train_tokens_per_s"] * r["train_seconds"] for r in rows],
            }
        )
    )


def drawn_prompts(steps: int) -> list[tuple[list[dict], str]]:
    """(chat messages, label) of the prompts strop's sampler draws over ``steps`` steps, in order."""
    from strop.config import Config
    from strop.data.sources import PromptSampler, reasoning_gym_rows

    d = Config().data
    rows = reasoning_gym_rows(d.task, d.seed, d.size, d.task_options)
    sampler = PromptSampler(len(rows), d.seed, d.shuffle)  # strop's draw order, step by step
    drawn = [rows[i] for i, _ in sampler.draw(PROMPTS_PER_STEP * steps)]

    def messages(row):
        text = d.prompt_template.format(prompt=row.prompt)
        return ([{"role": "system", "content": d.system_prompt}] if d.system_prompt else []) + [
            {"role": "user", "content": text}
        ]

    return [(messages(r), str(r.label)) for r in drawn]


def fractions(result: dict, steps: int, limits, dtype: str = "float32") -> tuple[float, float]:
    """strop's generation and training, each as a fraction of this machine's bound (bench/limits.py) in
    ``dtype``: decode of the step's rows at their mean context, and 6 x parameters x trained tokens of matmuls."""
    from limits import decode_bound, model_shape, train_bound_seconds
    from strop.config import Config
    from strop.models import load_model, load_tokenizer

    cfg = Config()
    tok, shape = load_tokenizer(cfg.model.path), model_shape(load_model(cfg.model.path))
    prompts = [
        len(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False))
        for m, _ in drawn_prompts(steps)
    ]
    tokens = statistics.fmean(result["generated_tokens"][1:] or result["generated_tokens"])
    context = statistics.fmean(prompts) + tokens / (2 * PROMPTS_PER_STEP * SAMPLES_PER_PROMPT)
    bound = decode_bound(shape, PROMPTS_PER_STEP * SAMPLES_PER_PROMPT, int(context), limits, dtype)
    generation = tokens / statistics.fmean(result["generation_seconds"][1:] or result["generation_seconds"]) / bound
    train = statistics.fmean(
        train_bound_seconds(shape, int(n), limits, dtype) / t
        for n, t in zip(
            result["train_tokens"][1:] or result["train_tokens"], result["train_seconds"][1:] or result["train_seconds"]
        )
    )
    return generation, train


def generation_floor(result: dict, dtype: str) -> tuple[float, str]:
    """Seconds per step that strop's rollout spends in its linear layers alone, with the fastest kernel this
    CPU has for the batch's shape (bench/limits.py ``decode_linear_seconds``), over the step's mean response
    length: a floor under the generation time of any decoder doing this work with these kernels (prefill,
    attention and sampling come on top)."""
    from limits import decode_linear_seconds
    from strop.config import Config
    from strop.models import load_model

    rows = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
    per_step = decode_linear_seconds(load_model(Config().model.path), rows, dtype)
    kernel = min(per_step, key=per_step.get)
    steps = mean_after_first(result["generated_tokens"]) / rows
    return per_step[kernel] * steps, kernel


def mean_after_first(xs):
    return statistics.fmean(xs[1:] if len(xs) > 1 else xs)


def trl_side(args, out: Path) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from common import timed
    from trl import GRPOConfig, GRPOTrainer

    from strop.config import Config
    from strop.rollout.rewards import math_equal
    from strop.models import load_tokenizer, resolve_model_path

    s, cfg = settings(args.new_tokens), Config()
    data = Dataset.from_list([{"prompt": m, "label": label} for m, label in drawn_prompts(args.steps)])

    def reward(completions, label, **_):
        return [
            1.0 if math_equal(c[0]["content"] if isinstance(c, list) else c, g) else 0.0
            for c, g in zip(completions, label)
        ]

    path = resolve_model_path(cfg.model.path)
    tok = load_tokenizer(cfg.model.path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
    with tempfile.TemporaryDirectory() as tmp:
        conf = GRPOConfig(
            output_dir=tmp,
            max_steps=args.steps,
            learning_rate=s["lr"],
            lr_scheduler_type="constant_with_warmup",
            warmup_steps=cfg.train.warmup_steps,
            weight_decay=cfg.train.weight_decay,
            max_grad_norm=cfg.train.grad_clip,
            per_device_train_batch_size=s["micro_batch_size"],
            gradient_accumulation_steps=batch // s["micro_batch_size"],
            num_generations=SAMPLES_PER_PROMPT,
            max_completion_length=s["max_new_tokens"],
            temperature=s["temperature"],
            top_p=1.0,
            top_k=0,
            beta=0.0,
            num_iterations=1,
            shuffle_dataset=False,
            use_cpu=args.device == "cpu",
            bf16=args.dtype == "bfloat16",
            fp16=False,
            gradient_checkpointing=False,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            seed=s["seed"],
            dataloader_num_workers=0,
            log_completions=False,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=conf, train_dataset=data, processing_class=tok)
        gen_seconds, step_seconds, lengths = [], [], []
        trainer._generate = timed(trainer._generate, gen_seconds)

        class Clock(TrainerCallback):
            def on_step_begin(self, *a, **k):
                self.t = time.perf_counter()

            def on_step_end(self, *a, **k):
                step_seconds.append(time.perf_counter() - self.t)

            def on_log(self, _args, _state, _control, logs=None, **k):
                if logs and "completions/mean_length" in logs:
                    lengths.append(logs["completions/mean_length"])

        trainer.add_callback(Clock())
        trainer.train()
    out.write_text(
        json.dumps(
            {
                "step_seconds": step_seconds,
                "generation_seconds": gen_seconds,
                "generated_tokens": [x * batch for x in lengths],
                "peak_rss_gib": (
                    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
                    if args.device == "cpu"
                    else torch.cuda.max_memory_allocated() / 2**30
                ),
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=None, help="response length limit (default: strop's)")
    ap.add_argument("--precision", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    ap.add_argument("--no-exact", action="store_true", help="skip the exact_logprobs column")
    ap.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda (both sides on the GPU; peak memory is then "
        "torch's peak allocated GPU memory, the bounds the GPU's)",
    )
    ap.add_argument("--side", choices=["strop", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--exact", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        return (strop_side if args.side == "strop" else trl_side)(args, args.out)
    if not TRL_PY.exists():
        sys.exit(f"TRL is not installed ({TRL_PY} missing): run `bash scripts/setup_trl.sh` first")
    s = settings(args.new_tokens)
    print(
        f"GRPO step: {PROMPTS_PER_STEP} prompts x {SAMPLES_PER_PROMPT} samples, up to {s['max_new_tokens']} new "
        f"tokens, temperature {s['temperature']}, lr {s['lr']}, micro-batch {s['micro_batch_size']}, "
        f"{args.steps} steps (mean over steps 2..{args.steps}), precisions: {' '.join(args.precision)}",
        flush=True,
    )
    sides = []  # (precision, name, python, extra arguments)
    for dtype in args.precision:
        sides += [(dtype, "TRL GRPOTrainer", str(TRL_PY), []), (dtype, "strop", sys.executable, [])]
        if dtype == "float32" and not args.no_exact:  # (refused with the bf16 engine: it samples other numbers)
            sides.append((dtype, "strop exact_logprobs", sys.executable, ["--exact"]))
    from limits import measure

    results, limits = {}, [measure(args.device)]  # (and again at the end: the bound is the better of the two)
    with tempfile.TemporaryDirectory() as d:
        for dtype, name, py, extra in sides:
            out = Path(d) / "out.json"
            side = "trl" if name.startswith("TRL") else "strop"
            cmd = [
                py,
                __file__,
                "--side",
                side,
                "--out",
                str(out),
                "--steps",
                str(args.steps),
                "--dtype",
                dtype,
                "--device",
                args.device,
                *extra,
            ]
            if args.new_tokens:
                cmd += ["--new-tokens", str(args.new_tokens)]
            t = time.perf_counter()
            subprocess.run(cmd, check=True, cwd=ROOT, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
            results[dtype, name] = json.loads(out.read_text())
            print(f"  {name} ({dtype}): done in {time.perf_counter() - t:.0f} s", flush=True)

    limits.append(measure(args.device))
    print("\n".join(f"{when}: {lim.describe()}" for when, lim in zip(("before", "after"), limits)))

    print()
    print(
        "| precision | | s/step | generation s/step | generated tokens/step | peak RSS GiB | step vs TRL | "
        "generation vs TRL |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.precision:
        trl = results[dtype, "TRL GRPOTrainer"]
        trl_step, trl_gen = mean_after_first(trl["step_seconds"]), mean_after_first(trl["generation_seconds"])
        for (p, name), r in results.items():
            if p != dtype:
                continue
            step, gen = mean_after_first(r["step_seconds"]), mean_after_first(r["generation_seconds"])
            print(
                f"| {dtype} | {name} | {step:.1f} | {gen:.1f} | {mean_after_first(r['generated_tokens']):.0f} | "
                f"{r['peak_rss_gib']:.2f} | {trl_step / step:.2f}x | {gen / trl_gen:.2f}x TRL's time |"
            )
    print()
    for dtype in args.precision:
        best = max(limits, key=lambda lim: lim.flops[dtype])
        generation, train = fractions(results[dtype, "strop"], args.steps, best, dtype)
        print(
            f"strop {dtype} against this machine's bounds (bench/limits.py): generation at {generation:.2f} of the "
            f"{dtype} decode bound for {PROMPTS_PER_STEP * SAMPLES_PER_PROMPT} rows, training at {train:.2f} of "
            f"6 x parameters x tokens of {dtype} matmul"
        )
    for dtype in args.precision:
        floor, kernel = generation_floor(results[dtype, "strop"], dtype)
        trl_gen = mean_after_first(results[dtype, "TRL GRPOTrainer"]["generation_seconds"])
        print(
            f"strop {dtype} generation floor: its linears alone ({kernel} kernels, batch "
            f"{PROMPTS_PER_STEP * SAMPLES_PER_PROMPT}, mean response length) take {floor:.1f} s per step = "
            f"{floor / trl_gen:.2f} of TRL's generation time"
        )
    if ("float32", "strop exact_logprobs") in results:
        plain, exact = (
            mean_after_first(results["float32", k]["step_seconds"]) for k in ("strop", "strop exact_logprobs")
        )
        print(
            f"\nexact_logprobs costs {exact / plain:.2f}x strop's fp32 step; its train/rollout logprob gap per step: "
            f"{results['float32', 'strop exact_logprobs']['logprob_gap']} "
            f"(default mode: {results['float32', 'strop']['logprob_gap']})"
        )
    for dtype in args.precision:
        print(f"strop {dtype}: train/rollout logprob gap per step {results[dtype, 'strop']['logprob_gap']}")


if __name__ == "__main__":
    main()
