"""OpenEnv environments (``env.openenv``): gym-style ``reset()`` / ``step()``, each sample one episode.

An episode is the agent hook :func:`run_episode`, run per sample by the agent proxy's workers (docs/agents.md):
``reset(seed=...)`` gives the first observation, its ``messages`` (a chat so far) or its text (``prompt``,
``question``, ...) becomes the model's prompt; the model's answer, through the proxy (exact tokens, the
run's sampling), is the text field of the environment's action and goes to ``step()``; its observation is
the next user turn, until ``done`` or ``env.max_turns``. The sample's reward is the sum of the step rewards.

Where the environment runs, as OpenEnv starts environments locally (never a remote container service):

- ``pkg.module:EnvClass``: an ``openenv.core.env_server.interfaces.Environment`` subclass, a fresh instance
  per episode in this process (its action class read from ``Environment[Action, Observation, State]``);
- ``http://127.0.0.1:PORT``: an OpenEnv server (``create_app`` + uvicorn) on this machine, driven by OpenEnv's
  own ``GenericEnvClient`` over its WebSocket route, one session (its own environment instance) per episode.

The prompts are seeds: training rows reset with seeds ``data.seed * 10**6 + i``, held-out rows with seeds
from ``data.seed * 10**6 + 500000``: disjoint seeds (whether two seeds give two different tasks is the
environment's own business).
"""

from __future__ import annotations

import importlib
import math
import time
import typing
from urllib.parse import urlparse

import httpx

HELD_OUT_OFFSET = 500_000  # eval seeds start here (above any training seed: data.size is at most this)
TEXT_KEYS = ("prompt", "question", "text", "message", "observation", "content")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class EnvironmentFailure(RuntimeError):
    """The environment failed an episode (it raised, or gave no or a non-finite reward): that sample fails."""


def _need_openenv():
    try:
        import openenv.core  # noqa: F401  (2 s: gradio and fastapi come with it)
    except ImportError as exc:
        raise ImportError(
            "env.openenv needs OpenEnv: pip install 'strop[openenv]' (the tested release, openenv==0.10.0)"
        ) from exc


# ---- where the environment runs -------------------------------------------------------------------------------
class _InProcess:
    """A fresh instance of an Environment subclass for one episode."""

    def __init__(self, spec: str):
        self.spec, self.cls = spec, _environment_class(spec)
        self.action_cls = _action_class(self.cls, spec)
        self.field = _text_field(self.action_cls.model_json_schema(), spec)

    def reset(self, seed: int) -> dict:
        self.env = self.cls()
        return _as_dict(self.env.reset(seed=seed))

    def step(self, text: str) -> tuple[dict, object, bool]:
        obs = self.env.step(self.action_cls(**{self.field: text}))
        return _as_dict(obs), obs.reward, bool(obs.done)

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


class _Server:
    """One session of a local OpenEnv server (its /ws route: an environment instance of its own)."""

    def __init__(self, spec: str):
        from openenv.core import GenericEnvClient

        self.spec = spec
        self.field = _text_field(_server_schema(spec)["action"], spec)
        self.client = GenericEnvClient(base_url=spec).sync()
        self.client.connect()

    def reset(self, seed: int) -> dict:
        return _observation(self.client.reset(seed=seed))

    def step(self, text: str) -> tuple[dict, object, bool]:
        result = self.client.step({self.field: text})
        return _observation(result), result.reward, bool(result.done)

    def close(self) -> None:
        self.client.close()


def _observation(result) -> dict:
    obs = dict(result.observation or {})
    obs.setdefault("done", result.done)
    return obs


def _as_dict(obs) -> dict:
    return obs.model_dump() if hasattr(obs, "model_dump") else dict(obs)


def _is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://", "ws://"))


def _environment_class(spec: str):
    _need_openenv()
    from openenv.core.env_server.interfaces import Environment

    module_name, sep, name = spec.partition(":")
    if not sep or not name:
        raise ValueError(f"env.openenv={spec!r}: give 'pkg.module:EnvClass' or a local server 'http://127.0.0.1:PORT'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(
            f"env.openenv={spec!r}: module {module_name!r} does not import: {type(exc).__name__}: {exc}"
        ) from exc
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"env.openenv={spec!r}: {name!r} is not an OpenEnv Environment subclass in {module_name!r}")
    return cls


def _action_class(cls, spec: str):
    """ActT of ``class E(Environment[ActT, ObsT, StateT])``."""
    from openenv.core.env_server.interfaces import Environment

    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            if typing.get_origin(base) is Environment and typing.get_args(base):
                return typing.get_args(base)[0]
    raise ValueError(
        f"env.openenv={spec!r}: its class does not say its action type (declare it as "
        "Environment[MyAction, MyObservation, MyState])"
    )


def _text_field(schema: dict, spec: str) -> str:
    """The action's field the model's text goes into: its one string field (required ones first)."""
    props = schema.get("properties", {})
    strings = [k for k, v in props.items() if v.get("type") == "string"]
    required = [k for k in strings if k in schema.get("required", [])]
    if len(required) == 1 or (not required and len(strings) == 1):
        return (required or strings)[0]
    raise ValueError(
        f"env.openenv={spec!r}: its action must have one text field for the model's answer; it has "
        f"{sorted(props) or 'no fields'} (string fields: {strings or 'none'})"
    )


def _server_schema(url: str) -> dict:
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise ValueError(
            f"env.openenv={url!r}: only an OpenEnv server on this machine (127.0.0.1) is driven; start the "
            "environment locally (create_app + uvicorn) and give its address"
        )
    base = url.replace("ws://", "http://").rstrip("/")
    try:
        response = httpx.get(base + "/schema", timeout=10)
        response.raise_for_status()
        return response.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise ValueError(
            f"env.openenv={url!r}: no OpenEnv server answers GET /schema: {type(exc).__name__}: {exc}"
        ) from exc


def open_environment(spec: str):
    """A fresh episode's environment: in this process, or a session of a local server."""
    return _Server(spec) if _is_url(spec) else _InProcess(spec)


# ---- the data source and the agent hook --------------------------------------------------------------------------
def episode_rows(spec: str, split: str, n: int, seed: int, max_turns: int = 8) -> list[dict]:
    """``n`` prompt rows of ``split``: one seed each (disjoint between train and eval), checked now: the
    environment loads, its action has a text field, and the first seed's reset gives a prompt."""
    if _is_url(spec):
        _need_openenv()
    if n > HELD_OUT_OFFSET:
        raise ValueError(f"env.openenv: at most {HELD_OUT_OFFSET} episodes per split (data.size={n})")
    first = seed * 10**6 + (HELD_OUT_OFFSET if split != "train" else 0)
    if n:
        env = open_environment(spec)
        try:
            _messages(spec, env.reset(first), first)
        finally:
            env.close()
    return [
        {
            "prompt": f"OpenEnv {spec} episode, seed {first + i}",
            "label": None,
            "metadata": {"openenv": spec, "seed": first + i, "max_turns": max_turns},
        }
        for i in range(n)
    ]


def _messages(spec: str, obs: dict, seed: int) -> list[dict]:
    """The chat an observation shows: its ``messages``, or its text as a user turn."""
    msgs = obs.get("messages")
    if isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "role" in m for m in msgs):
        return [{"role": m["role"], "content": str(m.get("content") or "")} for m in msgs]
    text = next((obs[k] for k in TEXT_KEYS if isinstance(obs.get(k), str) and obs[k]), None)
    if text is None:
        raise EnvironmentFailure(
            f"env.openenv={spec!r} seed {seed}: the observation has no messages and no text "
            f"({', '.join(TEXT_KEYS)}) to prompt the model with; its fields: {sorted(obs)}"
        )
    return [{"role": "user", "content": text}]


def run_episode(base_url: str, api_key: str, row: dict) -> float:
    """The agent hook: one episode of the row's environment, the model's turns through the proxy at
    ``base_url`` with this sample's ``api_key``. Returns the sum of the step rewards."""
    meta = row["metadata"]
    spec, seed, max_turns = meta["openenv"], int(meta["seed"]), int(meta.get("max_turns", 8))
    where = f"env.openenv={spec!r} seed {seed}"
    try:
        env = open_environment(spec)
    except Exception as exc:
        raise EnvironmentFailure(f"{where}: could not start an episode: {type(exc).__name__}: {exc}") from exc
    total, rewarded = 0.0, False
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=600) as model:
        try:
            messages = _messages(spec, env.reset(seed), seed)
            for turn in range(max_turns):
                text = _answer(model, messages)
                if text is None:  # the session is capped (its tokens or calls): the episode ends, as truncated
                    if turn == 0:
                        raise EnvironmentFailure(f"{where}: the session was capped before the first step")
                    break
                try:
                    obs, reward, done = env.step(text)
                except Exception as exc:
                    raise EnvironmentFailure(f"{where}: step() raised {type(exc).__name__}: {exc}") from exc
                if reward is not None:
                    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                        raise EnvironmentFailure(f"{where}: step() gave the reward {reward!r}, not a finite number")
                    total, rewarded = total + float(reward), True
                if done:
                    break
                nxt = _messages(spec, obs, seed)
                # an observation with the whole chat replaces it; a text is the next user turn
                messages = nxt if "messages" in obs else [*messages, {"role": "assistant", "content": text}, *nxt]
        finally:
            env.close()
    if not rewarded:
        raise EnvironmentFailure(f"{where}: the episode ended without a reward (every step gave None)")
    return total


def _answer(model: httpx.Client, messages: list[dict]) -> str | None:
    """The model's answer through the proxy; a 429 (weights changing, calls full) waits its Retry-After.
    None: the session is capped (the proxy's 400 ``session_limit``: its calls or tokens are spent)."""
    for _ in range(600):
        r = model.post("/chat/completions", json={"model": "policy", "messages": messages})
        if r.status_code == 429:
            time.sleep(float(r.headers.get("Retry-After", "1")))
            continue
        if r.status_code == 400 and _code(r) == "session_limit":
            return None
        r.raise_for_status()
        return r.json()["choices"][0]["message"].get("content") or ""
    raise EnvironmentFailure("the proxy kept answering 429 for 10 minutes")


def _code(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"].get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
