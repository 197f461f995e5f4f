"""The ``strop`` command: one argparse parser with a subparser per command. Each command imports the layers it
runs inside its function: ``strop --help``, ``strop train --help`` and a config error load no torch."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from strop.cli.common import USAGE, Parser, UsageError, quiet_libraries, version
from strop.cli.train import add_run_arguments, run_main
from strop.config import did_you_mean
from strop.engines.config import DECODER_OPTIONS
from strop.models import EMBEDDED_MODEL
from strop.observe.logs import LEVELS, setup_logging
from strop.train.config import ModelConfig


def _export_args(parser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint folder, e.g. runs/X/checkpoints/step_000010")
    parser.add_argument("out", help="the folder to create")


def _export(args) -> int:
    from strop.checkpoint import CheckpointError, export_policy
    from strop.train.lora import add_adapters

    def adapt(model, m):  # a LoRA run's adapters, to load them and merge them
        return add_adapters(model, m.lora_rank, m.lora_alpha, m.lora_dropout, list(m.lora_target_modules), m.lora_init)

    try:
        print(f"strop: exported to {export_policy(Path(args.checkpoint), Path(args.out), adapt)}")
    except (CheckpointError, FileNotFoundError) as exc:
        print(f"strop export: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _proxy_args(parser) -> None:
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
    _model_option_args(parser)


def _proxy(args) -> int:
    quiet_libraries()
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
            model_options=_model_options(args),
        )
    except (FileNotFoundError, ValueError) as exc:
        print(f"strop proxy: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _check_plugin_args(parser) -> None:
    parser.add_argument("--hook", required=True, help="which extension point (reward, filter, ...)")
    parser.add_argument("path", help="import path, 'package.module:function'")


def _check_plugin(args) -> int:
    from strop.plugins import HOOKS, PluginError

    if args.hook not in HOOKS:
        raise UsageError("strop check-plugin", f"--hook {args.hook}: one of {', '.join(sorted(HOOKS))}")
    quiet_libraries()
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


def _model_option_args(parser) -> None:
    """The model's loading options, as strop train's model.revision, trust_remote_code, attn_implementation."""
    parser.add_argument("--revision", default=None, help="hub id only: the branch, tag or commit to load")
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="run the Python code the model ships (models you trust)"
    )
    parser.add_argument(
        "--attn-implementation",
        default=None,
        choices=["eager", "sdpa", "flash_attention_2"],
        help="transformers' attention implementation (default: transformers' choice)",
    )


def _model_options(args) -> dict:
    """The flags as a run's model section gives them to strop.models' loaders."""
    section = ModelConfig(
        attn_implementation=args.attn_implementation, trust_remote_code=args.trust_remote_code, revision=args.revision
    )
    return section.load_options()


def _serve_args(parser) -> None:
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
    parser.add_argument(
        "--weight-transfer-backend",
        default="gloo",
        choices=["gloo", "nccl", "disk", "checkpoint"],
        help="how vLLM's transfer phases (/init_weight_transfer_engine ... /finish_weight_update) carry "
        "tensors: a broadcast from the trainer (gloo, nccl), safetensors in --weights-dir (disk), or in the "
        "request body (checkpoint: small models and tests)",
    )
    parser.add_argument(
        "--weight-version",
        type=int,
        default=0,
        help="the version of the weights the server starts with (/weight_info, /get_weight_version)",
    )
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of the engine")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    _model_option_args(parser)
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
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's tokens and logprobs are bitwise the same alone and in any batch (seeded or "
        "greedy sampling), at a cost in throughput (docs/engine.md)",
    )

    _decoder_args(parser)


def _decoder_args(parser) -> None:
    """strop serve's flags for its kv-cache decoder (the ``engine`` section's speculative, cpu_kernels,
    compile_attention, compile_step)."""
    parser.add_argument(
        "--speculative",
        type=int,
        default=0,
        metavar="N",
        help="draft up to N tokens per row from the prompt and its other responses and verify them in one "
        "forward pass; exact, on the batch-invariant kernels (docs/engine.md; 0: off)",
    )
    parser.add_argument(
        "--cpu-kernels",
        default="auto",
        choices=["auto", "mkl", "onednn", "plain"],
        help="the kv-cache decoder's linear-layer kernel on a CPU (auto: MKL on Intel in float32, else oneDNN; "
        "the start line names it)",
    )
    parser.add_argument(
        "--compile-attention",
        action="store_true",
        help="the kv-cache decoder's attention compiled by Inductor on a CPU, for steps of 32 rows or more (the "
        "compile time in the log; without a C++ compiler it says why and runs PyTorch's fused kernel; docs/engine.md)",
    )
    parser.add_argument(
        "--compile-step",
        action="store_true",
        help="the kv-cache decoder's whole decode step compiled by Inductor into one graph on a CPU, for steps of 32 "
        "rows or more (dense layers; the compile time in the log; without a C++ compiler it says why and runs the "
        "decoder's own step; docs/engine.md)",
    )
    parser.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="vLLM's flag: /v1/completions choices carry routed_experts, the experts each token was routed to "
        "(a routed-experts model; /generate returns them when asked, as SGLang's)",
    )


def _serve(args) -> int:
    quiet_libraries()
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
            batch_invariant=args.batch_invariant,
            decoder={k: getattr(args, k) for k in DECODER_OPTIONS},
            return_routes=args.enable_return_routed_experts,
            model_options=_model_options(args),
            weight_transfer=args.weight_transfer_backend,
            weight_version=args.weight_version,
        )
    except (FileNotFoundError, ValueError) as exc:
        print(f"strop serve: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _plot_args(parser) -> None:
    parser.add_argument("run_dirs", nargs="+", help="run directories (each with a metrics.jsonl)")
    parser.add_argument(
        "--metrics",
        default=None,
        help="comma-separated metric names (default: reward, "
        "held-out accuracy, length, entropy, gradient norm, logprob gap, KL, step time)",
    )
    parser.add_argument("--out", default="runs.png", help="image to write (default: runs.png)")


def _plot(args) -> int:
    from strop.observe.metrics import plot_runs

    try:
        drawn = plot_runs(args.run_dirs, args.out, args.metrics.split(",") if args.metrics else None)
    except (FileNotFoundError, ValueError) as exc:
        print(f"strop plot: error: {exc}", file=sys.stderr)
        return 1
    print(f"strop plot: {len(drawn)} metrics of {len(args.run_dirs)} runs -> {args.out}")
    return 0


def _server_log_level(parser) -> None:
    parser.add_argument(
        "--log-level", type=str.upper, choices=LEVELS, default="INFO", help="DEBUG, INFO, WARNING, ERROR"
    )


DESCRIPTIONS = {
    "export": "Write a checkpoint's policy in Hugging Face "
    "format (from its trainer state; any layout of ranks) into a new folder.",
    "proxy": "The agent proxy on its own: OpenAI-compatible "
    "routes in front of an engine, recording sessions as exact tokens "
    "(docs/agents.md).",
    "check-plugin": "Check a plugin's signature and run it on synthetic samples.",
    "serve": "Serve a model with strop's engine over HTTP "
    "(vLLM's RL API, SGLang's native /generate and OpenAI-compatible completions).",
    "plot": "Draw the metrics of one or several runs side by side (one panel per metric, one line per run).",
}
COMMANDS = {
    "train": None,
    "rollout": None,
    "eval": None,
    "serve": _serve,
    "proxy": _proxy,
    "plot": _plot,
    "check-plugin": _check_plugin,
    "export": _export,
}
ARGUMENTS = {
    "serve": _serve_args,
    "proxy": _proxy_args,
    "plot": _plot_args,
    "check-plugin": _check_plugin_args,
    "export": _export_args,
}


def build_parser() -> tuple[Parser, dict[str, Parser]]:
    """``strop``'s parser and each command's (``strop train``'s flags: strop.cli.train; its config options
    are strop.config's)."""
    top = Parser(prog="strop", add_help=False)
    top.add_argument("--version", action="version", version=f"strop {version()}")
    sub = top.add_subparsers(dest="command", parser_class=Parser)
    parsers = {}
    for name in COMMANDS:
        if name in ("train", "rollout", "eval"):
            parsers[name] = sub.add_parser(name, add_help=False)
            add_run_arguments(parsers[name], train=name == "train")
        else:
            parsers[name] = sub.add_parser(name, description=DESCRIPTIONS[name])
            ARGUMENTS[name](parsers[name])
            if name in ("serve", "proxy"):
                _server_log_level(parsers[name])
    return top, parsers


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if not argv[0].startswith("-") and argv[0] not in COMMANDS:
        print(f"strop: unknown command {argv[0]!r}{did_you_mean(argv[0], COMMANDS)}\n\n{USAGE}", file=sys.stderr)
        return 2
    top, parsers = build_parser()
    try:
        args, extras = top.parse_known_args(argv)
        if args.command is None:
            top.error(f"unrecognized arguments: {' '.join(extras)}; a command comes first (strop --help)")
        if args.command in ("train", "rollout", "eval"):
            return run_main(args, extras, train=args.command == "train", command=args.command)
        if extras:
            parsers[args.command].error(f"unrecognized arguments: {' '.join(extras)}")
        if args.command in ("serve", "proxy"):
            setup_logging(args.log_level)
        return COMMANDS[args.command](args)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2


def train_main(argv: list[str]) -> int:
    return main(["train", *argv])  # (the ranks run strop.cli.train.train_main: no import of this module)


def rollout_main(argv: list[str]) -> int:
    return main(["rollout", *argv])


def serve_main(argv: list[str]) -> int:
    return main(["serve", *argv])


def proxy_main(argv: list[str]) -> int:
    return main(["proxy", *argv])


def plot_main(argv: list[str]) -> int:
    return main(["plot", *argv])


def check_plugin_main(argv: list[str]) -> int:
    return main(["check-plugin", *argv])


def export_main(argv: list[str]) -> int:
    return main(["export", *argv])
