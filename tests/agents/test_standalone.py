"""``strop proxy`` as its own process: in front of its own engine, or of a running strop serve."""

import sys

import httpx
import openai
import pytest

from strop.process import free_port
from strop.engines.launch import LocalServer

pytestmark = pytest.mark.timeout(240)
TOKEN = "admin-secret"


@pytest.fixture
def start_proxy(tiny_model_dir):
    started = []

    def start(*extra):
        port = free_port()
        proxy = LocalServer(
            str(tiny_model_dir),
            port,
            env={"STROP_PROXY_TOKEN": TOKEN},
            token=TOKEN,
            command=[
                sys.executable,
                "-m",
                "strop.cli",
                "proxy",
                f"--model-path={tiny_model_dir}",
                f"--port={port}",
                "--max-call-tokens=8",
                *extra,
            ],
        ).start()
        started.append(proxy)
        return proxy.wait_healthy(120)

    yield start
    for p in started:
        p.stop()


@pytest.mark.parametrize("engine", ["in_process", "strop_serve"])
def test_the_standalone_proxy_records_a_session_and_hands_it_back(start_proxy, start_server, engine):
    extra = [f"--engine-url={start_server().url}"] if engine == "strop_serve" else []
    proxy = start_proxy(*extra)
    admin = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.post(f"{proxy.url}/v1/sessions", headers={"Authorization": "Bearer wrong"}).status_code == 401
    opened = httpx.post(f"{proxy.url}/v1/sessions", headers=admin).json()
    client = openai.OpenAI(base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0)
    msgs = [{"role": "user", "content": "Hello"}]
    first = client.chat.completions.create(model="m", messages=msgs)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "More"}]
    second = client.chat.completions.create(model="m", messages=msgs)
    state = httpx.get(f"{proxy.url}/v1/sessions/{opened['id']}", headers=admin).json()
    assert state["calls"] == 2 and state["state"] == "open"
    done = httpx.post(f"{proxy.url}/v1/sessions/{opened['id']}/close", headers=admin).json()
    (sample,) = done["samples"]
    first_ids, second_ids = first.choices[0].model_extra["token_ids"], second.choices[0].model_extra["token_ids"]
    assert sample["prompt_ids"] == first.model_extra["prompt_token_ids"]
    assert sample["prompt_ids"] + sample["response_ids"] == second.model_extra["prompt_token_ids"] + second_ids
    assert [t for t, m in zip(sample["response_ids"], sample["loss_mask"]) if m] == first_ids + second_ids
    assert len(sample["rollout_logprobs"]) == len(sample["response_ids"])
    # a closed session is gone: its key no longer generates
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="m", messages=msgs)
    assert httpx.post(f"{proxy.url}/v1/sessions/{opened['id']}/close", headers=admin).status_code == 404


def test_the_standalone_proxy_needs_a_token(tiny_model_dir, capsys):
    from strop.cli import main

    assert main(["proxy", f"--model-path={tiny_model_dir}", "--token="]) == 1
    assert "--token is needed" in capsys.readouterr().err
