"""OpenEnv environments for tests, written in OpenEnv's own API (openenv.core.env_server).

``WordEnv``: reset(seed) asks for one word of a list; each step takes the model's text, gives reward 1 and ends
when it is the word, else 0 and a hint, at most 3 turns. ``serve(port)`` runs it as an OpenEnv server on
127.0.0.1 (``python tests/envs/openenv_word.py PORT``). The broken variants fail on purpose."""

from __future__ import annotations

import random
import sys
from typing import Any, Optional
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

WORDS = ["apple", "river", "orange", "planet", "violet", "castle", "pepper", "rocket"]
MAX_TURNS = 3


class WordAction(Action):
    text: str = Field(..., description="the model's answer")


class WordObservation(Observation):
    prompt: str = ""


class WordState(State):
    target: str = ""


class WordEnv(Environment[WordAction, WordObservation, WordState]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = WordState(episode_id=str(uuid4()))

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> WordObservation:
        target = random.Random(seed).choice(WORDS)
        self._state = WordState(episode_id=episode_id or str(uuid4()), step_count=0, target=target)
        return WordObservation(prompt=f"Reply with exactly one word: {target}", done=False, reward=None)

    def step(self, action: WordAction, timeout_s: Optional[float] = None, **kwargs: Any) -> WordObservation:
        self._state.step_count += 1
        ok = action.text.strip().strip(".!\"'").lower() == self._state.target
        done = ok or self._state.step_count >= MAX_TURNS
        hint = "Correct." if ok else f"Wrong: answer with only the word '{self._state.target}'."
        return WordObservation(prompt=hint, done=done, reward=1.0 if ok else 0.0)

    @property
    def state(self) -> WordState:
        return self._state


class RaisingEnv(WordEnv):
    def step(self, action, timeout_s=None, **kwargs):
        raise RuntimeError("the environment's simulator crashed")


class NanRewardEnv(WordEnv):
    def step(self, action, timeout_s=None, **kwargs):
        obs = super().step(action)
        obs.reward = float("nan")
        obs.done = True
        return obs


class NumberAction(Action):
    guess: int = 0


class NoTextEnv(Environment[NumberAction, WordObservation, WordState]):
    def reset(self, seed=None, episode_id=None, **kwargs):
        return WordObservation(prompt="guess")

    def step(self, action, timeout_s=None, **kwargs):
        return WordObservation(prompt="", done=True, reward=0.0)

    @property
    def state(self):
        return WordState()


class SilentEnv(WordEnv):
    def reset(self, seed=None, episode_id=None, **kwargs):
        super().reset(seed)
        return WordObservation(prompt="", done=False, reward=None)


def serve(port: int, lifetime: float = 240.0) -> None:
    """WordEnv as an OpenEnv server (create_app + uvicorn) on 127.0.0.1; it exits after ``lifetime`` seconds."""
    import os
    import threading

    import uvicorn
    from openenv.core.env_server.http_server import create_app

    threading.Timer(lifetime, lambda: os._exit(0)).start()
    app = create_app(WordEnv, WordAction, WordObservation, env_name="word", max_concurrent_envs=16)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error")


if __name__ == "__main__":
    serve(int(sys.argv[1]))
