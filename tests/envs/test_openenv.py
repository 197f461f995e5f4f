"""env.openenv: OpenEnv environments (reset()/step()) train through the agent proxy, in this process or as
an OpenEnv server on 127.0.0.1 driven by OpenEnv's own client (strop/envs/openenv_env.py)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("openenv.core", reason="pip install 'strop[openenv]'")

from strop.config import build_config  # noqa: E402
from strop.envs.openenv_env import HELD_OUT_OFFSET, EnvironmentFailure, episode_rows, run_episode  # noqa: E402
from strop.loop import rollout_only, train  # noqa: E402
from strop.process import free_port  # noqa: E402
from tests.test_e2e import tiny_overrides  # noqa: E402

WORD = "tests.envs.openenv_word:WordEnv"


def env_overrides(model_dir, run_dir, spec, **extra):
    cfg = tiny_overrides(model_dir, run_dir, **extra)
    del cfg["rollout"]["reward"]  # the environment's rewards
    cfg["env"] = {"openenv": spec, "max_turns": 3}
    cfg["data"] = {"size": 8, "eval_size": 2}
    cfg["rollout"] |= {"max_new_tokens": 64}
    cfg["agent"] = {"concurrency": 8, "max_call_tokens": 8}
    return cfg


def metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def word_server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("openenv_word.py")), str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        yield url
    finally:
        proc.kill()
        proc.wait(10)


def test_rows_are_seeds_disjoint_between_train_and_held_out():
    train_rows = episode_rows(WORD, "train", 50, seed=3)
    held = episode_rows(WORD, "eval", 20, seed=3)
    seeds = {r["metadata"]["seed"] for r in train_rows}, {r["metadata"]["seed"] for r in held}
    assert len(seeds[0]) == 50 and len(seeds[1]) == 20 and not seeds[0] & seeds[1]
    assert min(seeds[1]) == 3 * 10**6 + HELD_OUT_OFFSET


def test_an_openenv_environment_trains_end_to_end_in_process(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    summary = train(build_config(overrides=env_overrides(tiny_model_dir, run_dir, WORD, train={"steps": 2})))
    assert summary["status"] == "completed" and summary["steps"] == 2
    rows = [r for r in metrics(run_dir) if "samples_trained" in r]
    assert all(r["samples_trained"] == 8 and r["agent_sessions_ended"] == 8 for r in rows)
    # a wrong word gets a hint and another turn: up to 3 calls per session, every episode rewarded 0 or 1
    assert all(1 <= r["agent_calls_per_session"] <= 3 for r in rows)
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)


def test_an_openenv_server_on_loopback_through_openenvs_own_client(tiny_model_dir, tmp_path, word_server):
    run_dir = tmp_path / "run"
    out = rollout_only(build_config(overrides=env_overrides(tiny_model_dir, run_dir, word_server, train={"steps": 1})))
    samples = [json.loads(x) for x in out.read_text().splitlines()[1:]]
    assert len(samples) == 8 and all(s["reward"] in (0.0, 1.0) for s in samples)
    assert all(1 <= s["metadata"]["session_calls"] <= 3 for s in samples)
    # the first call's prompt is the server's reset observation for the sample's seed
    assert all("Reply with exactly one word:" in s["metadata"]["transcript"] or s["prompt"] for s in samples)


class FakeProxy:
    """An OpenAI chat endpoint answering fixed texts, to drive run_episode without a model."""

    def __init__(self, answers):
        self.answers, self.seen = list(answers), []

    def __enter__(self):
        import threading

        import uvicorn
        from fastapi import FastAPI, Request

        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.seen.append((request.headers.get("authorization"), body["messages"]))
            return {"choices": [{"message": {"role": "assistant", "content": self.answers.pop(0)}}]}

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}/v1"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


def _row(spec, seed=0, max_turns=3):
    return {"metadata": {"openenv": spec, "seed": seed, "max_turns": max_turns}}


def test_an_episode_is_the_sum_of_its_step_rewards_and_each_turn_sees_the_last():
    fake = FakeProxy(["banana", "pepper"])
    with fake as url:
        assert run_episode(url, "key-1", _row(WORD, seed=0)) == 1.0  # seed 0 asks for 'pepper'
    (auth, first), (_, second) = fake.seen
    assert auth == "Bearer key-1" and first == [{"role": "user", "content": "Reply with exactly one word: pepper"}]
    assert second[1:] == [
        {"role": "assistant", "content": "banana"},
        {"role": "user", "content": "Wrong: answer with only the word 'pepper'."},
    ]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("tests.envs.openenv_word:RaisingEnv", "step() raised RuntimeError: the environment's simulator crashed"),
        ("tests.envs.openenv_word:NanRewardEnv", "gave the reward nan, not a finite number"),
    ],
)
def test_an_environment_that_fails_fails_its_sample_naming_the_environment_and_seed(spec, message):
    with FakeProxy(["x", "y", "z"]) as url, pytest.raises(EnvironmentFailure) as err:
        run_episode(url, "k", _row(spec, seed=5))
    assert message in str(err.value) and f"env.openenv={spec!r} seed 5" in str(err.value)


def test_a_failing_environment_is_a_counted_sample_failure_not_a_crash(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    overrides = env_overrides(tiny_model_dir, run_dir, "tests.envs.openenv_word:RaisingEnv", train={"steps": 1})
    overrides["rollout"] |= {"sample_retries": 1, "filter_max_rounds": 1}
    with pytest.raises(RuntimeError, match="no trainable sample"):  # every group dropped: nothing to train
        rollout_only(build_config(overrides=overrides))
    records = [json.loads(x) for x in (run_dir / "failed_samples.jsonl").read_text().splitlines()]
    step = [r for r in records if r["step"] == 1]
    assert len(step) == 16 and all("simulator crashed" in r["error"] and "seed" in r["error"] for r in step)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("tests.envs.nope:Env", "module 'tests.envs.nope' does not import: ModuleNotFoundError"),
        ("tests.envs.openenv_word:WORDS", "is not an OpenEnv Environment subclass"),
        ("tests.envs.openenv_word:NoTextEnv", "its action must have one text field"),
        ("tests.envs.openenv_word:SilentEnv", "the observation has no messages and no text"),
        ("http://192.0.2.1:8000", "only an OpenEnv server on this machine"),
    ],
)
def test_bad_environments_are_refused_before_any_model_loads(tmp_path, spec, message, monkeypatch):
    import strop.setup

    monkeypatch.setattr(strop.setup, "resolve_model_path", lambda *a, **k: pytest.fail("the model was loaded"))
    overrides = env_overrides("unused-model", tmp_path / "run", spec, train={"steps": 1})
    with pytest.raises(Exception) as err:
        rollout_only(build_config(overrides=overrides))
    assert message in str(err.value)


def test_a_server_that_is_down_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    import strop.setup

    monkeypatch.setattr(strop.setup, "resolve_model_path", lambda *a, **k: pytest.fail("the model was loaded"))
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(Exception) as err:
        rollout_only(build_config(overrides=env_overrides("unused", tmp_path / "run", url, train={"steps": 1})))
    assert "no OpenEnv server answers GET /schema" in str(err.value)


def test_strop_eval_scores_the_held_out_episodes_and_writes_each(tiny_model_dir, tmp_path):
    from strop.loop import evaluate_only

    overrides = env_overrides(tiny_model_dir, tmp_path / "run", WORD)
    overrides["data"]["eval_size"] = 5
    row = evaluate_only(build_config(overrides=overrides), tmp_path / "eval.jsonl")
    written = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert len(written) == 5 and {w["metadata"]["seed"] for w in written} == {
        10**6 + HELD_OUT_OFFSET + i for i in range(5)
    }
    assert row["eval_reward_mean"] == pytest.approx(sum(w["reward"] for w in written) / 5)
    # what the model was asked: the environment's reset observation for the seed, rendered by the chat template
    assert all(
        "Reply with exactly one word" in w["prompt_text"] and w["metadata"]["session_calls"] >= 1 for w in written
    )
    assert not (tmp_path / "run" / "rollout_samples.jsonl").exists()  # nothing trained or rolled out
