"""The ``agent`` section: agent programs behind the OpenAI-compatible proxy (strop/agents/; plugins.agent).
Torch-free: ``strop train --help`` reads it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from strop.configbase import Section


class AgentConfig(Section):
    workers: Literal["threads", "processes"] = Field(
        "threads",
        description="where agent programs run: worker threads of this process, or worker processes "
        "(spawned; the hook is imported there by its path)",
    )
    concurrency: int = Field(
        64,
        gt=0,
        description="agent programs running at once (each holds one session); "
        "below the samples generated at once, it also bounds the engine's batch",
    )
    max_calls: int = Field(
        8,
        gt=0,
        description="model calls per session; a call past it gets a 400 and the session's samples train as truncated",
    )
    max_call_tokens: int = Field(256, gt=0, description="new tokens per call (the agent's max_tokens, if lower)")
    max_calls_in_flight: int = Field(
        256,
        gt=0,
        description="calls generating at once over all sessions; past it "
        "a call gets 429 with Retry-After (the openai SDK retries by itself; an agent "
        "that gives up on it is aborted, not failed); at least agent.concurrency",
    )
    retry_after_s: float = Field(1.0, gt=0, description="the Retry-After a 429 carries")
    idle_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a session with no call for this long is closed "
        "(its samples are not trained; counted in agent_sessions_idle_closed)",
    )
    timeout_s: float = Field(600.0, gt=0, description="most seconds one agent program may run")
    reward: Literal["session", "hook"] = Field(
        "session",
        description="'session': the reward the agent posts (POST /v1/sessions/{id}/reward) or returns; "
        "a session without one is not trained (status no_reward); 'hook': rollout.reward scores the final "
        "assistant message",
    )
    cut_after_tool_calls: bool = Field(
        True,
        description="a turn that calls a tool ends where its calls end: "
        "the model's text after them is dropped (never trained, never shown to "
        "the agent), as in strop's multi-turn rollout; false returns the whole turn",
    )
    describe_tools: bool = Field(
        True,
        description="the prompt describes the request's tools (their schemas and "
        "the <tool_call> format in the system prompt, or the chat template's own "
        "rendering); turn off when the agent's system prompt describes them, as "
        "tools.describe does for strop's own tools",
    )
    port: int = Field(0, ge=0, lt=65536, description="the proxy's port on 127.0.0.1 (0: any free one)")

    @model_validator(mode="after")
    def _room_for_every_agent(self):
        if self.max_calls_in_flight < self.concurrency:
            raise ValueError(
                f"agent.max_calls_in_flight={self.max_calls_in_flight} is below agent.concurrency="
                f"{self.concurrency}: agents running at once would be told to retry (429) on their "
                "first calls; raise max_calls_in_flight or lower concurrency"
            )
        return self
