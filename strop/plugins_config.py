"""The plugins section: hooks by import path, beside strop/plugins.py, which loads and checks them (a module,
not a package a config.py could sit in)."""

from __future__ import annotations

from pydantic import Field

from strop.configbase import Section


class PluginsConfig(Section):
    rollout: str | None = Field(None, description="rollout hook 'pkg.module:fn' (a whole step's rollout; async)")
    generate: str | None = Field(None, description="generate hook (one sample, possibly multi-turn; async)")
    filter: str | None = Field(None, description="dynamic sampling filter: keep or drop a scored group")
    postprocess: str | None = Field(None, description="rollout-data postprocess, just before training")
    advantage: str | None = Field(None, description="advantage estimator hook (replaces algo.estimator)")
    policy_loss: str | None = Field(None, description="policy loss hook (replaces algo.policy_loss)")
    data_source: str | None = Field(None, description="data source hook (replaces data.source)")
    tools: str | None = Field(
        None, description="tools hook: your own tools for multi-turn rollouts, next to tools.enabled (docs/tools.md)"
    )
    agent: str | None = Field(
        None,
        description="agent hook 'pkg.module:run': your agent program, called per sample "
        "with the proxy's base_url, a session api_key and the prompt row; it talks to the run's "
        "engines through the OpenAI-compatible agent proxy (docs/agents.md)",
    )
