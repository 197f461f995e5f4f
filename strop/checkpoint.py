"""Checkpoints of a run and exact resume.

A checkpoint is a folder ``<run dir>/checkpoints/step_NNNNNN/`` holding:

- ``policy/``: the policy in Hugging Face format (``from_pretrained`` loads it) and its tokenizer, unless
  ``run.checkpoint_policy`` is off (:func:`export_policy` writes it from the trainer state later);
- ``trainer/``: the trainer's state through torch.distributed.checkpoint: policy weights, optimizer,
  critic and its optimizer. Under FSDP every rank writes its own shards (no rank gathers the
  optimizer); the reference is always the initial policy, so it is rebuilt from ``model.path``;
- ``rank<R>.pt``: what lives in each process: torch's and Python's random generators (and CUDA's),
  the trainer's counters (scheduler steps are in the optimizer state; the non-finite streaks here);
- ``controller.pt``: rank 0's state: the step and weight version, the prompt sampler, the embedded
  engine's sampling generator, the elapsed time, the byte length of every log the run appends to
  (``metrics.jsonl``, ``samples.jsonl``, ``failed_samples.jsonl``,
  ``staleness.jsonl``), and what the rollout manager
  holds in flight (nothing in sync mode);
- ``meta.json``, written last.

The ``.pt`` files are read back with torch's safe loader (tensors, plain containers, samples):
unpickling anything else could run code. A checkpoint is written into ``.tmp-step_NNNNNN`` and
renamed into place, so a process killed while saving leaves a folder that :func:`latest` never
picks. On resume the logs are cut back to their length at
the checkpoint, so no step row is duplicated or missing.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import warnings
from pathlib import Path

import torch

CHECKPOINTS = "checkpoints"
APPEND_LOGS = ("metrics.jsonl", "samples.jsonl", "failed_samples.jsonl", "staleness.jsonl")
_NAME = re.compile(r"^step_(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint or resume request that cannot be honoured (missing, incomplete, mismatched)."""


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step_{step:06d}"


def complete(run_dir: Path) -> list[tuple[int, Path]]:
    """Every complete checkpoint of ``run_dir`` as (step, path), oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    found = []
    for p in root.iterdir() if root.is_dir() else ():
        m = _NAME.match(p.name)
        if m and (p / "meta.json").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest(run_dir: Path) -> Path | None:
    found = complete(run_dir)
    return found[-1][1] if found else None


# ---- the trainer's part: every rank -------------------------------------------------------------
def _stateful(trainer) -> list[tuple[str, torch.nn.Module, torch.optim.Optimizer]]:
    parts = [("policy", trainer.model, trainer.policy_opt.optimizer)]
    if trainer.critic is not None:
        parts.append(("critic", trainer.critic, trainer.critic_opt.optimizer))
    return parts


def _trainer_state(trainer) -> dict:
    """References to the live tensors (or this rank's shards of them): nothing is copied."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out = {}
    for name, module, optimizer in _stateful(trainer):
        model_sd, optim_sd = get_state_dict(module, optimizer)
        out[name], out[f"{name}_optimizer"] = model_sd, optim_sd
    return out


def _quiet():
    """torch.distributed.checkpoint warns that it assumes one process when there is no process group."""
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
    return ctx


def save_trainer(folder: Path, trainer) -> None:
    """Write the trainer's state into ``folder/trainer`` and this rank's process state into
    ``folder/rank<R>.pt``. A collective under several ranks: every rank calls it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    ctx = _quiet()
    try:
        rank = dist.get_rank() if dist.is_initialized() else 0
        torch.save(_process_state(trainer), Path(folder) / f"rank{rank}.pt")  # before the collective save
        dcp.save(_trainer_state(trainer), checkpoint_id=str(Path(folder) / "trainer"))
    finally:
        ctx.__exit__(None, None, None)


def load_trainer(folder: Path, trainer) -> None:
    """Load what :func:`save_trainer` wrote into ``trainer`` (same layout of ranks and modes)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    folder = Path(folder)
    rank = dist.get_rank() if dist.is_initialized() else 0
    check_rank_file(folder, rank)
    ctx = _quiet()
    try:
        state = _trainer_state(trainer)
        dcp.load(state, checkpoint_id=str(folder / "trainer"))
        for name, module, optimizer in _stateful(trainer):
            set_state_dict(module, optimizer, model_state_dict=state[name], optim_state_dict=state[f"{name}_optimizer"])
    finally:
        ctx.__exit__(None, None, None)
    _restore_process_state(load_process_state(folder, rank), trainer)


def _process_state(trainer) -> dict:
    out = {
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "steps_done": trainer.steps_done,
        "scheduler": {name: opt.scheduler.state_dict() for name, opt in _optimizers(trainer)},
        "nonfinite_streak": {name: opt.nonfinite_streak for name, opt in _optimizers(trainer)},
    }
    if torch.cuda.is_available():
        out["cuda_rng"] = torch.cuda.get_rng_state_all()
    return out


def _restore_process_state(state: dict, trainer) -> None:
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    if "cuda_rng" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    trainer.steps_done = state["steps_done"]
    for name, opt in _optimizers(trainer):
        opt.scheduler.load_state_dict(state["scheduler"][name])
        opt.nonfinite_streak = state["nonfinite_streak"][name]


def _optimizers(trainer):
    yield "policy", trainer.policy_opt
    if trainer.critic is not None:
        yield "critic", trainer.critic_opt


# ---- the controller's part: rank 0 --------------------------------------------------------------
def begin(run_dir: Path, step: int) -> Path:
    """A fresh temporary folder for the checkpoint of ``step`` (a leftover of a killed save is removed)."""
    tmp = Path(run_dir) / CHECKPOINTS / f".tmp-step_{step:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def finish(
    run_dir: Path, tmp: Path, step: int, *, controller_state: dict, weights: dict | None, model, tokenizer, keep: int
) -> Path:
    """Rank 0 completes the checkpoint in ``tmp`` (after every rank's :func:`save_trainer`): the
    policy in Hugging Face format, the controller's state and ``meta.json``; renames it into place
    and removes all but the newest ``keep`` checkpoints.

    ``controller.pt`` is read back through the safe loader before anything is published: a checkpoint
    that could not be resumed raises CheckpointError naming what could not be saved, and the previous
    checkpoints stay as they were (nothing is renamed into place, nothing is removed)."""
    from strop.types import SampleInvariantError, checkpointable

    tmp = Path(tmp)
    try:
        try:  # numpy values a hook put into the samples held become Python ones; what cannot be saved is named
            controller_state = checkpointable(controller_state, "controller state")
        except SampleInvariantError as exc:
            raise CheckpointError(f"checkpoint of step {step} not saved: {exc}") from None
        torch.save(controller_state, tmp / "controller.pt")
        try:
            _safe_load(tmp / "controller.pt")
        except CheckpointError as exc:
            raise CheckpointError(f"checkpoint of step {step} not saved (it could not be resumed): {exc}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # (never published; the previous checkpoint stays the newest)
        raise
    if weights is not None:
        model.save_pretrained(tmp / "policy", state_dict=weights, safe_serialization=True)
        tokenizer.save_pretrained(tmp / "policy")
    meta = {"step": step, "files": sorted(p.name for p in tmp.iterdir())}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    _fsync_tree(tmp)
    final = step_dir(run_dir, step)
    old = None
    if final.exists():  # the same step saved again (a resumed run that re-ran it): move the old one aside
        old = final.with_name(f".old-{final.name}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)  # the rename itself reaches the disk
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for _, old in complete(run_dir)[:-keep] if keep > 0 else ():
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_tree(folder: Path) -> None:
    """Flush every file of ``folder`` to disk before it is renamed into place."""
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_rank_file(folder: Path, rank: int) -> None:
    if not (Path(folder) / f"rank{rank}.pt").is_file():
        raise CheckpointError(
            f"{folder}: no rank{rank}.pt; the checkpoint was written by fewer processes "
            "than this run has (resume with the same --nproc)"
        )


def log_sizes(run_dir: Path) -> dict[str, int]:
    return {
        name: (Path(run_dir) / name).stat().st_size if (Path(run_dir) / name).exists() else 0 for name in APPEND_LOGS
    }


def cut_logs(run_dir: Path, sizes: dict[str, int]) -> None:
    """Cut every append-only log back to its length at the checkpoint (rows written after it are
    written again by the resumed run)."""
    for name in APPEND_LOGS:
        path = Path(run_dir) / name
        if path.exists() and path.stat().st_size > sizes.get(name, 0):
            os.truncate(path, sizes.get(name, 0))


def load_controller_state(folder: Path) -> dict:
    return _safe_load(Path(folder) / "controller.pt")


def load_process_state(folder: Path, rank: int) -> dict:
    return _safe_load(Path(folder) / f"rank{rank}.pt")


def _safe_load(path: Path) -> dict:
    """What strop wrote, through torch's safe loader: tensors, plain containers and numbers, and the
    samples the rollout manager holds. Unpickling anything else could run code, so it is refused."""
    from strop.types import Sample, Status

    try:
        with torch.serialization.safe_globals([Sample, Status]):
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        why = next((line.strip() for line in str(exc).splitlines() if "WeightsUnpickler error" in line), str(exc))
        raise CheckpointError(
            f"{path}: holds objects strop does not write (loading them could run code), so "
            f"it is not loaded: {why.split('. Please use')[0]}"
        ) from exc


def export_policy(folder: Path, out: Path, adapt=None) -> Path:
    """The policy of checkpoint ``folder`` in Hugging Face format, written to ``out`` (a new folder), from the
    trainer state (whatever layout of ranks saved it: torch.distributed.checkpoint puts the shards together);
    the model's structure and tokenizer come from the run's config. ``out`` appears only complete.
    A LoRA run's (``model.lora_rank``): ``adapt(model, model_section)`` adds the run's adapters to the model
    (strop.train.lora.add_adapters' result); ``out`` is then the merged model and ``out/adapter`` peft's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from strop.config import build_config
    from strop.models import load_tokenizer, meta_model, resolve_model_path

    folder, out = Path(folder), Path(out)
    if not (folder / "meta.json").is_file() or not (folder / "trainer").is_dir():
        raise CheckpointError(f"{folder}: not a complete strop checkpoint (no meta.json or trainer/)")
    if out.exists():
        raise CheckpointError(f"{out} exists; export writes a new folder and never overwrites one")
    run_dir = folder.parent.parent
    cfg = build_config(str(run_dir / "config.yaml"))
    path, opts = resolve_model_path(cfg.model.path, cfg.model.revision), cfg.model.load_options()
    model = meta_model(path, dtype=getattr(torch, cfg.model.dtype), **opts)
    model.to_empty(device="cpu")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    adapters = None
    if cfg.model.lora_rank:
        if adapt is None:
            raise CheckpointError(
                f"{folder} holds LoRA adapters (model.lora_rank={cfg.model.lora_rank}): export it "
                "with strop export, which merges them"
            )
        adapters = adapt(model, cfg.model)
        model = adapters.model
    state = {"policy": get_model_state_dict(model)}
    ctx = _quiet()
    try:
        dcp.load(state, checkpoint_id=str(folder / "trainer"))
    finally:
        ctx.__exit__(None, None, None)
    set_model_state_dict(model, state["policy"])
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    if adapters is None:
        model.save_pretrained(tmp, safe_serialization=True)
    else:
        model.save_pretrained(tmp, state_dict=dict(adapters.merged_weights()), safe_serialization=True)
        adapters.save(tmp / "adapter")
    load_tokenizer(path, **opts).save_pretrained(tmp)
    os.replace(tmp, out)
    return out
