"""The ``data`` section: where prompts come from (strop/data/). Torch-free: ``strop train --help`` reads it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from strop.configbase import Section


class DataConfig(Section):
    source: Literal["reasoning_gym", "file"] = Field(
        "reasoning_gym", description="where prompts come from: a reasoning-gym task or a JSONL/Parquet file"
    )
    task: str = Field("basic_arithmetic", description="reasoning-gym task name (source=reasoning_gym)")
    samples: str | None = Field(
        None,
        description="train only: scored samples written by `strop rollout` "
        "(no engine, no prompts, no evaluation; step k trains on the file's step k)",
    )
    task_options: dict[str, Any] = Field(
        default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        description="options passed to the reasoning-gym task config, as JSON",
    )
    seed: int = Field(1, description="seed of the training prompts (reasoning-gym)")
    size: int = Field(2000, gt=0, description="number of training prompts to generate (reasoning-gym)")
    eval_seed: int = Field(
        1_000_003, description="seed of the held-out prompts; must differ from data.seed (reasoning-gym)"
    )
    eval_size: int = Field(
        128,
        ge=0,
        description="number of held-out evaluation prompts (0 = no eval); prompts "
        "that occur in the training data are removed first",
    )
    eval_min_size: int = Field(
        32,
        ge=1,
        description="refuse to run when fewer held-out prompts than this remain after removing those "
        "that occur in the training data",
    )
    eval_oversample: int = Field(
        4,
        ge=1,
        description="reasoning-gym: generate eval_size x this many eval candidates, so eval_size remain "
        "after duplicates of training prompts are removed",
    )
    path: str | None = Field(
        None, description="training prompts, .jsonl or .parquet (source=file; given alone, it sets source=file)"
    )
    eval_path: str | None = Field(
        None, description="held-out prompts, .jsonl or .parquet (source=file; given alone, it sets source=file)"
    )
    prompt_key: str = Field("prompt", description="column holding the prompt (text or chat messages)")
    label_key: str = Field("label", description="column holding the reference answer")
    metadata_keys: list[str] = Field(default_factory=list, description="columns copied into Sample.metadata")
    prompt_template: str = Field(
        "{prompt}", description="text prompts are formatted through this; {prompt} is the question"
    )
    system_prompt: str | None = Field(None, description="system message put before text prompts")
    apply_chat_template: bool = Field(True, description="apply the tokenizer's chat template")
    shuffle: bool = Field(True, description="shuffle training prompts every epoch")

    @model_validator(mode="after")
    def _check_source(self):
        paths = [f"data.{k}={getattr(self, k)!r}" for k in ("path", "eval_path") if getattr(self, k)]
        if paths and "source" not in self.model_fields_set:  # a prompt file given alone: source=file
            self.__dict__["source"] = "file"  # (not an assignment: that would validate again)
        elif paths and self.source == "reasoning_gym":  # set on purpose, with a file it would ignore
            raise ValueError(
                f"{' and '.join(paths)} with data.source='reasoning_gym': prompts come from the reasoning-gym "
                f"task {self.task!r} and the file would be ignored; set data.source=file to train on the file, "
                "or drop the path"
            )
        if self.source == "file" and not self.path:
            given = f" (data.eval_path={self.eval_path!r} reads prompts from a file)" if self.eval_path else ""
            raise ValueError(
                f"data.source='file' needs data.path, the training prompts (a .jsonl or .parquet file){given}"
            )
        if self.source == "reasoning_gym" and self.eval_size and self.eval_seed == self.seed:
            raise ValueError("data.eval_seed must differ from data.seed so the eval set is held out")
        if "{prompt}" not in self.prompt_template:
            raise ValueError("data.prompt_template must contain '{prompt}'")
        return self
