"""Loading straight into shards: a model built on the meta device, split by the strategy (tensor parallel,
FSDP2), is given memory for this rank's pieces only and filled from the Hugging Face safetensors files,
each rank reading only the rows it holds, straight into its shard (:class:`SafetensorsFile`). No rank
materialises the whole model. Buffers are initialised as ``from_pretrained`` initialises them: the persistent
ones the files hold are read from them, every other (rotary tables, Gemma's embedding scale) is computed by the
model's own ``_init_weights``; a buffer neither fills is refused by name.
"""

from __future__ import annotations

import copy
import json
import math
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
        raise FileNotFoundError(
            f"{folder}: no model.safetensors or model.safetensors.index.json; loading into "
            "shards reads safetensors files only (convert the checkpoint, e.g. save_pretrained)"
        )
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return {k: single for k in f.keys()}


def unloadable(module: nn.Module, path: str | Path) -> str | None:
    """Why :func:`load_shards` cannot fill ``module`` (on the meta device) from ``path`` (None when it can): a
    parameter the files do not hold under its own name, as when transformers converts tensors at load (fused
    MoE experts), or a buffer that neither the files hold nor the model's own initialisation computes."""
    index = safetensors_index(path)
    missing = [name for name, _ in module.named_parameters() if name not in index]
    if missing:
        return (
            f"the files hold no tensor named {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + ": transformers converts them at load (e.g. fused MoE experts)"
        )
    dry = copy.deepcopy(module)  # (on the meta device: no memory; the flags initialisation sets stay off the model)
    pending = [name for name, owner, attr in _buffers(dry) if not _from_files(owner, attr, name, index)]
    if left := _initialise_buffers(dry, pending):
        return _uninitialised(left)
    return None


def load_shards(
    module: nn.Module,
    path: str | Path,
    device: torch.device | str,
    rename: Callable[[str], str | None] = lambda name: name,
) -> int:
    """Give ``module`` (parameters on the meta device, split or not) memory on ``device`` for what this rank
    holds and fill it from the safetensors files in ``path``. ``rename`` maps a parameter or buffer name to its
    name in the files; None means "not in the files": that parameter starts at zero. Buffers are initialised as
    ``from_pretrained`` does (see the module's docstring); a buffer that cannot be is refused (ValueError, by
    name). Returns the bytes read."""
    index = safetensors_index(path)
    shared = _shared_parameters(module)
    module.to_empty(device=device)  # (may make new Parameter objects: the ones tied together are tied again)
    for places in shared:
        first = getattr(places[0][0], places[0][1])
        for owner, attr in places[1:]:
            setattr(owner, attr, first)
    pending, stored = [], []  # buffers to initialise; buffers the files hold (persistent ones only, as transformers)
    for name, owner, attr in _buffers(module):
        key = rename(name)
        (stored if key is not None and _from_files(owner, attr, key, index) else pending).append((name, key))
    files, read = {}, 0
    tensors = [(name, rename(name), p) for name, p in module.named_parameters()]
    tensors += [(name, key, module.get_buffer(name)) for name, key in stored]
    try:
        with torch.no_grad():
            for name, key, p in tensors:
                local, start = _local_view(p)
                if key is None:
                    local.zero_()
                    continue
                if key not in index:
                    raise KeyError(f"{path}: no tensor {key!r} (for {name!r}) in the safetensors files")
                if index[key] not in files:
                    files[index[key]] = SafetensorsFile(index[key])
                read += files[index[key]].read_into(key, start, local, expect=tuple(p.shape), what=name)
    finally:
        for f in files.values():
            f.close()
    if left := _initialise_buffers(module, [name for name, _ in pending]):  # (after loading, as from_pretrained)
        raise ValueError(f"{path}: cannot load into shards: {_uninitialised(left)}")
    return read


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsFile:
    """Reads a block of a tensor of a safetensors file straight into a tensor this rank holds.

    (The safetensors library reads a slice as a new tensor through a memory map, so the slice exists twice
    and the file's pages stay mapped while the file is open: at tensor parallel 2 the loading peak was 1.5x
    the whole weights. Here the rows needed are read with plain file reads, in blocks of at most
    ``block_bytes``, into the shard itself when its rows are whole and its dtype is the file's, else through
    one block-sized buffer; the format (an 8-byte header length, a JSON header, raw little-endian data) is
    the one the library writes.)"""

    def __init__(self, path: str | Path, block_bytes: int = 64 << 20):
        self.path, self.block_bytes = Path(path), block_bytes
        self.file = open(self.path, "rb")
        n = int.from_bytes(self.file.read(8), "little")
        self.header = json.loads(self.file.read(n))
        self.header.pop("__metadata__", None)
        self.data_start = 8 + n

    def close(self) -> None:
        self.file.close()

    def read_into(
        self, key: str, start: tuple[int, ...], out: torch.Tensor, *, expect: tuple[int, ...], what: str = ""
    ) -> int:
        """Fill ``out`` with the block of tensor ``key`` that begins at index ``start``; returns the bytes read."""
        meta = self.header[key]
        shape, dtype = tuple(meta["shape"]), _DTYPES.get(meta["dtype"])
        if shape != tuple(expect):
            raise ValueError(f"{self.path}: {key!r} has shape {list(shape)}, the model's {what!r} {list(expect)}")
        if dtype is None:
            raise ValueError(f"{self.path}: {key!r} is stored as {meta['dtype']}, which strop cannot load into shards")
        if len(shape) == 0:
            shape, start, out = (1,), (0,), out.reshape(1)
        if any(s != 0 or n != full for s, n, full in zip(start[2:], out.shape[2:], shape[2:])):
            raise ValueError(f"{key!r}: only the first two dimensions of a tensor can be split for loading")
        item = torch.empty((), dtype=dtype).element_size()
        row = math.prod(shape[1:])  # elements per index of the first dimension
        r0, rows = start[0], out.shape[0]
        c0, cols = (start[1], out.shape[1]) if len(shape) > 1 else (0, 1)
        whole_rows = len(shape) == 1 or cols == shape[1]
        direct = whole_rows and out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous()
        step = max(1, self.block_bytes // (row * item))
        buf = None if direct else torch.empty(min(step, rows) * row, dtype=dtype)
        for a in range(0, rows, step):
            n = min(step, rows - a)
            self.file.seek(self.data_start + meta["data_offsets"][0] + (r0 + a) * row * item)
            target = out.reshape(-1)[a * row : (a + n) * row] if direct else buf[: n * row]
            got = self.file.readinto(memoryview(target.view(torch.uint8).numpy()))
            if got != n * row * item:
                raise ValueError(f"{self.path}: {key!r} ends early (read {got} of {n * row * item} bytes)")
            if not direct:
                block = target.view(n, *shape[1:])
                out[a : a + n].copy_(block if whole_rows else block[:, c0 : c0 + cols])
        return rows * row * item


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


def _buffers(module: nn.Module):
    """(name, owning module, attribute) of every buffer of ``module``."""
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for attr, b in owner._buffers.items():
            if b is not None:
                yield (f"{prefix}.{attr}" if prefix else attr), owner, attr


def _from_files(owner: nn.Module, attr: str, key: str, index: dict) -> bool:
    """Whether a buffer comes from the files: a persistent one they hold. (from_pretrained ignores a stored copy
    of a non-persistent buffer, like the rotary tables old checkpoints kept, and computes it.)"""
    return key in index and attr not in owner._non_persistent_buffers_set


def _initialise_buffers(module: nn.Module, names: list[str]) -> list[str]:
    """Compute the buffers ``names`` of ``module`` as ``from_pretrained`` does after it loaded the files: every
    other tensor is marked loaded (transformers' ``_is_hf_initialized``) and the model's own ``initialize_weights``
    runs, which skips what is marked. Returns the names it did not write (their content is still garbage)."""
    if not names:
        return []
    from transformers import PreTrainedModel

    before = {name: (module.get_buffer(name), module.get_buffer(name)._version) for name in names}
    for t in list(module.parameters()) + list(module.buffers()):
        t._is_hf_initialized = True
    for b, _ in before.values():
        b._is_hf_initialized = False
    for m in module.modules():  # (a module marked done is skipped whole)
        m._is_hf_initialized = False
    with torch.no_grad():
        for model in _outermost(module, PreTrainedModel):
            model.initialize_weights()
    # written in place (its version moved) or replaced by a new tensor
    return [name for name, (b, version) in before.items() if module.get_buffer(name) is b and b._version == version]


def _outermost(module: nn.Module, kind: type) -> list[nn.Module]:
    """The submodules of ``kind`` (``module`` itself included) that no other one of ``kind`` contains."""
    if isinstance(module, kind):
        return [module]
    return [found for child in module.children() for found in _outermost(child, kind)]


def _uninitialised(names: list[str]) -> str:
    return (
        f"buffer {names[0]!r}" + (f" (and {len(names) - 1} more)" if len(names) > 1 else "") + " is not in the "
        "files and the model's own initialisation does not compute it"
    )
