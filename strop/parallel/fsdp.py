"""FSDP2 helpers: shard a module per decoder layer and at its root; gather full weights.

``fully_shard`` goes on every decoder layer and on a root module that owns
everything else the step uses (embedding, final norm, the tied lm_head read by
the chunked logprob kernel), so every parameter is gathered by a forward hook
and its gradient reduce-scattered by a backward hook. strop's losses are
already normalised over the whole batch, so gradients are summed across
ranks, not averaged: FSDP's reduce-scatter averages (gloo has no pre-scaled sum),
so the strategy multiplies each rank's loss by the world size, which is exact for
power-of-two world sizes and within one rounding otherwise.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from strop.parallel.gather import canonical_names, whole_tensor


def decoder_layers(module: nn.Module) -> nn.ModuleList:
    """The repeated blocks of a transformer (the first ModuleList named ``layers``, as in every HF decoder)."""
    for name, child in module.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(child, nn.ModuleList):
            return child
    raise ValueError(f"{type(module).__name__}: no decoder layers (a ModuleList named 'layers') to shard")


def shard(
    module: nn.Module, group=None, *, device_type: str = "cpu", mixed_precision: bool = False, mesh=None
) -> nn.Module:
    """``fully_shard`` every decoder layer of ``module`` and ``module`` itself over ``group`` (default: all ranks),
    or over ``mesh``: the data-parallel dimension of a (dp, tp) mesh whose tp dimension already split the module."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = mesh if mesh is not None else DeviceMesh.from_group(group or dist.group.WORLD, device_type=device_type)
    policy = mixed_precision_policy(mixed_precision)
    for layer in decoder_layers(module):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    return module


def mixed_precision_policy(mixed_precision: bool):
    """FSDP2's policy: bf16 parameters in compute and fp32 gradient reduction, or none."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def full_weights(model: nn.Module, *, to_rank: int = 0) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of a sharded ``model`` gathered whole, on the device it lives on.

    A collective every rank must call (one all-gather per sharded tensor, in state-dict
    order). ``to_rank`` keeps the result, the others get ``{}``. Tensors are fresh
    all-gather outputs, never views of the shards the optimizer updates; tied parameters share theirs.
    """
    keep = dist.get_rank() == to_rank
    # a parameter under two names (tied embeddings) is gathered once and its names share the result, as
    # save_pretrained expects; every rank makes the same collectives
    canonical = canonical_names(model)
    out, gathered = {}, {}
    for name, t in model.state_dict().items():
        key = canonical.get(name, name)
        if key not in gathered:
            gathered[key] = whole_tensor(t)
        if keep:
            out[name] = gathered[key]
    return out


def local_parameter_bytes(*modules: nn.Module | None) -> int:
    """Bytes of parameters this rank holds (its shards under FSDP, everything otherwise)."""
    total = 0
    for m in modules:
        for p in m.parameters() if m is not None else ():
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.numel() * local.element_size()
    return total
