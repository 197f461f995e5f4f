"""``strop train`` and ``strop rollout``: their own flags (argparse), the config file (anywhere on the line)
and the config options (``--section.key=value``, strop.config.parse_overrides). Torch is imported only once
the config is valid: ``--help`` and a config error load none."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from strop.cli.common import Parser, UsageError, quiet_libraries, run_help
from strop.config import ConfigError, build_config, did_you_mean, find_run_dir, parse_overrides, resume_config
from strop.observe.logs import LEVELS, setup_logging
from strop.presets import PRESETS

log = logging.getLogger(__name__)

YAML = (".yaml", ".yml")


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def add_run_arguments(parser: argparse.ArgumentParser, train: bool) -> None:
    """The flags of ``strop train`` (``train``) or ``strop rollout``; the config options are not argparse's."""
    parser.add_argument("-h", "--help", action="store_true")
    parser.add_argument("--help-all", action="store_true")
    parser.add_argument("--preset", nargs="?", const="", metavar="NAME")
    parser.add_argument("--log-level", type=str.upper, choices=LEVELS)
    if train:
        parser.add_argument("--nproc", type=_positive_int, default=1)
        parser.add_argument("--resume", nargs="?", const="")
        parser.add_argument("--allow-change", nargs="?", const="")
    else:
        parser.add_argument("--out")


def split_config_file(extras: list[str], prog: str) -> tuple[str | None, list[str]]:
    """(the CONFIG.yaml among ``extras``, wherever it is, or None; the config options). The value of
    ``--section.key value`` is the option's; any other bare word is refused, saying where the file goes."""
    yaml_path, rest, i = None, [], 0
    while i < len(extras):
        arg = extras[i]
        if arg.startswith("-"):
            rest.append(arg)
            if arg.startswith("--") and "=" not in arg and i + 1 < len(extras) and not extras[i + 1].startswith("--"):
                rest.append(extras[i + 1])  # the option's value
                i += 1
        elif arg.endswith(YAML) and yaml_path is None:
            yaml_path = arg
        elif arg.endswith(YAML):
            raise ConfigError(
                f"a second config file {arg!r} (after {yaml_path!r}): {prog} takes one CONFIG.yaml; "
                "give other settings as --section.key=value"
            )
        else:
            raise ConfigError(
                f"unexpected argument {arg!r}: the config file is one CONFIG.yaml (.yaml or .yml), anywhere on "
                "the line; options are --section.key=value"
            )
        i += 1
    return yaml_path, rest


def check_preset(preset: str | None) -> None:
    """``--preset`` given without a name, or with one no preset has: refused, naming the presets."""
    names = ", ".join(sorted(PRESETS))
    if preset is not None and (preset == "" or preset.endswith(YAML)):
        raise ConfigError(f"--preset needs a NAME, one of: {names}")
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"--preset {preset}: unknown preset{did_you_mean(preset, PRESETS)} (presets: {names})")


def nproc_warning(nproc: int, device: str) -> str | None:
    """The line to show when ``--nproc`` asks for more ranks than this machine has cores (CPU) or GPUs (CUDA,
    when torch is loaded already); None when it fits or cannot be told without loading torch."""
    torch = sys.modules.get("torch")
    if device != "cpu" and torch is not None and torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if nproc > gpus:
            return f"--nproc {nproc} is more than the {gpus} GPUs of this machine: ranks will share GPUs"
        return None
    if device == "cuda":
        return None
    cpus = os.cpu_count() or 1
    if nproc > cpus:
        return f"--nproc {nproc} is more than the {cpus} CPU cores of this machine: ranks will share cores (slower)"
    return None


def run_parser(prog: str, train: bool, **kwargs) -> Parser:
    parser = Parser(prog=prog, add_help=False, **kwargs)
    add_run_arguments(parser, train)
    return parser


def train_main(argv: list[str]) -> int:
    """``strop train ARGS``: what each rank runs (a process of its own, or this function in a Ray actor)."""
    try:
        ns, extras = run_parser("strop train", train=True).parse_known_args(argv)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    return run_main(ns, extras, train=True)


def run_main(ns: argparse.Namespace, extras: list[str], train: bool, command: str | None = None) -> int:
    """``strop train`` (``train``), ``strop rollout`` or ``strop eval``, its flags parsed into ``ns``, the rest in
    ``extras``."""
    prog = f"strop {command or ('train' if train else 'rollout')}"
    if ns.help:
        print(run_help(prog))
        raise SystemExit(0)
    if ns.help_all:
        parse_overrides(["--help-all"], prog=prog)  # prints every option and exits
    setup_logging(ns.log_level or "INFO")
    try:
        yaml_path, overrides = split_config_file(extras, prog)
        check_preset(ns.preset)
        if train:
            return _train_main(ns, yaml_path, overrides)
        cfg = build_config(yaml_path, parse_overrides(overrides, prog=prog), preset=ns.preset)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    return _rollout(cfg, ns.out, evaluate=prog == "strop eval")


def _train_main(ns: argparse.Namespace, yaml_path: str | None, overrides: list[str]) -> int:
    if ns.resume == "" or ns.allow_change == "":
        raise ConfigError("--resume needs RUN_DIR or 'latest'; --allow-change needs field names")
    if ns.resume is not None:
        allow = [k for k in (ns.allow_change or "").split(",") if k]
        cfg = resume_config(find_run_dir(ns.resume), yaml_path, parse_overrides(overrides), ns.preset, allow=allow)
    else:
        if ns.allow_change is not None:
            raise ConfigError("--allow-change only applies with --resume")
        cfg = build_config(yaml_path, parse_overrides(overrides), preset=ns.preset)
    warning = nproc_warning(ns.nproc, cfg.run.device)
    if warning:
        log.warning("strop train: %s", warning)
    from strop.cluster.launcher import LaunchError, start

    rank_argv = (
        ([yaml_path] if yaml_path else [])
        + (["--preset", ns.preset] if ns.preset else [])
        + ([f"--resume={ns.resume}"] if ns.resume is not None else [])
        + ([f"--allow-change={ns.allow_change}"] if ns.allow_change else [])
        + ([f"--log-level={ns.log_level}"] if ns.log_level else [])
        + overrides
    )
    try:  # this process starts the run's ranks and waits for them (--nproc, Ray), or is a rank itself (None);
        # each rank runs this command (a process of its own) or train_main (in a Ray actor)
        code = start(cfg, rank_argv, ns.nproc, command=[sys.executable, "-m", "strop.cli", "train"], main=train_main)
    except LaunchError as exc:
        raise ConfigError(str(exc)) from None
    if code is not None:
        return code
    quiet_libraries()
    if os.environ.get("RANK", "0") != "0":
        cfg.run.progress = False
    return _train(cfg, resumed=ns.resume is not None)


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


def _rollout(cfg, out: str | None, evaluate: bool = False) -> int:
    quiet_libraries()
    from strop.data.sources import DataError
    from strop.loop import evaluate_only, rollout_only
    from strop.plugins import PluginError

    try:
        (evaluate_only if evaluate else rollout_only)(cfg, out)
    except (FileNotFoundError, FileExistsError, DataError, PluginError, ValueError) as exc:
        print(f"strop {'eval' if evaluate else 'rollout'}: error: {exc}", file=sys.stderr)
        return 1
    return 0
