"""A run's prompt rows, built from its data settings: the training rows and the held-out eval rows, from a file,
a reasoning-gym task or the ``data_source`` hook, checked before any model loads (strop.setup assembles them)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from strop.config import Config
from strop.plugins import call_hook_sync
from strop.data.sources import DataError, PromptRow, _row_from_record, held_out, read_prompt_file, reasoning_gym_rows

log = logging.getLogger(__name__)

LABELLED_REWARDS = ("math", "exact_match")  # built-in rewards that compare with a row's label


def prompt_rows(cfg: Config, data_source: Callable | None = None) -> tuple[list, list | None]:
    """(training rows, held-out eval rows or None), each row labelled where the reward needs a label."""
    train_rows = _rows(cfg, "train", data_source)
    _check_labels(cfg, train_rows, "training")
    eval_rows = _rows(cfg, "eval", data_source) if cfg.data.eval_size else None
    if eval_rows:
        eval_rows = _held_out_rows(cfg, train_rows, eval_rows)
        _check_labels(cfg, eval_rows, "eval")
    return train_rows, eval_rows


def _rows(cfg: Config, which: str, data_source: Callable | None = None):
    d = cfg.data
    if data_source is not None:
        records = call_hook_sync("data_source", data_source, config=d, split=which)
        source = f"env.{cfg.env.kind}" if cfg.env.kind else f"data_source hook {cfg.plugins.data_source}"
        rows = [
            _row_from_record(r, f"{source} ({which}) row {i}", "prompt", "label", [])
            if not isinstance(r, PromptRow)
            else r
            for i, r in enumerate(records)
        ]
        for r, rec in zip(rows, records):  # the hook's metadata travels as given
            if isinstance(rec, dict) and isinstance(rec.get("metadata"), dict):
                r.metadata = dict(rec["metadata"])
        if which == "train" and not rows:
            raise DataError(f"{source}: no training rows")
        return rows or None
    if d.source == "reasoning_gym":
        if which == "eval":  # oversample: duplicates of training prompts are removed afterwards
            return (
                reasoning_gym_rows(d.task, d.eval_seed, d.eval_size * d.eval_oversample, d.task_options)
                if d.eval_size
                else None
            )
        return reasoning_gym_rows(d.task, d.seed, d.size, d.task_options)
    key, path = ("data.eval_path", d.eval_path) if which == "eval" else ("data.path", d.path)
    if path is None:
        return None
    if not Path(path).exists():  # (named by its key: a relative path is read from the current directory)
        raise DataError(f"{key}={path!r}: no such file ({Path(path).absolute()})")
    return read_prompt_file(path, d.prompt_key, d.label_key, d.metadata_keys)


def _check_labels(cfg: Config, rows, which: str) -> None:
    if cfg.plugins.agent and cfg.agent.reward == "session":  # the agent's (or environment's) reward, not rollout.reward
        return
    if cfg.rollout.reward in LABELLED_REWARDS and not cfg.reward.endpoint:
        missing = [r for r in rows if r.label is None]
        if missing:
            raise DataError(
                f"{missing[0].where or which}: no label (key {cfg.data.label_key!r}), and "
                f"rollout.reward={cfg.rollout.reward!r} compares answers with labels "
                f"({len(missing)} of {len(rows)} {which} rows have none)"
            )


def _held_out_rows(cfg: Config, train_rows, eval_rows):
    """Eval rows that never occur in the training data (by templated prompt), at most data.eval_size."""
    d = cfg.data
    kept, removed = held_out(
        eval_rows, train_rows, template=d.prompt_template, system_prompt=d.system_prompt, size=d.eval_size
    )
    if removed:
        log.info(
            f"strop: held-out set: removed {removed} of {len(eval_rows)} eval prompts that occur in the training "
            f"prompts (or twice in the eval set); {len(kept)} remain"
        )
    if len(kept) < min(d.eval_min_size, d.eval_size or len(eval_rows), len(eval_rows)):  # a small set is fine as given
        raise DataError(
            f"only {len(kept)} held-out prompts remain after removing {removed} that occur in the "
            f"training data (data.eval_min_size={d.eval_min_size}); use a larger or different eval set"
        )
    return kept
