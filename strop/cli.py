"""The ``strop`` command. Each command imports the layers it runs inside its function: ``strop train --help``,
a config error and ``strop --help`` load no torch (seconds)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from strop.config import ConfigError, build_config, find_run_dir, parse_overrides, resume_config
from strop.models import EMBEDDED_MODEL
from strop.presets import PRESETS

USAGE = """strop: RL post-training for LLMs

commands:
  strop train [CONFIG.yaml] [--preset NAME] [--section.key=value ...]
                                                        run RL (no arguments: GRPO on the embedded default)
  strop train --help                                    list every option
  strop serve [--model-path PATH] [--port N] [--host H] [--token T] [--weights-dir DIR]
                                                        the embedded engine behind HTTP (SGLang-native + OpenAI routes)
  strop train --resume RUN_DIR|latest                   continue a run from its newest checkpoint
  strop rollout [CONFIG.yaml] [--out FILE] [--section.key=value ...]
                                                        generate and score a run's steps, write them, no training
  strop train --data.samples=FILE                       train on such a file, with no engine
  strop plot RUN_DIR [RUN_DIR ...] [--metrics a,b] [--out FILE]
                                                        the curves of one or several runs side by side
  strop proxy --token T [--model-path PATH] [--engine-url URL ...] [--port N]
                                                        the agent proxy alone: OpenAI routes, exact-token sessions
  strop check-plugin --hook HOOK pkg.module:function    check a plugin against its hook's contract
  strop export CHECKPOINT OUT                           a checkpoint's policy as a Hugging Face folder
"""


def export_main(argv: list[str]) -> int:
    from strop.checkpoint import CheckpointError, export_policy

    parser = argparse.ArgumentParser(
        prog="strop export",
        description="Write a checkpoint's policy in Hugging Face "
        "format (from its trainer state; any layout of ranks) into a new folder.",
    )
    parser.add_argument("checkpoint", help="a checkpoint folder, e.g. runs/X/checkpoints/step_000010")
    parser.add_argument("out", help="the folder to create")
    args = parser.parse_args(argv)
    try:
        print(f"strop: exported to {export_policy(Path(args.checkpoint), Path(args.out))}")
    except (CheckpointError, FileNotFoundError) as exc:
        print(f"strop export: error: {exc}", file=sys.stderr)
        return 1
    return 0


def proxy_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="strop proxy",
        description="The agent proxy on its own: OpenAI-compatible "
        "routes in front of an engine, recording sessions as exact tokens "
        "(docs/agents.md).",
    )
    parser.add_argument(
        "--model-path",
        default=EMBEDDED_MODEL,
        help="the model (its tokenizer and chat template; without --engine-url also the engine, in this process)",
    )
    parser.add_argument(
        "--engine-url",
        action="append",
        default=[],
        help="a running server to generate with (repeat for several, behind strop's router)",
    )
    parser.add_argument("--engine-kind", default="strop", choices=["strop", "sglang", "vllm"])
    parser.add_argument("--engine-token", default=os.environ.get("STROP_ENGINE_TOKEN"))
    parser.add_argument("--host", default="127.0.0.1", help="bind address")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument(
        "--token",
        default=os.environ.get("STROP_PROXY_TOKEN"),
        help="admin token: opens and reads sessions (env STROP_PROXY_TOKEN)",
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="sessions sample at this temperature")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--max-calls", type=int, default=64, help="calls per session")
    parser.add_argument("--max-call-tokens", type=int, default=1024, help="new tokens per call")
    parser.add_argument("--max-response-tokens", type=int, default=8192, help="tokens of a segment after its prompt")
    parser.add_argument("--idle-timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--no-describe-tools",
        action="store_true",
        help="leave the request's tools out of the "
        "prompt (the agent's own system prompt describes them); calls are still parsed",
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    _quiet_libraries()
    from strop.agents.serve import serve_proxy

    try:
        serve_proxy(
            args.model_path,
            urls=args.engine_url,
            kind=args.engine_kind,
            engine_token=args.engine_token,
            host=args.host,
            port=args.port,
            token=args.token,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_calls=args.max_calls,
            max_call_tokens=args.max_call_tokens,
            max_response_tokens=args.max_response_tokens,
            idle_timeout_s=args.idle_timeout_s,
            describe_tools=not args.no_describe_tools,
            device=args.device,
            dtype=args.dtype,
        )
    except (FileNotFoundError, ValueError) as exc:
        print(f"strop proxy: error: {exc}", file=sys.stderr)
        return 1
    return 0


def check_plugin_main(argv: list[str]) -> int:
    from strop.plugins import HOOKS, PluginError

    parser = argparse.ArgumentParser(
        prog="strop check-plugin", description="Check a plugin's signature and run it on synthetic samples."
    )
    parser.add_argument("--hook", required=True, choices=sorted(HOOKS), help="which extension point")
    parser.add_argument("path", help="import path, 'package.module:function'")
    args = parser.parse_args(argv)
    _quiet_libraries()
    from strop.contracts import check_plugin

    try:
        print(check_plugin(args.hook, args.path))
    except PluginError as exc:
        print(f"strop check-plugin: FAILED\n{exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # the plugin itself raised on synthetic input
        print(
            f"strop check-plugin: FAILED\n{args.hook} hook {args.path!r} raised on synthetic samples: "
            f"{type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return 1
    return 0


def serve_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="strop serve",
        description="Serve a model with strop's engine over HTTP "
        "(SGLang's native /generate and OpenAI-compatible completions).",
    )
    parser.add_argument("--model-path", default=EMBEDDED_MODEL, help="model folder, hub id, or the embedded default")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (anything but loopback needs --token)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--token",
        default=os.environ.get("STROP_SERVE_TOKEN"),
        help="bearer token required on every route, /health included (env STROP_SERVE_TOKEN)",
    )
    parser.add_argument(
        "--public-generate",
        action="store_true",
        help="with --token: leave the generation routes (/generate, /v1/*) open to all",
    )
    parser.add_argument(
        "--weights-dir",
        default=os.environ.get("STROP_SERVE_WEIGHTS_DIR"),
        help="the only folder /update_weights_from_disk loads from (unset: that route is refused; "
        "env STROP_SERVE_WEIGHTS_DIR)",
    )
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of the engine")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--batch-wait-ms",
        type=float,
        default=5.0,
        help="before a batch starts, wait while requests keep arriving (up to 40 such waits)",
    )
    parser.add_argument(
        "--no-fast-decode",
        dest="fast_decode",
        action="store_false",
        help="decode with transformers' forward and static batches instead of strop's KV-cache decoder",
    )
    args = parser.parse_args(argv)
    _quiet_libraries()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from strop.serving.server import serve

    try:
        serve(
            args.model_path,
            host=args.host,
            port=args.port,
            token=args.token,
            public_generate=args.public_generate,
            weights_dir=args.weights_dir,
            max_batch_size=args.max_batch_size,
            seed=args.seed,
            device=args.device,
            dtype=args.dtype,
            batch_wait_ms=args.batch_wait_ms,
            fast_decode=args.fast_decode,
        )
    except (FileNotFoundError, ValueError) as exc:
        print(f"strop serve: error: {exc}", file=sys.stderr)
        return 1
    return 0


def rollout_main(argv: list[str]) -> int:
    """``strop rollout``: the samples a sync run would train on, written to a file; no training."""
    out, argv = _take_option(argv, "--out")
    preset, argv = _take_option(argv, "--preset")
    yaml_path = None
    if argv and not argv[0].startswith("-"):
        yaml_path, argv = argv[0], argv[1:]
    try:
        cfg = build_config(yaml_path, parse_overrides(argv, prog="strop rollout"), preset=preset)
    except ConfigError as exc:
        print(f"strop rollout: {exc}", file=sys.stderr)
        return 2
    _quiet_libraries()
    from strop.data.sources import DataError
    from strop.loop import rollout_only
    from strop.plugins import PluginError

    try:
        rollout_only(cfg, out)
    except (FileNotFoundError, FileExistsError, DataError, PluginError, ValueError) as exc:
        print(f"strop rollout: error: {exc}", file=sys.stderr)
        return 1
    return 0


def plot_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="strop plot",
        description="Draw the metrics of one or several runs side by side (one panel per metric, one line per run).",
    )
    parser.add_argument("run_dirs", nargs="+", help="run directories (each with a metrics.jsonl)")
    parser.add_argument(
        "--metrics",
        default=None,
        help="comma-separated metric names (default: reward, "
        "held-out accuracy, length, entropy, gradient norm, logprob gap, KL, step time)",
    )
    parser.add_argument("--out", default="runs.png", help="image to write (default: runs.png)")
    args = parser.parse_args(argv)
    from strop.observe.metrics import plot_runs

    try:
        drawn = plot_runs(args.run_dirs, args.out, args.metrics.split(",") if args.metrics else None)
    except (FileNotFoundError, ValueError) as exc:
        print(f"strop plot: error: {exc}", file=sys.stderr)
        return 1
    print(f"strop plot: {len(drawn)} metrics of {len(args.run_dirs)} runs -> {args.out}")
    return 0


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


TRAIN_EXTRA_HELP = """strop train [CONFIG.yaml] [--preset NAME] [--nproc N] [--resume RUN_DIR|latest]
            [--allow-change FIELD,...] [--section.key=value ...]

  CONFIG.yaml    a config file (later sources win: defaults, preset, file, command line)
  --preset NAME  an algorithm preset: {presets}
  --nproc N      train on N local processes (gloo on CPU, NCCL on GPU): data parallel, times
                 context parallel with --parallel.context_parallel_size
  --resume RUN_DIR  continue a run from its newest checkpoint, in its directory, with its saved
                 config ('latest': the newest run under ./runs); a changed field is refused unless
                 named in --allow-change (e.g. --allow-change train.steps)
"""


def _take_option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """``name VALUE`` or ``name=VALUE`` out of ``argv``: (value or None, the rest)."""
    for i, arg in enumerate(argv):
        if arg == name:
            return (argv[i + 1] if i + 1 < len(argv) else ""), argv[:i] + argv[i + 2 :]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1], argv[:i] + argv[i + 1 :]
    return None, argv


def train_main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(TRAIN_EXTRA_HELP.format(presets=", ".join(sorted(PRESETS))))

    yaml_path, preset, nproc = None, None, 1
    resume, argv = _take_option(argv, "--resume")
    allow, argv = _take_option(argv, "--allow-change")
    if resume == "" or allow == "":
        print("strop train: --resume needs RUN_DIR or 'latest'; --allow-change needs field names", file=sys.stderr)
        return 2
    for i, arg in enumerate(argv):  # --nproc N starts N local ranks (data parallel, gloo on CPU)
        if arg == "--nproc" and i + 1 < len(argv) or arg.startswith("--nproc="):
            value = arg.split("=", 1)[1] if "=" in arg else argv[i + 1]
            rest = argv[:i] + argv[i + (1 if "=" in arg else 2) :]
            if not value.isdigit() or int(value) < 1:
                print(f"strop train: --nproc must be a positive integer, got {value!r}", file=sys.stderr)
                return 2
            nproc, argv = int(value), rest
            break
    if argv and not argv[0].startswith("-"):
        yaml_path, argv = argv[0], argv[1:]
    for i, arg in enumerate(argv):  # --preset NAME / --preset=NAME picks an algorithm preset
        if arg == "--preset" and i + 1 < len(argv):
            preset, argv = argv[i + 1], argv[:i] + argv[i + 2 :]
            break
        if arg.startswith("--preset="):
            preset, argv = arg.split("=", 1)[1], argv[:i] + argv[i + 1 :]
            break
    try:
        if resume is not None:
            run_dir = find_run_dir(resume)
            cfg = resume_config(
                run_dir, yaml_path, parse_overrides(argv), preset, allow=[k for k in (allow or "").split(",") if k]
            )
        else:
            if allow is not None:
                raise ConfigError("--allow-change only applies with --resume")
            cfg = build_config(yaml_path, parse_overrides(argv), preset=preset)
    except ConfigError as exc:
        print(f"strop train: {exc}", file=sys.stderr)
        return 2
    from strop.cluster.launcher import LaunchError, start

    try:  # this process starts the run's ranks and waits for them (--nproc, Ray), or is a rank itself (None);
        # each rank runs this command (a process of its own) or this function (in a Ray actor)
        code = start(
            cfg,
            ([yaml_path] if yaml_path else [])
            + (["--preset", preset] if preset else [])
            + ([f"--resume={resume}"] if resume is not None else [])
            + ([f"--allow-change={allow}"] if allow else [])
            + argv,
            nproc,
            command=[sys.executable, "-m", "strop.cli", "train"],
            main=train_main,
        )
    except LaunchError as exc:
        print(f"strop train: {exc}", file=sys.stderr)
        return 2
    if code is not None:
        return code
    _quiet_libraries()
    if os.environ.get("RANK", "0") != "0":
        cfg.run.progress = False
    return _train(cfg, resumed=resume is not None)


def _train(cfg, resumed: bool) -> int:
    """Run the training loop in this process (a rank); its expected failures print one line and exit 1.
    (Imported here: they load torch, kept out of ``strop train --help``.)"""
    from strop.checkpoint import CheckpointError
    from strop.data.sources import DataError
    from strop.loop import train
    from strop.observe.tracking import MissingExtra
    from strop.parallel.runtime import ControllerError
    from strop.plugins import PluginError
    from strop.train.trainer import NonFiniteGradientError

    try:
        train(cfg, resume=resumed)
    except (
        FileNotFoundError,
        FileExistsError,
        DataError,
        PluginError,
        ValueError,
        ControllerError,
        NonFiniteGradientError,
        CheckpointError,
        MissingExtra,
    ) as exc:
        print(f"strop train: error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        return train_main(rest)
    if command == "check-plugin":
        return check_plugin_main(rest)
    if command == "serve":
        return serve_main(rest)
    if command == "proxy":
        return proxy_main(rest)
    if command == "plot":
        return plot_main(rest)
    if command == "rollout":
        return rollout_main(rest)
    if command == "export":
        return export_main(rest)
    print(f"strop: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
