"""The vLLM client against a scripted server (httpx MockTransport): the logprobs-mode probe and parsing."""

import asyncio
import json

import httpx
import pytest

from strop.engines.http import EngineRequestError
from strop.engines.vllm import VLLMEngine
from strop.types import SamplingParams


def _server(processed: bool):
    raw = {"5": -0.5, "9": -1.5, "12": -2.5}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        body = json.loads(request.content)
        t = body["temperature"]
        if body["max_tokens"] == 1:  # the probe: top logprobs of the first position
            top = {k: (v / t if processed else v) for k, v in raw.items()}
            return httpx.Response(200, json={"choices": [{"logprobs": {"top_logprobs": [top]}, "token_ids": [5],
                                                          "finish_reason": "length"}]})
        return httpx.Response(200, json={"choices": [{"token_ids": [5, 9], "finish_reason": "stop",
                                                      "logprobs": {"token_logprobs": [-0.1, -0.2]}}]})
    return handler


def _engine(processed):
    engine = VLLMEngine("http://vllm.test")
    engine._client = httpx.AsyncClient(transport=httpx.MockTransport(_server(processed)))
    return engine


def test_a_server_with_raw_logprobs_is_refused_when_sampling_at_another_temperature():
    with pytest.raises(EngineRequestError, match="--logprobs-mode processed_logprobs"):
        asyncio.run(_engine(processed=False).check_logprobs(0.8, [1, 2, 3]))
    asyncio.run(_engine(processed=False).check_logprobs(1.0, [1, 2, 3]))  # at temperature 1 raw == processed
    asyncio.run(_engine(processed=True).check_logprobs(0.8, [1, 2, 3]))


def test_completion_parsing():
    out = asyncio.run(_engine(True).generate([1, 2], SamplingParams(max_new_tokens=4, stop_token_ids=[2])))
    assert out.token_ids == [5, 9] and out.logprobs == [-0.1, -0.2] and out.finish_reason == "stop"


class _VersionedServer:
    """A scripted vLLM 0.32 dev-mode server's weight routes: a label it holds ("default" at start),
    reloads, and a completion that can be held open while weights change."""

    def __init__(self):
        self.label, self.loads, self.hold = "default", [], None

    def restart(self):
        self.label = "default"

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if path == "/collective_rpc":
            self.loads.append(json.loads(request.content)["kwargs"]["weights_path"])
            return httpx.Response(200, json={"results": [None]})
        if path == "/reset_prefix_cache":
            return httpx.Response(200, json={})
        if path == "/update_weight_version":
            self.label = json.loads(request.content)["new_version"]
            return httpx.Response(200, json={"success": True, "new_version": self.label})
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.label})
        if self.hold is not None:  # a completion that is still generating
            await self.hold.wait()
        return httpx.Response(200, json={"choices": [{"token_ids": [5], "finish_reason": "stop",
                                                      "logprobs": {"token_logprobs": [-0.1]}}]})


def _versioned():
    server = _VersionedServer()
    engine = VLLMEngine("http://vllm.test")
    engine._client = httpx.AsyncClient(transport=httpx.MockTransport(server))
    return server, engine


def test_a_restarted_vllm_server_reports_its_initial_weights_not_the_clients_count():
    server, engine = _versioned()

    async def main():
        loaded = await engine.load_weights("/w/v3", 3)
        before = await engine.get_weight_version()
        server.restart()  # killed and started again between updates
        return loaded, before, await engine.get_weight_version()

    assert asyncio.run(main()) == (3, 3, 0)
    assert server.loads == ["/w/v3"]


def test_a_vllm_completion_is_stamped_with_the_version_that_sampled_it():
    server, engine = _versioned()
    server.hold = asyncio.Event()

    async def main():
        await engine.load_weights("/w/v1", 1)
        running = asyncio.ensure_future(engine.generate([1, 2], SamplingParams(max_new_tokens=2)))
        await asyncio.sleep(0.05)  # sent while version 1 is loaded
        server.hold, hold = None, server.hold
        await engine.load_weights("/w/v2", 2)  # the next version lands while it is still running
        hold.set()
        return await running

    assert asyncio.run(main()).weight_version == 1


def test_a_vllm_load_that_does_not_take_is_refused():
    server, engine = _versioned()

    async def ignore_label(request):
        if request.url.path == "/update_weight_version":
            return httpx.Response(200, json={"success": True})  # accepted, but the label never changes
        return await server(request)

    engine._client = httpx.AsyncClient(transport=httpx.MockTransport(ignore_label))
    with pytest.raises(EngineRequestError, match="asked to load weight version 4, reports 0"):
        asyncio.run(engine.load_weights("/w/v4", 4))
