"""What ``env.verifiers`` / ``env.openenv`` put in place of the hooks: the data source of the environment's
tasks (its agent hook is plugins.agent, set by the config: strop.envs.config.AGENT_HOOKS)."""

from __future__ import annotations

from typing import Callable


def environment_hooks(cfg) -> dict[str, Callable]:
    """The hooks the run's environment puts in place ({} without one): its data source."""
    rows = environment_rows(cfg)
    return {"data_source": rows} if rows is not None else {}


def environment_rows(cfg) -> Callable | None:
    """The data source hook (``def data_source(config, split)``) of the run's environment, or None."""
    env = cfg.env
    if env.kind == "verifiers":
        spec, kwargs = env.spec()

        def data_source(config, split: str) -> list[dict]:
            from strop.envs.verifiers_env import task_rows

            return task_rows(spec, kwargs, split, env.verifiers_eval, config.eval_size)

        return data_source
    if env.kind == "openenv":

        def data_source(config, split: str) -> list[dict]:
            from strop.envs.openenv_env import episode_rows

            n = config.size if split == "train" else config.eval_size
            return episode_rows(env.openenv, split, n, config.seed, env.max_turns)

        return data_source
    return None
