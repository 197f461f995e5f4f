"""The ``env`` section: environments someone else wrote, trained through the agent proxy (strop/envs/;
docs/environments.md). Torch-free: ``strop train --help`` reads it."""

from __future__ import annotations

import json

from pydantic import Field, field_validator, model_validator

from strop.configbase import Section

# the agent hook each kind of environment runs per sample (its plugins.agent)
AGENT_HOOKS = {
    "verifiers": "strop.envs.verifiers_env:run_episode",
    "openenv": "strop.envs.openenv_env:run_episode",
}


def _spec_kwargs(spec: str, field: str) -> tuple[str, dict]:
    """'MODULE' or 'MODULE:{json kwargs}' -> (MODULE, kwargs); a bad kwargs text is refused naming the field."""
    name, sep, rest = spec.partition(":")
    if not sep or not rest.lstrip().startswith("{"):
        return spec, {}
    try:
        kwargs = json.loads(rest)
    except json.JSONDecodeError as exc:
        raise ValueError(f"env.{field}={spec!r}: the kwargs after ':' are not JSON ({exc})") from exc
    if not isinstance(kwargs, dict):
        raise ValueError(f"env.{field}={spec!r}: the kwargs after ':' must be a JSON object")
    return name, kwargs


class EnvConfig(Section):
    verifiers: str | None = Field(
        None,
        description="a verifiers environment, 'ID_OR_MODULE' or 'ID_OR_MODULE:{json taskset kwargs}' (pip install "
        "'strop[verifiers]'): its tasks are the prompts, its rubric the reward, each sample one episode through "
        "the agent proxy (docs/environments.md)",
    )
    verifiers_eval: dict | None = Field(
        None,
        description='taskset kwargs of the held-out split, over env.verifiers\'s (e.g. {"split": "eval"}); '
        "unset: the last data.eval_size tasks are held out and never trained on",
    )
    openenv: str | None = Field(
        None,
        description="an OpenEnv environment: 'pkg.module:EnvClass' (run in this process) or "
        "'http://127.0.0.1:PORT' (a local OpenEnv server); reset() gives the prompt, each model turn is "
        "one step() (docs/environments.md)",
    )
    max_turns: int = Field(8, gt=0, description="openenv: step() calls per episode (the episode ends at done)")

    @field_validator("verifiers")
    @classmethod
    def _kwargs_are_json(cls, v):
        if v is not None:
            _spec_kwargs(v, "verifiers")
        return v

    @model_validator(mode="after")
    def _one_environment(self):
        if self.verifiers and self.openenv:
            raise ValueError(
                f"env.verifiers={self.verifiers!r} and env.openenv={self.openenv!r}: a run trains on one "
                "environment, set one of them"
            )
        if self.verifiers_eval is not None and not self.verifiers:
            raise ValueError("env.verifiers_eval is set without env.verifiers: it would be ignored")
        return self

    @property
    def kind(self) -> str | None:
        return "verifiers" if self.verifiers else "openenv" if self.openenv else None

    def spec(self) -> tuple[str, dict]:
        """env.verifiers as (module or id, taskset kwargs)."""
        return _spec_kwargs(self.verifiers or "", "verifiers")
