"""Loading straight into shards: a model built on the meta device, split by the strategy (tensor parallel,
FSDP2), is given memory for this rank's pieces only and filled from the Hugging Face safetensors files,
each rank reading only the slices it holds (safetensors reads a slice without reading the tensor). No rank
materialises the whole model. Rotary embeddings, whose tables are not in the files, are computed again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from torch import nn


def safetensors_index(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it, for a Hugging Face model folder (one file, or
    sharded with ``model.safetensors.index.json``)."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json; loading into "
                                "shards reads safetensors files only (convert the checkpoint, e.g. save_pretrained)")
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return {k: single for k in f.keys()}


def load_shards(module: nn.Module, path: str | Path, device: torch.device | str,
                rename: Callable[[str], str | None] = lambda name: name) -> int:
    """Give ``module`` (parameters on the meta device, split or not) memory on ``device`` for what this rank
    holds and fill it from the safetensors files in ``path``. ``rename`` maps a parameter name to its name in
    the files; None means "not in the files": that parameter starts at zero. Returns the bytes read."""
    from safetensors import safe_open

    index = safetensors_index(path)
    shared = _shared_parameters(module)
    module.to_empty(device=device)  # (may make new Parameter objects: the ones tied together are tied again)
    for places in shared:
        first = getattr(places[0][0], places[0][1])
        for owner, attr in places[1:]:
            setattr(owner, attr, first)
    handles, read = {}, 0
    try:
        with torch.no_grad():
            for name, p in module.named_parameters():
                local, start = _local_view(p)
                key = rename(name)
                if key is None:
                    local.zero_()
                    continue
                if key not in index:
                    raise KeyError(f"{path}: no tensor {key!r} (for parameter {name!r}) in the safetensors files")
                if index[key] not in handles:
                    handles[index[key]] = safe_open(index[key], "pt").__enter__()
                piece = handles[index[key]].get_slice(key)
                if list(piece.get_shape()) != list(p.shape):
                    raise ValueError(f"{path}: {key!r} has shape {piece.get_shape()}, the model's {name!r} "
                                     f"{list(p.shape)}")
                part = piece[tuple(slice(o, o + n) for o, n in zip(start, local.shape))] if local.dim() else piece[:]
                local.copy_(part)
                read += part.numel() * part.element_size()
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    _reset_rotary(module, device)
    return read


def _shared_parameters(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Where each parameter that several modules hold (tied embeddings) is held: (module, attribute) lists."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in module.modules():
        for attr, p in owner._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((owner, attr))
    return [v for v in places.values() if len(v) > 1]


def _local_view(p: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's part of ``p`` (a DTensor's local tensor, or ``p``) and where it starts in the whole tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return p.data, (0,) * p.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return p.to_local(), tuple(offset)


def _reset_rotary(module: nn.Module, device) -> None:
    """Rotary embedding modules hold tables computed from the config, not stored: compute them again."""
    for parent in list(module.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RotaryEmbedding") and hasattr(child, "config"):
                setattr(parent, child_name, type(child)(child.config).to(device))
