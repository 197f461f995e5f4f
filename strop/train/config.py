"""The ``model`` and ``train`` sections: the policy the trainer loads and how it is optimized
(strop/train/, strop/models.py). Torch-free: ``strop train --help`` reads it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from strop.configbase import Section
from strop.models import EMBEDDED_MODEL

# every linear of a Llama/Qwen/Mistral-style block: attention and MLP ("LoRA Without Regret": all layers)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ModelConfig(Section):
    path: str = Field(
        EMBEDDED_MODEL,
        description=f"the policy: {EMBEDDED_MODEL!r} (packaged SmolLM2-135M-Instruct), "
        "a local Hugging Face model folder, or a hub id ('org/name' or a bare 'name'; downloaded once into the "
        "Hugging Face cache, then loaded from there without network)",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="parameter dtype for engine and trainer (fp32 is faster on most CPUs)"
    )
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] | None = Field(
        None,
        description="transformers' attention implementation for the trainer's model and the embedded engine's: "
        "None = transformers' default (sdpa where the model supports it, else eager); flash_attention_2 needs "
        "the flash-attn package and a GPU",
    )
    trust_remote_code: bool = Field(
        False,
        description="let transformers run the Python code a model folder or hub repo ships (models not built "
        "into transformers); only for models you trust",
    )
    revision: str | None = Field(
        None,
        description="hub id only: the branch, tag or commit to load (None = main); ignored for a local folder "
        "(as transformers ignores it)",
    )

    lora_rank: int = Field(
        0,
        ge=0,
        description="LoRA: train low-rank adapters of this rank (peft) instead of every weight; 0 = off. The KL "
        "reference is the model with its adapters switched off (no copy); docs/lora.md",
    )
    lora_alpha: float = Field(32.0, gt=0, description="LoRA: the adapters' scale is lora_alpha / lora_rank")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="LoRA: dropout on the adapters' input")
    lora_target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        description="LoRA: the linear layers that get adapters, by name (default: every linear of attention and MLP)",
    )
    lora_init: Literal["default", "gaussian", "pissa", "olora"] = Field(
        "default",
        description="LoRA: how A starts ('default': Kaiming-uniform, 'gaussian': normal of std 1/rank; B starts at "
        "zero, so the policy starts as the base). 'pissa' and 'olora' start from the weights' own factors and "
        "move the base weights to keep the sum: refused, naming why (docs/lora.md)",
    )

    def load_options(self) -> dict:
        """The keyword arguments of strop.models' loaders (load_model, load_tokenizer, load_config, meta_model)."""
        return {
            "attn_implementation": self.attn_implementation,
            "trust_remote_code": self.trust_remote_code,
            "revision": self.revision,
        }


class TrainConfig(Section):
    steps: int = Field(15, gt=0, description="RL steps (rollout + one optimizer step each)")
    lr: float = Field(3e-5, gt=0, description="AdamW learning rate")
    warmup_steps: int = Field(
        2,
        ge=0,
        description="linear learning-rate warm-up, in optimizer steps: update k (from 0) uses "
        "lr x (k+1)/(warmup_steps+1) until update warmup_steps reaches the full rate",
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="the rate after warm-up: constant, or a linear / cosine decay to lr x min_lr_ratio that spans "
        "the run's optimizer steps (train.steps x train.mini_batches, warm-up included; as transformers' "
        "get_cosine_schedule_with_warmup). The schedule counts applied updates: a step skipped for a non-finite "
        "gradient, or with no learning signal, does not advance it. Resumed exactly from checkpoints",
    )
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="linear/cosine: the floor of the decay, as a fraction of lr (0 = decay to 0)"
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas")
    grad_clip: float = Field(1.0, gt=0, description="clip the global gradient norm to this")
    micro_batch_size: int = Field(16, gt=0, description="samples per forward/backward (gradient accumulation)")
    mini_batches: int = Field(1, gt=0, description="optimizer steps per rollout batch (PPO-style reuse)")
    max_tokens_per_micro_batch: int | None = Field(
        None,
        gt=0,
        description="pack samples into micro-batches of at most this many tokens, with no padding "
        "(replaces micro_batch_size)",
    )
    shared_prefix: bool | None = Field(
        None,
        description="forward each group's common prefix (its prompt; a multi-turn group's first turns too) once "
        "per micro-batch, the samples' own tokens after it in one row with a mask (strop.parallel.prefix): the "
        "same logprobs and gradients from fewer tokens; micro-batches then keep groups together. None (default): "
        "on wherever it holds, that is not with context parallel or flash_attention_2 (neither takes the row's "
        "mask); true: refused where it does not hold; false: off",
    )
    logprob_chunk_size: int = Field(
        1024, ge=0, description="tokens per lm_head chunk when computing logprobs (0 = full logits, more memory)"
    )
    seed: int = Field(0, description="torch seed")
    bf16_autocast: bool = Field(
        False,
        description="run the trainer's forward passes under bf16 autocast (fp32 master weights and "
        "optimizer state): on GPUs, and on CPUs with bf16 matmul (avx512_bf16, AMX; 2.2x the quickstart's train "
        "step here), slow on CPUs without it",
    )
    max_nonfinite_grad_steps: int = Field(
        3,
        gt=0,
        description="stop the run after this many optimizer steps in a row with a NaN/inf gradient "
        "norm (each such step is skipped and counted in nonfinite_grad_norm_steps)",
    )
    activation_checkpointing: bool = Field(
        False,
        description="recompute each decoder layer's activations in backward instead of keeping them "
        "(transformers' gradient checkpointing, non-reentrant): activation memory drops to the layers' inputs "
        "plus one layer's, for about one more forward pass per step; policy and critic; not with context parallel",
    )
