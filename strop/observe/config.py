"""The ``run`` section: where the run writes its outputs (metrics, trackers, samples, checkpoints, the final
policy) and on which device it runs. Torch-free: ``strop train --help`` reads it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from strop.configbase import Section


class RunConfig(Section):
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="where policy, reference, critic, optimizer state, batches and the embedded engine "
        "live: 'auto' = cuda when available, else cpu; each process binds cuda:<local rank>",
    )
    dir: str | None = Field(None, description="run directory (default: runs/<timestamp>)")
    save_final: bool = Field(True, description="save the final policy in Hugging Face format")
    plot: bool = Field(True, description="write a PNG plot of reward and eval accuracy")
    progress: bool = Field(True, description="show a progress bar")
    threads: int | None = Field(None, description="torch CPU threads (default: torch's choice)")
    save_every: int = Field(
        10,
        ge=0,
        description="save a checkpoint every this many steps and at the end, into "
        "<run dir>/checkpoints (0 = never; `strop train --resume RUN_DIR` continues from the newest)",
    )
    keep_checkpoints: int = Field(
        1,
        ge=1,
        description="keep this many newest checkpoints, remove older ones (an "
        "older one is removed only once the new one is complete)",
    )
    checkpoint_policy: bool = Field(
        True,
        description="also write the policy in Hugging Face format into each "
        "checkpoint (policy/, which from_pretrained loads); false stores the weights once, "
        "in the trainer state, and `strop export CHECKPOINT OUT` writes that folder later",
    )
    log_samples: int = Field(
        4,
        ge=0,
        description="per step, write this many prompts with one response each to "
        "<run dir>/samples.jsonl (and the trackers)",
    )
    trackers: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list,
        description="also send every metric to these (optional extras: pip install -e "
        "'.[tensorboard]' / '.[wandb]' from a checkout); TensorBoard writes <run dir>/tensorboard",
    )
    wandb_project: str = Field("strop", description="Weights & Biases project")
    wandb_mode: Literal["online", "offline"] = Field(
        "offline",
        description="Weights & Biases mode: 'offline' writes <run dir>/wandb (upload later with "
        "`wandb sync`), 'online' streams to the server",
    )
