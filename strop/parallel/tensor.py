"""Tensor parallel on DTensor (Megatron's layout, torch-native as in torchtitan).

In every decoder layer the projections that fan out are split by output (column-wise: q, k, v, gate,
up) and the ones that fan back in by input (row-wise: o, down), so each rank holds 1/N of the heads,
of the KV heads and of the MLP, and a layer costs two all-reduces forward (after o and down) and two
backward (before q/k/v and gate/up). The embedding is split by vocabulary rows (one all-reduce), and
the output projection too: its weight is never multiplied whole here, the logprobs are computed on
each rank's vocabulary slice and reduced (:func:`strop.train.chunked_logprob.chunked_logprobs` with a
group), so no rank holds a (tokens, vocabulary) tensor. Without sequence parallel, norms and the
residual stream stay whole on every rank, so their gradients agree across ranks without a reduction;
with it (the default), each rank holds 1/N of the tokens between the blocks (:func:`_sequence_parallel`).
The per-head q/k norms of Qwen3 see only this rank's heads either way: their gradients are summed over
the group (:data:`PARTIAL_GRADIENTS`).

Supported: the Llama family's layout (Llama, Mistral, Qwen2, Qwen3; attention through
``self_attn.{q,k,v,o}_proj``, MLP through ``mlp.{gate,up,down}_proj``). Anything else is refused
before the model loads, as are head counts that do not divide (:class:`strop.parallel.dims.ParallelDims`).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from strop.parallel.fsdp import decoder_layers

COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")
PARTIAL_GRADIENTS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")  # per-head: each rank sees its heads
SEQUENCE_NORMS = ("input_layernorm", "post_attention_layernorm")  # on this rank's tokens under sequence parallel


def tensor_parallel(module: nn.Module, mesh, sequence_parallel: bool = False) -> nn.Module:
    """Split ``module`` (a causal LM, or a wrapper holding one: LogprobModule, ValueModel) over the 1-D device
    mesh ``mesh`` in place; returns it. Its parameters become DTensors sharded over ``mesh`` except norms
    and heads outside the decoder (plain tensors, whole on every rank; with ``sequence_parallel``, norms are
    replicated DTensors that see this rank's tokens: :func:`_sequence_parallel`)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    layers = decoder_layers(module)
    backbone = _backbone(module, layers) if sequence_parallel else None  # (refused before the mesh is used)
    out = Shard(1) if sequence_parallel else Replicate()  # o/down: reduce-scattered over tokens, or all-reduced
    for layer in layers:
        have = dict(layer.named_modules())
        missing = [name for name in (*COLUMN, *ROW, *(SEQUENCE_NORMS if sequence_parallel else ())) if name not in have]
        if missing:
            raise ValueError(f"tensor parallel: {type(layer).__name__} has no {', '.join(missing)}")
        parallelize_module(
            layer,
            mesh,
            {**{n: ColwiseParallel() for n in COLUMN}, **{n: RowwiseParallel(output_layouts=out) for n in ROW}},
        )
    if sequence_parallel:
        _sequence_parallel(layers, backbone, mesh)
    embed = next(m for name, m in module.named_modules() if name.split(".")[-1] == "embed_tokens")
    head = next((m for name, m in module.named_modules() if name.split(".")[-1] == "lm_head"), None)
    tied = head is not None and head.weight is embed.weight
    # vocabulary rows split; each rank looks up the ids in its rows, the rows are summed over the group
    # (DTensor's own row-wise embedding built a whole-vocabulary gradient in backward: 0.58 GiB for Qwen3-0.6B)
    embed.weight = nn.Parameter(
        distribute_tensor(embed.weight, mesh, [Shard(0)]), requires_grad=embed.weight.requires_grad
    )
    embed.forward = types.MethodType(_vocab_parallel_embedding, embed)
    if tied:
        head.weight = embed.weight  # the same DTensor, split by vocabulary rows
    elif head is not None:
        if head.bias is not None:
            raise ValueError("tensor parallel: an output projection with a bias is not supported")
        parallelize_module(head, mesh, ColwiseParallel())  # (V, H) weight split by vocabulary rows, as the embedding
    return module


def _sequence_parallel(layers: nn.ModuleList, backbone: nn.Module, mesh) -> None:
    """Megatron's sequence parallel on DTensor (torchtitan's plan): between the blocks each rank holds only its
    1/N of the tokens of the residual stream, and the norms run on those. The embedding's output (whole on every
    rank: the masks and rotary tables are built from it) is cut into this rank's tokens before the first layer;
    before attention and the MLP the tokens are all-gathered, and after o and down the partial sums are reduce-
    scattered over tokens (in place of the all-reduce); the final norm's output is all-gathered for the
    vocabulary-parallel logprobs. The norm weights are replicated DTensors: their gradients, summed over this
    rank's tokens, are reduced over the group by DTensor. The token count must divide by N: the logprob path
    pads each micro-batch's columns (:func:`strop.train.logprob.response_hidden`, ``sequence_parallel_size``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleOutput,
        SequenceParallel,
        parallelize_module,
    )

    tokens, whole = (Shard(1),), (Replicate(),)
    for layer in layers:
        parallelize_module(
            layer,
            mesh,
            {
                **{n: SequenceParallel() for n in SEQUENCE_NORMS},
                "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": tokens[0]},
                    desired_input_kwarg_layouts={"hidden_states": whole[0]},
                ),
                "mlp": PrepareModuleInput(input_layouts=tokens, desired_input_layouts=whole),
            },
        )
    parallelize_module(
        layers[0], mesh, PrepareModuleInput(input_layouts=whole, desired_input_layouts=tokens, use_local_output=True)
    )
    parallelize_module(backbone.norm, mesh, SequenceParallel())
    parallelize_module(
        backbone.norm,
        mesh,
        PrepareModuleOutput(output_layouts=tokens, desired_output_layouts=whole, use_local_output=True),
    )
    backbone.sequence_parallel_size = mesh.size()


def _backbone(module: nn.Module, layers: nn.ModuleList) -> nn.Module:
    """The module that holds the decoder layers, checked to hold the final norm (``norm``) beside them."""
    backbone = next(m for m in module.modules() if any(c is layers for c in m.children()))
    if not isinstance(getattr(backbone, "norm", None), nn.Module):
        raise ValueError(f"sequence parallel: {type(backbone).__name__} has no final norm named 'norm'")
    return backbone


def partial_gradient_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters whose gradient each rank holds only a part of (summed over the group after backward)."""
    return [p for name, p in module.named_parameters() if name.endswith(PARTIAL_GRADIENTS)]


def vocab_slice(weight):
    """(this rank's rows of a vocabulary-split output projection as a plain tensor, differentiable; the
    index of its first row; the group that holds the others), or None when ``weight`` is not split."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(weight, DTensor):
        return None
    if weight.device_mesh.ndim != 1 or weight.placements != (Shard(0),):
        raise ValueError(
            f"the output projection is laid out as {weight.placements} over a {weight.device_mesh.ndim}-D "
            "mesh; strop computes logprobs on a vocabulary split (Shard(0)) over one mesh dimension"
        )
    _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    return weight.to_local(), int(offset[0]), weight.device_mesh.get_group()


def _vocab_parallel_embedding(self, ids: torch.Tensor) -> torch.Tensor:
    """``nn.Embedding.forward`` over this rank's vocabulary rows: ids outside them give 0, and the rows are
    summed over the group, so every rank gets the whole embedding; backward gives this rank's rows their
    gradient (the incoming gradient is the same on every rank)."""
    weight, start, group = vocab_slice(self.weight)
    local = ids - start
    outside = (local < 0) | (local >= weight.shape[0])
    pad = self.padding_idx  # (a global id: its row gets no gradient on the rank that holds it)
    pad = pad - start if pad is not None and 0 <= pad - start < weight.shape[0] else None
    rows = F.embedding(local.masked_fill(outside, 0), weight, pad)
    return _SumOverGroup.apply(rows.masked_fill(outside.unsqueeze(-1), 0.0), group)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce forward; the gradient passes through unchanged (each rank's input owes it all of it)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None
