"""Expert parallel (``parallel.expert_parallel_size``): a routed-experts layer's experts split over the ranks
of an expert-parallel group, each token sent to the rank that holds each expert it was routed to and its result
sent back (torch-native all-to-all, as torchtitan dispatches; gloo on a CPU).

The data-parallel ranks form an (expert data parallel, expert parallel) mesh: ranks ``r`` with the same
``r // ep`` hold the experts apart, ranks with the same ``r % ep`` hold the same experts. Each experts tensor
(Qwen3-MoE's ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I)) becomes a DTensor sharded by expert over
``ep`` and replicated over ``edp``, so the parts of strop that handle split weights (gradient clipping, whole
weights for the engine and the checkpoint, loading into shards, the optimizer) handle them as they handle tensor
parallel's. The router, attention and every other weight stay whole on every rank.

A layer's forward on a rank's tokens:

1. its (token, k) pairs sorted by expert, so that each rank's share is one contiguous run;
2. the pairs' hidden states sent to their experts' ranks (all-to-all with autograd: the backward sends the
   gradients back the same way), with the expert each is for;
3. each local expert computes its rows (two matmuls, as the model's own loop does);
4. the results sent back (all-to-all), weighted by the router's weights and summed per token.

The gradient of a local expert thus sums every rank's tokens that chose it, and only its ``edp`` copies are
summed again (strop.parallel.strategy; under FSDP2, :func:`shard_experts` shards them over ``edp``). Losses are normalised over the whole step, so the sum is the one-process
gradient.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules of ``model``'s routed-experts layers (Qwen3-MoE's layout: 3-D ``gate_up_proj`` and
    ``down_proj`` with an ``act_fn``, beside a router)."""
    return [
        m
        for m in model.modules()
        if all(isinstance(getattr(m, t, None), torch.Tensor) for t in EXPERT_TENSORS) and hasattr(m, "act_fn")
    ]


def check_experts(config, ep: int) -> None:
    """Refuse a model (its transformers config) whose experts ``ep`` ranks cannot split evenly."""
    if ep == 1:
        return
    n = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    if not n:
        raise ValueError(
            f"parallel.expert_parallel_size={ep}: the model ({getattr(config, 'model_type', '?')}) has no routed "
            "experts to split"
        )
    if n % ep:
        raise ValueError(f"parallel.expert_parallel_size={ep} must divide the model's {n} experts")


def expert_parallel(model: nn.Module, mesh, fsdp: bool = False) -> nn.Module:
    """Split ``model``'s experts over ``mesh`` (dimensions ``edp``, ``ep``) in place; returns it. ``fsdp``: the
    experts are DTensors of the ``ep`` dimension alone, for FSDP2 to shard over ``edp`` (:func:`shard_experts`)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    ep = mesh["ep"]
    found = expert_modules(model)
    if not found:
        raise ValueError("parallel.expert_parallel_size > 1: the model has no routed-experts layers to split")
    for m in found:
        for name in EXPERT_TENSORS:
            p = getattr(m, name)
            if p.shape[0] % ep.size():
                raise ValueError(f"parallel.expert_parallel_size={ep.size()} must divide {p.shape[0]} experts")
            on, placements = (mesh["ep"], [Shard(0)]) if fsdp else (mesh, [Replicate(), Shard(0)])
            sharded = distribute_tensor(p.detach(), on, placements, src_data_rank=None)
            setattr(m, name, nn.Parameter(sharded, requires_grad=p.requires_grad))
        m.ep_group, m.ep_size = ep.get_group(), ep.size()
        m.forward = types.MethodType(dispatched_forward, m)
    return model


def dispatched_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """An experts module's forward with its experts split over ``self.ep_group`` (see the module)."""
    from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

    group, n = self.ep_group, self.ep_size
    w1, w2 = self.gate_up_proj.to_local(), self.down_proj.to_local()
    local = w1.shape[0]
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, k) pairs by expert: each rank's share one run
    experts, token = flat[order], order // k
    send = torch.bincount(experts // local, minlength=n)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send, recv = send.tolist(), recv.tolist()
    x = all_to_all_single_autograd(hidden_states[token], recv, send, group)
    which = all_to_all_single(experts % local, recv, send, group)
    out = torch.zeros_like(x)
    for j in which.unique().tolist():  # each local expert once, on all of its rows
        rows = (which == j).nonzero().flatten()
        gate, up = F.linear(x[rows], w1[j]).chunk(2, dim=-1)
        out = out.index_copy(0, rows, F.linear(self.act_fn(gate) * up, w2[j]))
    back = all_to_all_single_autograd(out, send, recv, group)
    weighted = back * top_k_weights.reshape(-1)[order, None]
    return torch.zeros_like(hidden_states).index_add(0, token, weighted.to(hidden_states.dtype))


def shard_experts(model: nn.Module, mesh, mp_policy) -> None:
    """FSDP2 beside expert parallel: each experts module sharded over the ``edp`` ranks that hold the same experts
    (torchtitan's ``dp_shard_mod_ep``), before the layers around it are sharded over all ranks (which then leave
    its parameters alone). Its reduce-scatter averages over ``edp`` where the rest averages over all ranks, so
    the strategy divides the experts' gradients by ``ep`` again (FullyShard.after_backward; gloo has no
    pre-scaled sum for FSDP's own divide factor)."""
    from torch.distributed.fsdp import fully_shard

    for m in expert_modules(model):
        fully_shard(m, mesh=mesh["edp"], mp_policy=mp_policy)
