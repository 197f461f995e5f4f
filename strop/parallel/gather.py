"""A sharded model's whole weights for rank 0, gathered a bucket at a time while rank 0 reads them.

Under FSDP or tensor parallel no rank holds a whole tensor, and gathering the whole model
onto rank 0 before a weight sync would hold it twice there (the engine's copy aside) and
once more on every rank for the length of the gather. :class:`ShardedWeights` is instead a
read-only mapping, name -> whole tensor, that rank 0 hands to the engine as its state dict;
each read is a collective the other ranks serve. A session (:meth:`ShardedWeights.open` on
rank 0, :meth:`ShardedWeights.serve` on the others, :meth:`ShardedWeights.close` to end it)
runs around the controller's work: rank 0 announces which tensors it reads next on a gloo
group (an index list), every rank all-gathers exactly those, rank 0 keeps them, the others
drop theirs. What a reader holds is one bucket at a time, freed as soon as it lets go.

Tied parameters (an lm_head sharing the embedding) are one tensor under two names: gathered
once, the same tensor under both, as ``model.state_dict()`` has them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

_DONE = -1


class ShardedWeights(Mapping):
    """``model``'s state dict, whole tensors gathered on read (every rank holds one of these: same model
    structure, so the same names in the same order)."""

    def __init__(self, model: nn.Module):
        self.local = model.state_dict()  # DTensor shards (or plain, replicated tensors), not copies
        self.canonical = canonical_names(model)
        self.names = list(self.local)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.device = next(iter(self.local.values())).device
        self.group, self.serving = None, False
        self.gathers, self.largest = 0, 0  # reads, and the most bytes one read gathered (bench, tests)
        self._lock = threading.Lock()

    # ---- the mapping rank 0 reads -----------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        return self.gather([name])[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """A tensor's dtype and whole shape, without gathering it."""
        t = self.local[name]
        return t.dtype, tuple(t.shape)  # (a DTensor's shape is the global one)

    def manifest(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of every tensor once (an alias of an earlier name skipped), as
        :func:`strop.wire.buckets.manifest_of` describes a plain state dict."""
        seen, out = set(), []
        for name in self.names:
            key = self.canonical.get(name, name)
            if key not in seen:
                seen.add(key)
                dtype, shape = self.meta(name)
                out.append((name, str(dtype).removeprefix("torch."), shape))
        return out

    def whole(self) -> dict[str, torch.Tensor]:
        """Every tensor at once (the whole model on rank 0: for writing a Hugging Face copy)."""
        return self.gather(self.names)

    def gather(self, names: list[str]) -> dict[str, torch.Tensor]:
        """``names`` whole, on rank 0 (a collective the other ranks serve inside the session)."""
        keys = list(dict.fromkeys(self.canonical.get(n, n) for n in names))  # each tensor once
        if not dist.is_initialized() or dist.get_world_size() == 1:
            got = {k: whole_tensor(self.local[k]) for k in keys}
        else:
            with self._lock:  # (readers in several threads: one announcement and its gathers at a time)
                if not self.serving:
                    raise RuntimeError(
                        "sharded weights read outside their session: the other ranks are not "
                        "serving them (read them inside Control.on_controller(..., serving=...))"
                    )
                _announce(self.group, [self.index[k] for k in keys])
                got = {k: whole_tensor(self.local[k]) for k in keys}
        self.gathers += 1
        self.largest = max(self.largest, sum(t.numel() * t.element_size() for t in got.values()))
        return {n: got[self.canonical.get(n, n)] for n in names}

    # ---- the session -------------------------------------------------------------------------------------
    def open(self, group) -> None:
        """Rank 0: reads may start (the other ranks are in :meth:`serve`)."""
        self.group, self.serving = group, True

    def close(self) -> None:
        """Rank 0: the session ends; the other ranks return from :meth:`serve`."""
        with self._lock:
            if self.serving:
                self.serving = False
                _announce(self.group, [_DONE])

    def serve(self, group) -> None:
        """Ranks other than 0: join each gather rank 0 announces, until it closes the session."""
        while True:
            wanted = _listen(group)
            if wanted == [_DONE]:
                return
            for i in wanted:
                t = self.local[self.names[i]]
                if hasattr(t, "full_tensor"):
                    whole_tensor(t)  # this rank's part of the all-gather; the result is dropped


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Each parameter's name -> the first name of the same parameter (tied embeddings: lm_head.weight ->
    model.embed_tokens.weight); a tie is the module's structure, so every rank finds the same."""
    first: dict[int, str] = {}
    return {name: first.setdefault(id(p), name) for name, p in model.named_parameters(remove_duplicate=False)}


ROWS_BYTES = 4 << 20  # a tensor split evenly by rows over one mesh dimension is gathered this much at a time


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """A fresh whole copy: gathered from the shards (a collective), or cloned when every rank holds it."""
    if not hasattr(t, "full_tensor"):
        return t.clone().detach()
    from torch.distributed.tensor import Replicate, Shard

    mesh, rows = t.device_mesh, t.shape[0] if t.dim() else 0
    last = mesh.ndim - 1  # rows split evenly over the last mesh dimension (tensor parallel's, or a 1-D mesh's)
    split = t.placements[last]
    if rows and type(split) is Shard and split.dim == 0 and rows % mesh.size(last) == 0:
        if mesh.ndim > 1:  # (dp, tp): first whole over dp, each rank keeping its tp part (half a tensor at tp 2)
            t = t.redistribute(placements=[Replicate()] * last + [Shard(0)])
        if all(p == Replicate() for p in t.placements[:last]):
            return _rows_gathered(t.to_local(), tuple(t.shape), mesh.get_group(last), mesh.size(last)).detach()
    return t.full_tensor().detach()


def _rows_gathered(local: torch.Tensor, shape: tuple[int, ...], group, n: int) -> torch.Tensor:
    """A tensor whose rows are split evenly over ``group`` (``local``: this rank's, in group order: the embedding
    under tensor parallel, FSDP's shards), gathered into one output a block of rows at a time: DTensor's (and
    gloo's) gather of the whole held it twice, which for a vocabulary-sized embedding was a sync's largest
    transient."""
    rows = local.shape[0]
    out = torch.empty(shape, dtype=local.dtype, device=local.device)
    per_row = max(1, local[0].numel() * local.element_size())
    step = min(rows, max(1, ROWS_BYTES // (n * per_row)))
    buffer = torch.empty((n * step, *local.shape[1:]), dtype=local.dtype, device=local.device)  # (one, reused)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    for a in range(0, rows, step):
        k = min(step, rows - a)
        block = buffer[: n * k]
        gather(block, local[a : a + k].contiguous(), group=group)
        for r in range(n):  # rank r's rows a..a+k are rows r * rows + a.. of the whole
            out[r * rows + a : r * rows + a + k].copy_(block[r * k : (r + 1) * k])
    return out


def _announce(group, indices: list[int]) -> None:
    dist.broadcast(torch.tensor([len(indices)], dtype=torch.int64), src=0, group=group)
    dist.broadcast(torch.tensor(indices, dtype=torch.int64), src=0, group=group)


def _listen(group) -> list[int]:
    n = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(n, src=0, group=group)
    indices = torch.zeros(int(n), dtype=torch.int64)
    dist.broadcast(indices, src=0, group=group)
    return indices.tolist()


def whole(weights):
    """Every tensor of ``weights`` at once: a dict as it is, sharded weights gathered whole on rank 0."""
    return weights.whole() if isinstance(weights, ShardedWeights) else weights
