"""verifiers environments (``env.verifiers``): a verifiers 0.4 taskset's tasks are the prompts, each sample one
episode of its environment against strop's agent proxy, its reward the environment's own.

- :func:`task_rows` is the data source: one row per task (its prompt as chat messages, with its system
  prompt; ``metadata``: the environment, its taskset kwargs as JSON and the task's index in ``load()``).
- :func:`run_episode` is the agent hook (``plugins.agent``), run per sample in a worker thread: it loads the
  environment named by the row (once per process), runs the task's episode in an event loop of its own,
  the model reached through the proxy with the sample's session key, and returns ``trace.reward`` (the
  weighted sum of the taskset's ``@vf.reward``s, computed by verifiers). A session the proxy caps (its
  calls or tokens spent) ends the episode there, scored on what it holds, and trains as truncated.
- :func:`score_completion` is what verifiers computes for a fixed single-turn reply, without a model.

How an episode runs: ``vf.load_environment`` (the module's own ``Env`` subclass, else verifiers'
``SingleAgentEnv``), each of its agents in verifiers' local ``subprocess`` runtime (never a remote sandbox)
with strop's offline twin of the ``null`` harness (:mod:`strop.envs.verifiers_harness`) unless the taskset
ships a harness or the role pins one. verifiers' interception server sits between the harness program and
the proxy: it relays each chat call (streamed, tools included) to ``base_url`` and records the episode.

A spec is a verifiers taskset id or an importable module whose ``__all__`` exports one ``vf.Taskset``
subclass. verifiers 0.4.0 resolves only top-level names (a dotted one fails in its ``find_spec``), so a
dotted module is imported here and registered under a top-level alias, which verifiers then imports.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import itertools
import json
import logging
import math
import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from strop.configbase import ConfigError

log = logging.getLogger(__name__)

DEFAULT_LIMIT = 100_000  # tasks read from one taskset at most (an infinite taskset yields forever)
MODEL_NAME = "policy"  # the model the harness asks for (the proxy serves the run's model whatever is named)
# the per-episode key's environment variable: its name holds "API_KEY", so verifiers' subprocess runtime
# leaves it out of the harness program's and the tool servers' environments
KEY_VARIABLE_PREFIX = "STROP_VF_SESSION_API_KEY_"


class EnvironmentFailure(RuntimeError):
    """The environment failed an episode (an error, or no finite reward): that sample fails, never a zero."""


def _verifiers():
    """``verifiers.v1``, with strop's harness registered; a clear error where verifiers is not installed."""
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ImportError(
            "env.verifiers needs verifiers: pip install 'strop[verifiers]' (the tested release, verifiers==0.4.0)"
        ) from exc
    import strop.envs.verifiers_harness  # noqa: F401  (registers the harness id 'strop_chat')

    return vf


# ---- loading an environment (once per process) ------------------------------------------------------------------
@dataclass
class LoadedEnv:
    spec: str
    kwargs: dict
    config: object  # the environment's vf.EnvConfig, every role on the subprocess runtime
    tasks: list  # the taskset's vf.Task objects, in load() order


_cache: dict[tuple, LoadedEnv] = {}
_cache_lock = threading.Lock()


def load_env(spec: str, kwargs: dict, limit: int = DEFAULT_LIMIT) -> LoadedEnv:
    """The environment ``spec`` with taskset kwargs ``kwargs`` and its first ``limit`` tasks, loaded once per
    process (thread-safe: concurrent episodes wait for the first load)."""
    key = (spec, json.dumps(kwargs, sort_keys=True), limit)
    with _cache_lock:
        if key not in _cache:
            vf = _verifiers()
            taskset_id, module = _taskset_id(vf, spec)
            _export_import_root(module)
            config = _env_config(vf, spec, taskset_id, kwargs)
            _cache[key] = LoadedEnv(spec, dict(kwargs), config, _load_tasks(vf, spec, config, limit))
        return _cache[key]


def _taskset_id(vf, spec: str) -> tuple[str, object]:
    """The id verifiers loads ``spec`` by, and its module; refusals name the env and say why."""
    from verifiers.v1.utils import loaders

    where = f"env.verifiers={spec!r}"
    taskset_id = spec
    if "." in spec and "/" not in spec:  # a dotted module: imported here, registered under a top-level alias
        try:
            module = importlib.import_module(spec)
        except Exception as exc:
            raise ConfigError(f"{where}: the module does not import: {type(exc).__name__}: {exc}") from exc
        slug = re.sub(r"[^0-9a-z_]", "_", spec.lower())
        taskset_id = f"strop_vf_{slug}_{hashlib.sha1(spec.encode()).hexdigest()[:8]}"
        sys.modules.setdefault(taskset_id, module)
    try:
        module = loaders.import_taskset(taskset_id)
    except Exception as exc:  # (verifiers words any failing import as "not found": its cause is the error)
        real = exc.__cause__ or exc
        raise ConfigError(f"{where}: the module does not import: {type(real).__name__}: {real}") from exc
    try:
        loaders.taskset_class(taskset_id)  # exactly one vf.Taskset subclass in its __all__
    except (AttributeError, TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: no verifiers Taskset to load: {exc}") from exc
    return taskset_id, module


def _export_import_root(module) -> None:
    """Put the folder ``module``'s top package imports from on PYTHONPATH: verifiers starts tool servers as
    ``python -m MODULE`` in a working folder of its own, and they import the environment's modules from there."""
    top = sys.modules.get(module.__name__.split(".")[0])
    paths = list(getattr(top, "__path__", None) or [])  # a package's folder(s), namespace packages included
    where = Path(paths[0]).parent if paths else Path(getattr(top, "__file__", "") or ".").parent
    root = str(where.resolve())
    if "site-packages" in root or "dist-packages" in root:  # installed: importable anywhere already
        return
    current = os.environ.get("PYTHONPATH", "")
    if root not in current.split(os.pathsep):
        os.environ["PYTHONPATH"] = root + (os.pathsep + current if current else "")


def _env_config(vf, spec: str, taskset_id: str, kwargs: dict):
    """The environment's EnvConfig: the taskset's kwargs, every role on the local subprocess runtime, and
    strop's offline harness for the roles that pin none (unless the taskset ships its own)."""
    from pydantic import ValidationError
    from strop.envs.verifiers_harness import HARNESS_ID

    from verifiers.v1.utils import loaders

    config_type = loaders.env_config_type(taskset_id)
    ships_harness = loaders.default_harness_id(taskset_id) != "bash"  # verifiers' fallback: its uv harness
    roles = {}
    for name, field in config_type.model_fields.items():
        if isinstance(field.default, vf.AgentConfig):
            roles[name] = {"runtime": {"type": "subprocess"}}
            if field.default.harness is None and not ships_harness:
                roles[name]["harness"] = {"id": HARNESS_ID}
    try:
        return vf.resolve_env_config({"taskset": {**kwargs, "id": taskset_id}, **roles})
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        field = ".".join(str(k) for k in first["loc"]) or "(the config)"
        raise ConfigError(
            f"env.verifiers={spec!r}: the taskset's config refuses kwargs {json.dumps(kwargs, sort_keys=True)}: "
            f"{field}: {first['msg']} ({exc.error_count()} error(s))"
        ) from None


def _load_tasks(vf, spec: str, config, limit: int) -> list:
    """The taskset's first ``limit`` tasks (and a warning when it has more, or is infinite)."""
    where = f"env.verifiers={spec!r}"
    try:
        tasks = list(itertools.islice(iter(vf.load_taskset(config.taskset)), limit + 1))
    except Exception as exc:
        raise ConfigError(f"{where}: loading its tasks failed: {type(exc).__name__}: {exc}") from exc
    if len(tasks) > limit:
        log.warning(f"strop: {where} has more than {limit} tasks (or is infinite): the first {limit} are used")
        tasks = tasks[:limit]
    if not tasks:
        raise ConfigError(f"{where}: the taskset has no tasks (with kwargs {config.taskset.model_dump_json()})")
    return tasks


# ---- the data source --------------------------------------------------------------------------------------------
def task_rows(
    spec: str, kwargs: dict, split: str, eval_kwargs: dict | None, eval_size: int, limit: int = DEFAULT_LIMIT
) -> list[dict]:
    """The rows of ``split`` ('train' or 'eval'). With ``eval_kwargs`` the held-out rows are the tasks of the
    taskset loaded with ``kwargs | eval_kwargs`` (e.g. ``{"split": "eval"}``) and training gets all of its own;
    without, the last ``eval_size`` tasks are held out and training gets the others (disjoint)."""
    if split not in ("train", "eval"):
        raise ValueError(f"env.verifiers={spec!r}: split={split!r}, expected 'train' or 'eval'")
    kwargs = {**(kwargs or {}), **(eval_kwargs or {})} if split == "eval" else dict(kwargs or {})
    env = load_env(spec, kwargs, limit)
    n = len(env.tasks)
    if eval_kwargs is not None:  # each split is a taskset of its own
        indices = range(n)
    elif eval_size >= n:
        raise ConfigError(
            f"env.verifiers={spec!r}: {n} tasks, and the last eval_size={eval_size} are held out: none is "
            "left to train on; hold out fewer (data.eval_size) or give the eval split's kwargs"
        )
    else:  # one taskset: its last eval_size tasks are held out
        indices = range(n - eval_size) if split == "train" else range(n - eval_size, n)
    text = json.dumps(kwargs, sort_keys=True)
    return [
        {
            "prompt": _prompt_messages(env.tasks[i].data, spec, i),
            "label": None,
            "metadata": {"verifiers_env": spec, "verifiers_kwargs": text, "task_index": i},
        }
        for i in indices
    ]


def _prompt_messages(data, spec: str, index: int) -> list[dict]:
    """A task's prompt as chat messages, after its system prompt: what the harness sends first."""
    from verifiers.v1.types import content_text

    if data.prompt is None or (isinstance(data.prompt, str) and not data.prompt.strip()):
        raise ConfigError(
            f"env.verifiers={spec!r}: task {index} has no prompt (TaskData.prompt is {data.prompt!r}): strop "
            "starts each episode from a prompt, so a task the environment opens itself cannot be a row"
        )
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return messages + [{"role": "user", "content": data.prompt}]
    return messages + [{"role": m.role, "content": content_text(m.content)} for m in data.prompt]


# ---- the agent hook ---------------------------------------------------------------------------------------------
def run_episode(base_url: str, api_key: str, row: dict) -> float:
    """One episode of the row's task against the proxy at ``base_url`` with the session key ``api_key``;
    its reward. A failed episode, or one without a finite reward, raises :class:`EnvironmentFailure`."""
    env, index = _row_env(row)
    episode = asyncio.run(play(env, index, base_url, api_key))  # (a worker thread: no loop runs here)
    return episode_reward(episode, env.spec, index)


def _row_env(row: dict) -> tuple[LoadedEnv, int]:
    meta = row.get("metadata") or {}
    if not all(k in meta for k in ("verifiers_env", "verifiers_kwargs", "task_index")):
        raise ValueError(
            f"row metadata {sorted(meta)} names no verifiers task (verifiers_env, verifiers_kwargs, task_index): "
            "the rows of a verifiers environment come from strop.envs.verifiers_env.task_rows"
        )
    env = load_env(meta["verifiers_env"], json.loads(meta["verifiers_kwargs"]))
    index = int(meta["task_index"])
    if not 0 <= index < len(env.tasks):
        raise EnvironmentFailure(
            f"env.verifiers={env.spec!r}: task {index} does not exist (the taskset has {len(env.tasks)} tasks)"
        )
    return env, index


async def play(env: LoadedEnv, index: int, base_url: str, api_key: str):
    """Task ``index``'s episode (a ``vf.Episode``) through ``base_url``. verifiers' client config names an
    environment variable, not a key: the key travels in a variable this episode holds alone (read when its
    interception server builds its client), so concurrent episodes never share one."""
    vf = _verifiers()
    with _key_variable(api_key) as variable:
        environment = vf.load_environment(env.config)  # a fresh Env: it holds its serving resources
        ctx = vf.ModelContext(
            model=MODEL_NAME,
            client=vf.EvalClientConfig(base_url=base_url, api_key_var=variable),
            sampling=vf.SamplingConfig(),  # none: the proxy samples as the rollout does, within its limits
        )
        async with environment.serving():
            episode = await environment.run_episode(env.tasks[index], ctx)
    if capped(episode):  # verifiers scores a stopped run's partial trajectory: so does a capped session's
        try:
            for trace in episode.traces:
                await env.tasks[index].score(trace)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            raise EnvironmentFailure(
                f"env.verifiers={env.spec!r} task {index}: scoring the capped run failed: {why}"
            ) from exc
    return episode


_free_variables: list[str] = []
_variables_lock = threading.Lock()
_variable_numbers = itertools.count()


@contextlib.contextmanager
def _key_variable(api_key: str):
    """An environment variable holding ``api_key`` while the episode runs. The variables are reused: the
    environment changes size only when more episodes run at once than ever before (verifiers copies
    ``os.environ`` for each program it starts, in other threads, and a dict resized mid-copy raises)."""
    with _variables_lock:
        variable = _free_variables.pop() if _free_variables else f"{KEY_VARIABLE_PREFIX}{next(_variable_numbers)}"
    os.environ[variable] = api_key
    try:
        yield variable
    finally:
        os.environ[variable] = ""  # (the session's key leaves; the variable stays for the next episode)
        with _variables_lock:
            _free_variables.append(variable)


def capped(episode) -> bool:
    """Whether the episode stopped only because the proxy capped the session (its 400 ``session_limit``: the
    calls or tokens strop gives a sample are spent). verifiers' chat program ends a run on a context overflow
    and scores it; it does not know strop's cap, so the run fails, and strop scores what the trace holds:
    the session trains as truncated, as any capped agent session does (docs/agents.md)."""
    errors = [e for t in episode.traces for e in t.errors]
    return (
        not episode.ok
        and not episode.errors
        and bool(episode.traces)
        and all(t.errors for t in episode.traces)
        and all(e.status_code == 400 and '"session_limit"' in e.message for e in errors)
    )


def episode_reward(episode, spec: str, index: int) -> float:
    """The episode's reward: its trace's ``reward`` (with several agents, the mean over the trainable ones)."""
    where = f"env.verifiers={spec!r} task {index}"
    errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
    if not (episode.ok or capped(episode)) or not episode.traces:
        why = "; ".join(f"{e.type}: {e.message}" for e in errors) or "no agent ran"
        raise EnvironmentFailure(f"{where}: the episode failed: {why[:2000]}")
    traces = [t for t in episode.traces if t.agent.trainable] or episode.traces
    rewards = [_finite(t.reward, where) for t in traces]
    return sum(rewards) / len(rewards)


def _finite(reward, where: str) -> float:
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise EnvironmentFailure(f"{where}: the environment's reward is {reward!r}, not a finite number")
    return float(reward)


# ---- scoring a fixed reply --------------------------------------------------------------------------------------
def score_completion(spec: str, kwargs: dict, task_index: int, completion: str) -> float:
    """What verifiers computes for ``completion`` as the one reply to task ``task_index`` (no model, no server):
    the task's ``score()`` on a trace holding the prompt and that reply, as ``vf-replay`` scores saved traces."""
    vf = _verifiers()
    from verifiers.v1 import graph

    task = load_env(spec, kwargs).tasks[task_index]
    trace = vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=vf.AgentInfo(config=vf.AgentConfig(model=MODEL_NAME)),
    )
    data = task.data
    prompt = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
    prompt += [vf.UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else list(data.prompt or [])
    reply = vf.AssistantMessage(content=completion)
    turn = graph.prepare_turn(trace, prompt)
    turn.commit(vf.Response(id="fixed", created=0, model=MODEL_NAME, message=reply, finish_reason="stop"))
    asyncio.run(task.score(trace))
    return _finite(trace.reward, f"env.verifiers={spec!r} task {task_index}")
