"""A LoRA adapter on the wire (``model.lora_rank``, ``engine.sync='adapter'``): the tensors the trainer writes,
strop serve reads and merges, and the one formula both sides merge with, so the weights an engine decodes
equal the trainer's merged weights bit for bit (and their checksums compare).

What travels is a peft adapter folder (:func:`peft_files`): ``adapter_model.safetensors`` with peft's tensor
names (``base_model.model.<module>.lora_A.weight``, rank x in; ``...lora_B.weight``, out x rank) and
``adapter_config.json`` (rank, ``lora_alpha``, the targets), the format ``PeftModel.from_pretrained``, vLLM and
SGLang load. strop serve also takes its short names, ``<module>.lora_A`` and ``<module>.lora_B``; the scale
(``lora_alpha / lora_rank``) comes from the config, or beside the file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

A_SUFFIX, B_SUFFIX = ".lora_A", ".lora_B"
PEFT_PREFIX, PEFT_LEAF = "base_model.model.", ".weight"  # peft's names: PEFT_PREFIX + <module>.lora_A + PEFT_LEAF
ADAPTER_FILE, CONFIG_FILE = "adapter_model.safetensors", "adapter_config.json"


def adapter_tensors(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``{module: (A, B)}`` as the file's tensors."""
    out = {}
    for module, (a, b) in pairs.items():
        out[module + A_SUFFIX], out[module + B_SUFFIX] = a, b
    return out


def _short(name: str) -> str:
    """peft's ``base_model.model.<module>.lora_A.weight`` as ``<module>.lora_A``; a short name as it is."""
    if name.startswith(PEFT_PREFIX) and name.endswith(PEFT_LEAF):
        return name[len(PEFT_PREFIX) : -len(PEFT_LEAF)]
    return name


def adapter_pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The file's tensors (peft's names or the short ones) as ``{module: (A, B)}``; a name that is not one of a
    pair is refused."""
    tensors = {_short(n): t for n, t in tensors.items()}
    modules = {n[: -len(A_SUFFIX)] for n in tensors if n.endswith(A_SUFFIX)}
    modules |= {n[: -len(B_SUFFIX)] for n in tensors if n.endswith(B_SUFFIX)}
    unpaired = sorted(n for n in tensors if not n.endswith((A_SUFFIX, B_SUFFIX)))
    unpaired += sorted(m for m in modules if m + A_SUFFIX not in tensors or m + B_SUFFIX not in tensors)
    if unpaired:
        raise ValueError(f"not LoRA pairs ('<module>{A_SUFFIX}' with '<module>{B_SUFFIX}'): {unpaired[:5]}")
    pairs = {m: (tensors[m + A_SUFFIX], tensors[m + B_SUFFIX]) for m in sorted(modules)}
    for m, (a, b) in pairs.items():
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"{m}: A {tuple(a.shape)} and B {tuple(b.shape)} are not rank-r factors")
    return pairs


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``weight + scaling * (b @ a)``, a new tensor in ``weight``'s dtype: the one merge of trainer and engine."""
    if tuple(weight.shape) != (b.shape[0], a.shape[1]):
        raise ValueError(
            f"a LoRA pair of shape {tuple(b.shape[:1]) + tuple(a.shape[1:])} for a weight of {tuple(weight.shape)}"
        )
    return weight + ((b.to(torch.float32) @ a.to(torch.float32)) * scaling).to(weight.dtype)


def peft_files(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> tuple[dict, str]:
    """The adapter ``{module: (A, B)}`` of scale ``scaling`` as peft saves it: the tensors under peft's names (for
    ``adapter_model.safetensors``) and the text of ``adapter_config.json``, whose ``lora_alpha / r`` is
    ``scaling``. One rank for every pair (peft's ``r``)."""
    ranks = {a.shape[0] for a, _ in pairs.values()}
    if len(ranks) != 1:
        raise ValueError(f"a peft adapter folder has one rank; these pairs have ranks {sorted(ranks)}")
    rank = ranks.pop()
    tensors = {}
    for module, (a, b) in pairs.items():
        tensors[f"{PEFT_PREFIX}{module}{A_SUFFIX}{PEFT_LEAF}"] = a.contiguous()
        tensors[f"{PEFT_PREFIX}{module}{B_SUFFIX}{PEFT_LEAF}"] = b.contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": scaling * rank,
        "lora_dropout": 0.0,
        "target_modules": sorted({m.rpartition(".")[2] for m in pairs}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    return tensors, json.dumps(config, indent=1)


def config_scaling(folder: str | Path) -> float | None:
    """The scale ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA) of the peft adapter folder ``folder``;
    None where it has no ``adapter_config.json``."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a peft LoRA config ({type(exc).__name__}: {exc})") from None
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{path}: rank_pattern / alpha_pattern give its modules several scales; strop merges one")
    if rank <= 0 or not math.isfinite(alpha):
        raise ValueError(f"{path}: r={rank}, lora_alpha={alpha} give no scale")
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
