"""Data-parallel strategies: how one process takes part in a training step.

A strategy is built from the run's :class:`strop.parallel.dims.ParallelDims` and its mesh
(:func:`make_strategy`); the modules it trains were split before the trainer got them
(:func:`strop.parallel.parallelize.parallelize`). The trainer asks it five things and never calls
torch.distributed itself:

- ``track(module)``       note a split module's parameters whose gradients ranks hold parts of;
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

import math

import torch
import torch.distributed as dist
from torch import nn

from strop.parallel.collectives import all_reduce_coalesced
from strop.parallel.dims import ParallelDims
from strop.parallel.fsdp import full_weights
from strop.parallel.gather import ShardedWeights
from strop.parallel.tensor import partial_gradient_parameters


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
    dp_rank, dp_size, cp_size, tp_size, world = 0, 1, 1, 1, 1
    dp_group = cp_group = tp_group = expert_mesh = None
    balance = False

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.dims, self.mesh = ParallelDims(), None  # what parallelize reads: one process, nothing split

    def track(self, module: nn.Module) -> nn.Module:
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

    def weights(self, model: nn.Module):
        """The policy's whole weights for the engine on rank 0: :meth:`full_weights`, or, where the model is
        sharded (FSDP, tensor parallel), a :class:`ShardedWeights` read a bucket at a time inside a session
        (``Control.on_controller(..., serving=weights)``) and never gathered whole on any rank."""
        split = self.mode == "fsdp" or self.tp_size > 1 or self.expert_mesh is not None
        return ShardedWeights(model) if split else self.full_weights(model)

    @property
    def processes(self) -> int:
        """Every rank of the run: data x context x tensor parallel."""
        return self.world * self.tp_size

    def scalar(self, value: torch.Tensor) -> float:
        return float(value.full_tensor() if hasattr(value, "full_tensor") else value)

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> float:
        """Scale the gradients to a total norm of at most ``max_norm``; returns the norm before."""
        return self.scalar(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def describe(self) -> str:
        return "1 process"


class Replicate(SingleProcess):
    """Every rank holds the whole model; gradients are summed with the chunked all-reduce.

    Losses are normalised over the whole step, so the sum of the ranks' gradients is the
    one-process gradient.
    """

    mode = "replicate"

    def __init__(self, dims: ParallelDims, mesh, device: torch.device | str = "cpu"):
        """``mesh``: the named mesh ``dims`` built (:meth:`ParallelDims.build_mesh`), whose groups this reads."""
        super().__init__(device)
        self.dims, self.mesh, self.bucket_bytes = dims, mesh, dims.bucket_bytes
        self.dp_group = mesh["dp"].get_group()
        self.cp_group = mesh["cp"].get_group() if dims.tp == 1 else None
        self.dp_rank, self.dp_size = dist.get_rank(self.dp_group), dist.get_world_size(self.dp_group)
        self.cp_size = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        self.tp_size = dims.tp
        self.tp_group = mesh["tp"].get_group() if self.tp_size > 1 else None
        self.world = self.dp_size * self.cp_size  # the ranks that see different tokens
        # every rank's gradients add up to the step's: DP ranks saw other micro-batches, CP ranks other tokens;
        # tensor-parallel ranks hold other slices of the same gradients
        self.grad_group = dist.group.WORLD if self.tp_size == 1 else self.dp_group
        # per wrapped module, the parameters whose gradients the TP ranks hold parts of (held, so that their ids
        # cannot be reused by other tensors)
        self.partial: dict[int, list[nn.Parameter]] = {}
        self.expert_mesh = dims.build_expert_mesh(mesh.device_type)  # (edp, ep): experts split (strop.parallel.expert)
        self.balance = self.balance or self.expert_mesh is not None  # each forward dispatches: all run as many

    def track(self, module):
        """Note ``module``'s parameters whose gradients the TP ranks hold parts of (again after loading into
        shards, which may make new parameter objects)."""
        if self.tp_size > 1:
            self.partial[id(module)] = partial_gradient_parameters(module)
        return module

    def after_backward(self, params):
        for p in params:  # a rank with no micro-batch still sends zeros: every rank sends the same list
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        experts = {id(p) for p in params if self._expert(p)}  # each rank's own experts: summed over edp only
        if self.world > 1:
            all_reduce_coalesced(
                [_local(p.grad) for p in params if id(p) not in experts],
                op="sum",
                bucket_bytes=self.bucket_bytes,
                group=self.grad_group,
            )
        if experts and self.expert_mesh["edp"].size() > 1:
            group = self.expert_mesh["edp"].get_group()
            grads = [_local(p.grad) for p in params if id(p) in experts]
            all_reduce_coalesced(grads, op="sum", bucket_bytes=self.bucket_bytes, group=group)
        self._sum_partial(params)

    def _expert(self, p) -> bool:
        """Whether ``p`` is an expert tensor split by expert parallel (a DTensor on its (edp, ep) mesh)."""
        names = getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ()
        return self.expert_mesh is not None and "ep" in names

    def _sum_partial(self, params):
        """Gradients each tensor-parallel rank holds a part of, summed over them: Qwen3's per-head norms (plain
        tensors), and under sequence parallel the norms that saw this rank's tokens (DTensors that say Partial,
        then Replicate)."""
        from torch.distributed.tensor import DTensor, Partial, Replicate

        partial = {id(p) for ps in self.partial.values() for p in ps}
        pending = [
            p
            for p in params
            if isinstance(p.grad, DTensor) and any(isinstance(pl, Partial) for pl in p.grad.placements)
        ]
        parts = [_local(p.grad) for p in params if id(p) in partial and p.grad is not None] + [
            p.grad.to_local() for p in pending
        ]
        if parts:
            all_reduce_coalesced(parts, op="sum", bucket_bytes=self.bucket_bytes, group=self.tp_group)
        for p in pending:
            g = p.grad
            p.grad = DTensor.from_local(
                g.to_local(),
                g.device_mesh,
                [Replicate() if isinstance(pl, Partial) else pl for pl in g.placements],
                run_check=False,
            )

    def clip_grad_norm(self, params, max_norm):
        if self.tp_size == 1 and self.expert_mesh is None:
            return super().clip_grad_norm(params, max_norm)
        return clip_sharded(params, max_norm)

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
        if self.tp_size > 1 or self.expert_mesh is not None:  # every rank gathers its slices (a collective)
            return full_weights(model)
        return super().full_weights(model) if dist.get_rank() == 0 else {}  # only rank 0 feeds an engine

    def describe(self) -> str:
        tp = f" x tensor parallel {self.tp_size}" if self.tp_size > 1 else ""
        tp += f", experts split over {self.dims.ep} (expert parallel)" if self.expert_mesh is not None else ""
        return (
            f"{self.processes} processes = data parallel {self.dp_size} ({self.mode}) x context "
            f"parallel {self.cp_size}{tp}"
        )


class FullyShard(Replicate):
    """FSDP2 over every rank: parameters, gradients and optimizer state of the policy, the
    reference and the critic are sharded; FSDP reduce-scatters gradients in backward."""

    mode = "fsdp"
    balance = True

    def loss_scale(self, real):
        # FSDP averages gradients over ranks; strop's losses are globally normalised, so scale by the
        # world size to make that average the sum. A balancing repeat weighs 0.
        return float(self.world) if real else 0.0

    def after_backward(self, params):
        self._sum_partial(params)  # the rest was reduce-scattered by FSDP's hooks already
        for p in params:  # experts: averaged over their edp ranks, the world's loss scale: ep times the sum
            if self._expert(p) and p.grad is not None:
                _local(p.grad).div_(self.dims.ep)

    def full_weights(self, model):
        return full_weights(model)


def make_strategy(dims: ParallelDims, mesh=None, device="cpu") -> SingleProcess:
    """The strategy for this process from the run's ``dims`` and the ``mesh`` they built: one process when
    there is no mesh (no process group) or one rank."""
    if mesh is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return SingleProcess(device)
    return (FullyShard if dims.dp_mode == "fsdp" else Replicate)(dims, mesh, device)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself: collectives on it change the DTensor), else ``t``."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def clip_sharded(params: list[nn.Parameter], max_norm: float) -> float:
    """``clip_grad_norm_`` for gradients spread over ranks as DTensors (sharded on some mesh dimensions,
    replicated on others) beside plain tensors that every rank holds whole and equal. Each rank adds the
    squared norms of what it holds, each divided by how many ranks hold that same piece, and one all-reduce
    over all ranks sums them; the gradients are then scaled as torch's clip does."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    world = dist.get_world_size()
    total = torch.zeros((), dtype=torch.float64, device=params[0].device if params else "cpu")
    grads = [p.grad for p in params if p.grad is not None]
    for g in grads:
        local = _local(g).detach()
        copies = world
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            if any(isinstance(pl, Partial) for pl in g.placements):
                raise ValueError("clip_sharded: a gradient with a Partial placement has not been reduced")
            copies = (
                world
                // mesh.size()
                * math.prod(mesh.size(d) for d, pl in enumerate(g.placements) if isinstance(pl, Replicate))
            )
        # each tensor's norm in its own dtype, as torch's clip (a float64 copy of a vocabulary-sized gradient
        # was the largest transient of a tensor-parallel step), squared and summed in float64
        total += torch.linalg.vector_norm(local).to(total).square() / copies
    dist.all_reduce(total)
    norm = float(total.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            _local(g).mul_(coef)
    return norm
