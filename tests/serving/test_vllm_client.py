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
