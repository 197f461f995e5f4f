"""The ``tools`` section: the tools of multi-turn rollouts and the python tool's sandbox (strop/tools/).
Torch-free: ``strop train --help`` reads it."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, model_validator

from strop.configbase import Section


class ToolsConfig(Section):
    enabled: list[Literal["python", "calculator"]] = Field(
        default_factory=list,
        description="built-in tools the model may call; any tool makes generation multi-turn (strop.rollout.multiturn)",
    )
    max_turns: int = Field(4, ge=1, description="model turns per sample, the final answer included")
    max_turn_tokens: int = Field(
        256, gt=0, description="new tokens per turn (capped by what is left of rollout.max_new_tokens)"
    )
    output_chars: int = Field(2000, gt=0, description="tool output kept, in characters (a marker says what was cut)")
    output_tokens: int = Field(256, gt=0, description="tool output kept, in tokens (a marker says so)")
    sandbox: Literal["auto", "bwrap", "namespaces", "none"] = Field(
        "auto",
        description="isolation of the python tool: 'auto' (bubblewrap, else unshare namespaces, else "
        "refuse), one by name, or 'none' to run model code WITHOUT isolation (explicit opt-out)",
    )
    timeout_s: float = Field(
        10.0,
        gt=0,
        description="wall-clock limit per tool call (the python tool's sandbox "
        "kills the code; any other tool's result is no longer awaited and the model reads a "
        "timeout error)",
    )
    cpu_s: int = Field(10, gt=0, description="python tool: CPU seconds per call")
    memory_mb: int = Field(1024, gt=0, description="python tool: address space per process, MB")
    memory_total_mb: int = Field(
        512,
        gt=0,
        description="python tool: memory of all of a call's processes "
        "together, MB (a cgroup where strop may make one, else a watchdog); past it the "
        "call is stopped",
    )
    tmp_mb: int = Field(64, gt=0, description="python tool: bytes a call may write to its /tmp (a tmpfs), MB")
    tmp_files: int = Field(4096, gt=0, description="python tool: files and directories a call may make in its /tmp")
    processes: int = Field(64, gt=0, description="python tool: processes per call")
    concurrency: int = Field(
        8,
        gt=0,
        description="python tool: calls running at once; concurrency x "
        "(memory_total_mb + tmp_mb) must fit in half of the host's memory",
    )
    nested_userns: bool = Field(
        False, description="python tool: let sandboxed code create user namespaces (bubblewrap; off by default)"
    )
    describe: bool = Field(
        True,
        description="append the tools' JSON schemas and the <tool_call> format to the "
        "system prompt (turn off when your own system prompt describes the tools)",
    )
    tool_threads: int = Field(
        8,
        gt=0,
        description="worker threads for tools written as plain (sync) functions; "
        "their own pool, so slow tools never queue the engine's work",
    )
    call_reward: float = Field(
        0.0,
        description="tool reward shaping: added per successful tool call "
        "(negative to penalise calls), at most max_call_reward in all",
    )
    max_call_reward: float = Field(0.0, description="cap on the absolute total of call_reward per sample")

    @model_validator(mode="after")
    def _sandbox_totals_fit(self):
        """The python tool's calls together must not be able to exhaust the host's memory (the
        OOM killer may pick the trainer); tmpfs bytes are memory too."""
        if "python" in self.enabled:
            host_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20
            worst = self.concurrency * (self.memory_total_mb + self.tmp_mb)
            if worst > host_mb // 2:
                raise ValueError(
                    f"tools.concurrency ({self.concurrency}) x (tools.memory_total_mb "
                    f"({self.memory_total_mb}) + tools.tmp_mb ({self.tmp_mb})) = {worst} MB is more than "
                    f"half of this host's memory ({host_mb} MB): lower one of them"
                )
        return self
