"""A weight update's manifest and buckets: names, dtypes and shapes, grouped into buckets of at most
``bucket_bytes`` (a larger tensor travels alone), each bucket one flat uint8 buffer on the wire."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strop.wire.weights import take


@dataclass(frozen=True)
class Bucket:
    """Whole tensors that travel in one broadcast. ``flattened``: their bytes concatenated in order
    into one uint8 buffer (SGLang's ``load_format="flattened_bucket"``); otherwise a single tensor
    larger than a bucket, broadcast as itself (SGLang's per-tensor form)."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    flattened: bool

    @property
    def nbytes(self) -> int:
        return sum(_numel(s) * _itemsize(d) for d, s in zip(self.dtypes, self.shapes))

    def payload(self) -> dict:
        """The names, dtypes and shapes as SGLang's update request carries them."""
        return {
            "names": list(self.names),
            "dtypes": list(self.dtypes),
            "shapes": [list(s) for s in self.shapes],
            "load_format": "flattened_bucket" if self.flattened else None,
        }

    @classmethod
    def from_payload(cls, names, dtypes, shapes, load_format) -> "Bucket":
        """A bucket from an update request; unknown dtypes or malformed lists raise ValueError naming them."""
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise ValueError(
                f"names, dtypes and shapes must be non-empty lists of one length, got {len(names)}, "
                f"{len(dtypes)}, {len(shapes)}"
            )
        bad = [d for d in dtypes if not isinstance(getattr(torch, str(d), None), torch.dtype)]
        if bad:
            raise ValueError(f"unknown dtype {bad[0]!r}")
        if any(not isinstance(x, int) or x < 0 for s in shapes for x in s):
            raise ValueError(f"shapes must be lists of non-negative integers, got {shapes[:3]}")
        if load_format not in (None, "flattened_bucket"):
            raise ValueError(f"load_format {load_format!r}: only null (one tensor) or 'flattened_bucket'")
        if load_format is None and len(names) != 1:
            raise ValueError(f"without load_format='flattened_bucket' a broadcast carries one tensor, got {len(names)}")
        return cls(tuple(names), tuple(dtypes), tuple(tuple(s) for s in shapes), load_format == "flattened_bucket")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def plan_buckets(manifest: list[tuple[str, str, tuple[int, ...]]], bucket_bytes: int) -> list[Bucket]:
    """Group the manifest's tensors, in order, into flattened buckets of at most ``bucket_bytes``; a
    tensor larger than that travels alone (SGLang and vLLM load whole tensors: there is no smaller unit).
    Each tensor starts at a multiple of its element size in its bucket (SGLang splits the buffer with
    ``view(dtype)`` and refuses an unaligned one): a bucket closes early rather than misalign the next."""
    buckets: list[Bucket] = []
    open_: list[tuple[str, str, tuple[int, ...]]] = []
    used = 0

    def close():
        nonlocal open_, used
        if open_:
            buckets.append(Bucket(*(tuple(x) for x in zip(*open_)), flattened=True))
        open_, used = [], 0

    for name, dtype, shape in manifest:
        size = _numel(shape) * _itemsize(dtype)
        if size > bucket_bytes:
            close()
            buckets.append(Bucket((name,), (dtype,), (tuple(shape),), flattened=False))
            continue
        if used + size > bucket_bytes or used % _itemsize(dtype):  # (SGLang refuses a tensor at an unaligned offset)
            close()
        open_.append((name, dtype, tuple(shape)))
        used += size
    close()
    return buckets


def manifest_of(named: dict[str, torch.Tensor]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor, skipping names that alias an earlier one (tied weights).
    Sharded weights (strop.parallel.gather) describe themselves without a gather."""
    if hasattr(named, "manifest"):
        return named.manifest()
    seen, out = set(), []
    for name, t in named.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        out.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
    return out


def first_mismatch(
    sent: list[tuple[str, str, tuple[int, ...]]], held: list[tuple[str, str, tuple[int, ...]]], where: str
) -> str | None:
    """The first difference between the trainer's manifest and an engine's, in words (None: they agree).
    Checked before any byte moves: a name either side lacks, then a shape, then a dtype."""
    theirs = {n: (d, tuple(s)) for n, d, s in held}
    ours = {n for n, _, _ in sent}
    for name, dtype, shape in sent:
        if name not in theirs:
            return f"{where} has no tensor {name!r} (the trainer's {dtype} {list(shape)})"
        d, s = theirs[name]
        if s != tuple(shape):
            return f"{name!r}: the trainer's shape is {list(shape)}, {where}'s is {list(s)}"
        if d != dtype:
            return (
                f"{name!r}: the trainer sends {dtype}, {where} holds {d} (set engine.sync_dtype={d!r} to cast "
                "on the trainer's side)"
            )
    missing = [n for n, _, _ in held if n not in ours]
    if missing:
        return f"{where} holds {missing[0]!r}, which the trainer does not send (it would keep its old weights)"
    return None


def fill_bucket(bucket: Bucket, named: dict[str, torch.Tensor], device, dtype: str | None = None) -> torch.Tensor:
    """Trainer side: the tensor one bucket travels as. Flattened: a new uint8 buffer holding the tensors'
    bytes in order (cast to their bucket dtype); a lone tensor: itself (cast to ``dtype`` when set), with
    no copy when it is already contiguous. The extra memory is the bucket's buffer."""
    named = take(named, bucket.names)  # (sharded weights: this bucket's tensors gathered, no others)
    if not bucket.flattened:
        t = named[bucket.names[0]].detach()
        return (t.to(getattr(torch, dtype)) if dtype else t).contiguous()
    buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    at = 0
    for name, d in zip(bucket.names, bucket.dtypes):
        t = named[name].detach()
        t = t.to(getattr(torch, d)) if str(t.dtype).removeprefix("torch.") != d else t
        n = t.numel() * t.element_size()
        buf[at : at + n].view(t.dtype).copy_(t.reshape(-1))
        at += n
    return buf
