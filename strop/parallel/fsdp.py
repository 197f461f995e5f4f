"""FSDP2 data parallel: parameters, gradients and optimizer state sharded across ranks.

``fully_shard`` goes on every decoder layer and on a root module that owns
everything else the step uses (embedding, final norm, the tied lm_head read by
the chunked logprob kernel), so every parameter is gathered by a forward hook
and its gradient reduce-scattered by a backward hook. strop's losses are
already normalised over the whole batch, so gradients are summed across
ranks, not averaged: FSDP's reduce-scatter averages (gloo has no pre-scaled sum),
so the trainer multiplies each rank's loss by the world size, which is exact for
power-of-two world sizes and within one rounding otherwise.
"""

from __future__ import annotations

import torch
from torch import nn

from strop.train.logprob import response_logprobs


class LogprobModule(nn.Module):
    """A causal LM whose forward returns response logprobs (and entropy): one module for FSDP's hooks."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask, positions, position_ids=None, *, temperature=1.0,
                with_entropy=False, entropy_grad=False, chunk_size=1024, cp=None):
        lp, ent = response_logprobs(self.lm, input_ids, attention_mask, positions, temperature=temperature,
                                    with_entropy=with_entropy, entropy_grad=entropy_grad, chunk_size=chunk_size,
                                    position_ids=position_ids, cp=cp)
        # FSDP hooks the outputs for backward; fresh tensors, not views, keep those hooks intact
        return lp.clone(), (ent.clone() if ent is not None else None)


def shard(module: LogprobModule, group=None, mixed_precision: bool = False) -> LogprobModule:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    import torch.distributed as dist

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    mesh = DeviceMesh.from_group(group or dist.group.WORLD, device_type=device) if group is not None else \
        DeviceMesh(device, ranks, mesh_dim_names=("dp",))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision \
        else MixedPrecisionPolicy()
    backbone = module.lm.get_decoder() if hasattr(module.lm, "get_decoder") else module.lm.model
    for layer in backbone.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    return module


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gather the whole model on rank 0 (on CPU); a collective every rank must call. Other ranks get {}."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
