"""What the commands share: the parser that says a usage error in one line, the help texts, the version,
and quieting the libraries a command loads."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from strop.config import Config
from strop.presets import PRESETS

USAGE = """strop: RL post-training for LLMs

commands:
  strop train [CONFIG.yaml] [--preset NAME] [--section.key=value ...]
                                                        run RL (no arguments: GRPO on the embedded default)
  strop train --help                                    the flags and config sections (--help-all: every option)
  strop serve [--model-path PATH] [--port N] [--host H] [--token T] [--weights-dir DIR]
                                                        the embedded engine behind HTTP (SGLang-native + OpenAI routes)
  strop train --resume RUN_DIR|latest                   continue a run from its newest checkpoint
  strop rollout [CONFIG.yaml] [--out FILE] [--section.key=value ...]
                                                        generate and score a run's steps, write them, no training
  strop eval [CONFIG.yaml] [--out FILE] [--section.key=value ...]
                                                        score the held-out prompts (an environment's eval split) once
  strop train --data.samples=FILE                       train on such a file, with no engine
  strop plot RUN_DIR [RUN_DIR ...] [--metrics a,b] [--out FILE]
                                                        the curves of one or several runs side by side
  strop proxy --token T [--model-path PATH] [--engine-url URL ...] [--port N]
                                                        the agent proxy alone: OpenAI routes, exact-token sessions
  strop check-plugin --hook HOOK pkg.module:function    check a plugin against its hook's contract
  strop export CHECKPOINT OUT                           a checkpoint's policy as a Hugging Face folder
  strop --version                                       the installed version
"""

TRAIN_FLAGS = """  CONFIG.yaml          a config file, anywhere on the line (later sources win: defaults, preset,
                       file, command line)
  --preset NAME        an algorithm preset: {presets}
  --nproc N            train on N local processes (gloo on CPU, NCCL on GPU): data parallel, times
                       context parallel with --parallel.context_parallel_size
  --resume RUN_DIR     continue a run from its newest checkpoint, in its directory, with its saved
                       config ('latest': the newest run under ./runs)
  --allow-change F,..  with --resume: config fields that may differ from the saved config
                       (e.g. --allow-change train.steps); any other change is refused
"""

ROLLOUT_FLAGS = """  CONFIG.yaml          a config file, anywhere on the line (later sources win: defaults, preset,
                       file, command line)
  --out FILE           where the scored samples go (default: <run dir>/rollout_samples.jsonl);
                       train on them with strop train --data.samples=FILE
  --preset NAME        an algorithm preset: {presets}
"""

EVAL_FLAGS = """  CONFIG.yaml          a config file, anywhere on the line (later sources win: defaults, preset,
                       file, command line)
  --out FILE           where the scored samples go (default: <run dir>/eval_samples.jsonl)
  --preset NAME        an algorithm preset: {presets}
"""

COMMON_FLAGS = """  --log-level LEVEL    DEBUG, INFO (default), WARNING or ERROR; the run directory's run.log
                       holds the same lines
  -h, --help           this help
  --help-all           every config option, with its type, help and default value
"""


def run_help(prog: str) -> str:
    """``strop train --help`` / ``strop rollout --help``: the command's flags and the config's sections, one
    line each (``--help-all`` lists every option)."""
    train = prog == "strop train"
    flags = {"strop train": TRAIN_FLAGS, "strop eval": EVAL_FLAGS}.get(prog, ROLLOUT_FLAGS)
    flags = flags.format(presets=", ".join(sorted(PRESETS)))
    usage = (
        f"usage: {prog} [CONFIG.yaml] [--preset NAME] [--nproc N] [--resume RUN_DIR|latest]\n"
        "                   [--allow-change FIELD,...] [--log-level LEVEL] [--section.key=value ...]"
        if train
        else f"usage: {prog} [CONFIG.yaml] [--out FILE] [--preset NAME] [--log-level LEVEL] [--section.key=value ...]"
    )
    what = (
        "Run RL post-training (no arguments: GRPO on the embedded default model)."
        if train
        else "Score the held-out prompts once (greedy, as the run's evaluation does) and write each sample; "
        "against the embedded model or served engines (engine.kind, engine.urls), as vf-eval scores an environment."
        if prog == "strop eval"
        else "Generate and score the steps a sync run would train on and write them; no training."
    )
    lines = [usage, "", what, "", "options:", flags + COMMON_FLAGS.rstrip("\n"), ""]
    lines.append("config sections (set a key with --section.key=value or --section.key value):")
    for name, field in Config.model_fields.items():
        count = len(field.annotation.model_fields)
        lines.append(f"  {name:<10} {field.description} ({count} options)")
    lines += ["", f"`{prog} --help-all` lists every option, with its type, help and default value."]
    return "\n".join(lines)


class UsageError(Exception):
    """A command line that cannot be run, phrased for the user (exit code 2)."""

    def __init__(self, prog: str, message: str):
        super().__init__(f"{prog}: error: {message}")


class Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line (``strop X: error: ...``), raised as UsageError
    for the command to print, instead of the usage and an exit."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise UsageError(self.prog, message)


def version() -> str:
    """The installed strop distribution's version (or the package's own, run from a source tree)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("strop")
    except PackageNotFoundError:  # the package (loaded: this module is in it) may say its own
        return getattr(sys.modules["strop"], "__version__", "unknown")


def quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
