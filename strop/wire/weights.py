"""Reading the trainer's weights as a weight update does: a bucket of tensors at a time.

What the trainer hands an engine is a mapping name -> whole tensor: a plain state dict, or
(FSDP, tensor parallel) :class:`strop.parallel.gather.ShardedWeights`, whose reads are
collectives that gather only what is read. Everything that moves weights reads through
these helpers, so a sharded model is never gathered whole: :func:`describe` gives a
tensor's dtype and shape without reading it, :func:`take` reads several at once, and
:func:`in_buckets` walks names a bounded number of bytes at a time. :func:`write_safetensors`
writes one safetensors file that way (header first, from the descriptions; then the bytes).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

DEFAULT_WRITE_BUCKET_BYTES = 64 << 20

_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def tensor_bytes(t: torch.Tensor):
    """A tensor's raw bytes, on the host, as a buffer (no copy when it is already contiguous on the CPU:
    hashlib reads it without holding the GIL, so hashing in a thread leaves the event loop running)."""
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()


def describe(named: Mapping, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
    """``named[name]``'s dtype and shape, without gathering it when ``named`` is sharded."""
    if hasattr(named, "meta"):
        return named.meta(name)
    t = named[name]
    return t.dtype, tuple(t.shape)


def nbytes(named: Mapping, name: str) -> int:
    dtype, shape = describe(named, name)
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def take(named: Mapping, names) -> dict[str, torch.Tensor]:
    """``names`` of ``named``: a dict's own tensors, or sharded weights gathered together (one collective)."""
    names = list(names)
    return named.gather(names) if hasattr(named, "gather") else {n: named[n] for n in names}


def in_buckets(named: Mapping, names, bucket_bytes: int = DEFAULT_WRITE_BUCKET_BYTES) -> Iterator[dict]:
    """``names`` of ``named`` in order, at most ``bucket_bytes`` per bucket (a larger tensor alone). Each
    bucket is read when it is reached; the reader drops it before the next."""
    batch, size = [], 0
    for name in names:
        n = nbytes(named, name)
        if batch and size + n > bucket_bytes:
            yield take(named, batch)
            batch, size = [], 0
        batch.append(name)
        size += n
    if batch:
        yield take(named, batch)


def write_safetensors(named: Mapping, path: str | Path, bucket_bytes: int = DEFAULT_WRITE_BUCKET_BYTES) -> str:
    """Write every tensor of ``named`` (each name, tied ones too) into the safetensors file ``path``, reading
    a bucket at a time: the header from :func:`describe`, then the tensors' bytes in name order. Returns
    the checksum :func:`strop.wire.digest.state_checksum` computes of the same tensors."""
    names = sorted(named)
    header, at = {}, 0
    for name in names:
        dtype, shape = describe(named, name)
        if dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype {dtype} has no safetensors code")
        size = nbytes(named, name)
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + size]}
        at += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # (the data starts 8-byte aligned)
    h = hashlib.blake2b(digest_size=16)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for bucket in in_buckets(named, names, bucket_bytes):
            for name, t in bucket.items():
                if (t.dtype, tuple(t.shape)) != describe(named, name):
                    raise RuntimeError(
                        f"{name}: read as {t.dtype} {tuple(t.shape)}, described as {describe(named, name)}"
                    )
                data = tensor_bytes(t)
                h.update(name.encode())
                h.update(str(t.dtype).encode())
                h.update(data)
                f.write(data)
            t = data = bucket = None  # (nothing of this bucket outlives it)
    return h.hexdigest()


class Subset(Mapping):
    """``names`` of ``named`` as a mapping of their own, read as ``named`` reads (gathered when sharded)."""

    def __init__(self, named: Mapping, names):
        self.named, self.names = named, list(names)
        self._set = set(self.names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._set:
            raise KeyError(name)
        return self.named[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        return describe(self.named, name)

    def gather(self, names) -> dict[str, torch.Tensor]:
        return take(self.named, names)
