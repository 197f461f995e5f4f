"""The ``parallel`` section: multi-process training (strop/parallel/; ``strop train --nproc N``). The layout
rules that need the world size or the model live with the parallel layout, not here. Torch-free:
``strop train --help`` reads it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from strop.configbase import Section


class ParallelConfig(Section):
    dp_mode: Literal["replicate", "fsdp"] = Field(
        "replicate",
        description="data parallel: every rank holds the whole model (replicate; best for small "
        "models) or FSDP2 shards parameters, gradients and optimizer state",
    )
    fsdp_mixed_precision: bool = Field(False, description="fsdp: bf16 parameters in compute, fp32 gradient reduction")
    context_parallel_size: int = Field(
        1,
        ge=1,
        description="context parallel: ranks that split every sequence's tokens (zigzag chunks, keys and "
        "values all-gathered); the processes form a (data parallel x context parallel) mesh, so --nproc must be a "
        "multiple of it",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="tensor parallel: ranks that split every decoder layer (q/k/v/gate/up by output, "
        "o/down by input, embedding and output projection by vocabulary; DTensor) for Llama, Mistral, Qwen2 and "
        "Qwen3; the processes form a (data parallel x tensor parallel) mesh with neighbouring ranks in one tensor-"
        "parallel group, so --nproc must be a multiple of it; it must divide the heads, KV heads and MLP width",
    )
    expert_parallel_size: int = Field(
        1,
        ge=1,
        description="expert parallel: data-parallel ranks that split each routed-experts layer's experts "
        "(Qwen3-MoE), tokens sent to their experts' ranks and back by all-to-all; it must divide the data-parallel "
        "ranks and the experts; with replicate or FSDP2, not with tensor or context parallel (strop.parallel.expert)",
    )
    sequence_parallel: bool = Field(
        True,
        description="with tensor_parallel_size > 1: the residual stream and the norms split over the tensor-"
        "parallel ranks by tokens between the blocks (Megatron's sequence parallel: tokens all-gathered before "
        "attention and the MLP, reduce-scattered after them), so each rank holds 1/N of those activations; off: "
        "every rank holds them whole (one all-reduce after o and down instead)",
    )
    controller_timeout_s: float = Field(
        6 * 3600,
        gt=0,
        description="how long ranks other than 0 wait for rank 0 (rollout, evaluation, set-up) "
        "before giving up; their own collectives keep torch's default timeout",
    )
    grad_reduce_bucket_bytes: int = Field(
        1 << 30,
        description="largest flat buffer of the chunked gradient all-reduce, in bytes (>= 1 MiB; "
        "the environment variable STROP_GRAD_REDUCE_BUCKET_BYTES overrides it)",
    )
