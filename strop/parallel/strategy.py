"""Data-parallel strategies: how one process takes part in a training step.

The trainer asks its strategy five things and never calls torch.distributed itself:

- ``wrap(module)``        shard a module (FSDP) or leave it whole;
- ``share(micro_batches)`` which micro-batches this rank runs, each flagged real or a
                          zero-weight balancing repeat (FSDP: every forward is a collective);
- ``loss_scale(real)``    what this rank's loss is multiplied by before backward;
- ``after_backward(ps)``  what happens to the gradients once every micro-batch ran;
- ``merge_rows`` / ``merge_stats`` / ``full_weights``: how per-rank results become the step's.

:class:`SingleProcess` is the trivial case; :class:`Replicate` keeps a whole model
per rank and sums gradients with the chunked all-reduce; :class:`FullyShard` shards
policy, reference and critic with FSDP2. Context parallel ranks (``cp_group``) split
every micro-batch's tokens in both; gradients are summed over data x context ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from strop.parallel.collectives import DEFAULT_BUCKET_BYTES, all_reduce_coalesced
from strop.parallel.fsdp import full_weights, shard


def _unaliased(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached copies; tensors that shared storage (tied embeddings) still share their copy."""
    copies, out = {}, {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in copies:
            copies[key] = t.detach().clone()
        out[name] = copies[key]
    return out


class SingleProcess:
    """One process: every micro-batch is ours, gradients are already the step's."""

    mode = "single"
    dp_rank, dp_size, cp_size, world = 0, 1, 1, 1
    dp_group = cp_group = None
    balance = False

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def wrap(self, module: nn.Module, *, trainable: bool = True) -> nn.Module:
        return module

    def share(self, micro_batches: list[list[int]]) -> list[tuple[list[int], bool]]:
        """This rank's micro-batches, round robin over data-parallel ranks, each with a flag "real".

        With ``balance`` every rank runs the same number: a rank short of one repeats a
        real micro-batch whose loss is weighted 0, so it joins every collective and changes nothing.
        """
        mine = [(idx, True) for idx in micro_batches[self.dp_rank :: self.dp_size]]
        if self.balance and micro_batches:
            per_rank = -(-len(micro_batches) // self.dp_size)
            mine += [(micro_batches[0], False)] * (per_rank - len(mine))
        return mine

    def loss_scale(self, real: bool) -> float:
        return 1.0 if real else 0.0

    def after_backward(self, params: list[nn.Parameter]) -> None:
        pass

    def merge_rows(self, tensors: list[torch.Tensor]) -> None:
        """Each rank filled disjoint rows of ``tensors``; afterwards every rank holds all of them."""

    def merge_stats(self, stats) -> None:
        """``stats`` (a StepStats) measured this rank's micro-batches; afterwards it holds every rank's."""

    def full_weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The policy's whole weights on its device, as copies the next optimizer step cannot change.
        A collective under FSDP; ranks other than 0 may get ``{}``."""
        return _unaliased(model.state_dict())

    def scalar(self, value: torch.Tensor) -> float:
        return float(value.full_tensor() if hasattr(value, "full_tensor") else value)

    def describe(self) -> str:
        return "1 process"


class Replicate(SingleProcess):
    """Every rank holds the whole model; gradients are summed with the chunked all-reduce.

    Losses are normalised over the whole step, so the sum of the ranks' gradients is the
    one-process gradient.
    """

    mode = "replicate"

    def __init__(self, dp_group, cp_group=None, *, device="cpu", bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        super().__init__(device)
        self.dp_group, self.cp_group, self.bucket_bytes = dp_group, cp_group, bucket_bytes
        self.dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
        self.world = self.dp_size * self.cp_size
        if self.world != dist.get_world_size():
            raise ValueError(f"data parallel ({self.dp_size}) x context parallel ({self.cp_size}) must cover all "
                             f"{dist.get_world_size()} processes")
        # every rank's gradients add up to the step's: DP ranks saw other micro-batches, CP ranks other tokens
        self.grad_group = dist.group.WORLD

    def after_backward(self, params):
        for p in params:  # a rank with no micro-batch still sends zeros: every rank sends the same list
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        all_reduce_coalesced([p.grad for p in params], op="sum", bucket_bytes=self.bucket_bytes, group=self.grad_group)

    def merge_rows(self, tensors):
        if self.dp_size > 1 and tensors:  # each row came from exactly one rank: the sum assembles the batch
            moved = [t.to(self.device) for t in tensors]
            all_reduce_coalesced(moved, op="sum", bucket_bytes=self.bucket_bytes, group=self.dp_group)
            for t, m in zip(tensors, moved):
                if m is not t:
                    t.copy_(m)

    def merge_stats(self, stats):
        if self.dp_size > 1:
            parts = [None] * self.dp_size
            dist.all_gather_object(parts, stats.parts(), group=self.dp_group)
            stats.absorb(parts)

    def full_weights(self, model):
        return super().full_weights(model) if dist.get_rank() == 0 else {}  # only rank 0 feeds an engine

    def describe(self) -> str:
        return f"{self.world} processes = data parallel {self.dp_size} ({self.mode}) x context parallel {self.cp_size}"


class FullyShard(Replicate):
    """FSDP2 over every rank: parameters, gradients and optimizer state of the policy, the
    reference and the critic are sharded; FSDP reduce-scatters gradients in backward."""

    mode = "fsdp"
    balance = True

    def __init__(self, dp_group, cp_group=None, *, device="cpu", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 mixed_precision: bool = False):
        super().__init__(dp_group, cp_group, device=device, bucket_bytes=bucket_bytes)
        self.mixed_precision = mixed_precision

    def wrap(self, module, *, trainable=True):
        return shard(module, self.grad_group, device_type=self.device.type, mixed_precision=self.mixed_precision)

    def loss_scale(self, real):
        # FSDP averages gradients over ranks; strop's losses are globally normalised, so scale by the
        # world size to make that average the sum. A balancing repeat weighs 0.
        return float(self.world) if real else 0.0

    def after_backward(self, params):
        pass  # reduce-scattered by FSDP's hooks already

    def full_weights(self, model):
        return full_weights(model)


def make_strategy(*, dp_group=None, cp_group=None, mode: str = "replicate", device="cpu",
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES, mixed_precision: bool = False) -> SingleProcess:
    """The strategy for this process: one process when no group spans several ranks."""
    if not dist.is_initialized() or (dp_group is None and cp_group is None) or dist.get_world_size() == 1:
        return SingleProcess(device)
    if mode == "fsdp":
        return FullyShard(dp_group, cp_group, device=device, bucket_bytes=bucket_bytes, mixed_precision=mixed_precision)
    if mode != "replicate":
        raise ValueError(f"parallel.dp_mode must be 'replicate' or 'fsdp', got {mode!r}")
    return Replicate(dp_group, cp_group, device=device, bucket_bytes=bucket_bytes)
