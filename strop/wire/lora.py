"""A LoRA adapter on the wire (``model.lora_rank``, ``engine.sync='adapter'``): the tensors the trainer writes,
strop serve reads and merges, and the one formula both sides merge with, so the weights an engine decodes
equal the trainer's merged weights bit for bit (and their checksums compare).

An adapter file names each adapted linear by the base model's module name: ``<module>.lora_A`` (rank x in)
and ``<module>.lora_B`` (out x rank); the scale (``lora_alpha / lora_rank``) travels beside it."""

from __future__ import annotations

import torch

A_SUFFIX, B_SUFFIX = ".lora_A", ".lora_B"


def adapter_tensors(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``{module: (A, B)}`` as the file's tensors."""
    out = {}
    for module, (a, b) in pairs.items():
        out[module + A_SUFFIX], out[module + B_SUFFIX] = a, b
    return out


def adapter_pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The file's tensors as ``{module: (A, B)}``; a name that is not one of a pair is refused."""
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
