"""The vLLM client against a scripted server (httpx MockTransport): the logprobs-mode probe and parsing."""

import asyncio
import json

import httpx
import pytest

from strop.wire.errors import EngineRequestError
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
            return httpx.Response(
                200,
                json={"choices": [{"logprobs": {"top_logprobs": [top]}, "token_ids": [5], "finish_reason": "length"}]},
            )
        return httpx.Response(
            200,
            json={
                "choices": [
                    {"token_ids": [5, 9], "finish_reason": "stop", "logprobs": {"token_logprobs": [-0.1, -0.2]}}
                ]
            },
        )

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
        return httpx.Response(
            200, json={"choices": [{"token_ids": [5], "finish_reason": "stop", "logprobs": {"token_logprobs": [-0.1]}}]}
        )


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


# vLLM 0.32's answer when a worker lacks the called method (multiprocessing executor: the worker's
# AttributeError, relayed by the engine core as "Call to collective_rpc method failed", HTTP 500)
NO_METHOD = (
    "Call to collective_rpc method failed: Worker failed with error ''CPUWorker' object has no attribute "
    "'{method}'', please check the stack trace above for the root cause"
)


class _SyncServer:
    """A scripted vLLM 0.32 dev-mode server's update routes, with or without strop's worker extension;
    ``reset_fails``: how many times /reset_prefix_cache answers success=false first (None: always)."""

    def __init__(self, extension=True, reset_fails=0, backend="StropGlooTransfer"):
        self.extension, self.reset_fails, self.backend = extension, reset_fails, backend
        self.calls, self.label = [], "default"
        self.receipt = {
            "checksum": "ab" * 16,
            "version": "5",
            "loaded": True,
            "missing": [],
            "n_missing": 0,
            "buckets": 3,
            "open": False,
        }

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        self.calls.append(
            path
            + (f"?{request.url.query.decode()}" if request.url.query else "")
            + (f" {body['method']}" if path == "/collective_rpc" else "")
        )
        if path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        if path == "/collective_rpc":
            method = body["method"]
            if not self.extension:
                return httpx.Response(
                    500,
                    json={
                        "error": {
                            "message": NO_METHOD.format(method=method),
                            "type": "InternalServerError",
                            "param": None,
                            "code": 500,
                        }
                    },
                )
            if method == "strop_info":  # a server of two tensor-parallel workers
                workers = [{"rank": r, "transfer_backend": self.backend} for r in (0, 1)]
                return httpx.Response(200, json={"results": workers})
            return httpx.Response(200, json={"results": [self.receipt if method == "strop_receipt" else {}]})
        if path == "/update_weights":  # vLLM's answer when its worker's receive fails
            return httpx.Response(
                500,
                json={
                    "error": {
                        "message": "Call to collective_rpc method failed: Worker "
                        "failed with error 'Connection closed by peer'",
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
                    }
                },
            )
        if path in ("/init_weight_transfer_engine", "/start_weight_update", "/finish_weight_update"):
            return httpx.Response(200, json={"message": "ok"})
        if path == "/reset_prefix_cache":
            failing = self.reset_fails is None or self.reset_fails > 0
            if self.reset_fails:
                self.reset_fails -= 1
            return httpx.Response(200, json={"success": not failing})
        if path == "/pause":
            return httpx.Response(200, json={"status": "paused"})
        if path == "/resume":
            return httpx.Response(200, json={"status": "resumed"})
        if path == "/update_weight_version":
            self.label = body["new_version"]
            return httpx.Response(200, json={"success": True, "new_version": self.label})
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.label})
        return httpx.Response(404, json={"detail": "Not Found"})


def _sync_engine(**kw):
    server = _SyncServer(**kw)
    engine = VLLMEngine("http://vllm.test", backoff_s=0.001)
    engine._client = httpx.AsyncClient(transport=httpx.MockTransport(server))
    return server, engine


@pytest.mark.timeout(30)
def test_a_vllm_engine_without_the_extension_is_refused_naming_it_its_version_and_the_fallback():
    _, engine = _sync_engine(extension=False)
    with pytest.raises(EngineRequestError) as err:
        asyncio.run(engine.check_broadcast())
    assert str(err.value).startswith("http://vllm.test: vLLM 0.32.0 has no strop worker extension")
    assert (
        "start vLLM with --worker-extension-cls strop.serving.vllm_worker.StropWorkerExtension, or use engine.sync=disk"
    ) in str(err.value)
    # the extension, but vLLM's own transfer backend (or none): refused naming the setting
    for backend in ("NCCLWeightTransferEngine", "NoneType"):
        _, engine = _sync_engine(backend=backend)
        with pytest.raises(EngineRequestError, match=f"backend is \\['{backend}'\\].*--weight-transfer-config"):
            asyncio.run(engine.check_broadcast())
    # with the extension every worker joins the group: the engine takes one rank per worker
    server, engine = _sync_engine()
    asyncio.run(engine.check_broadcast())
    assert engine.group_ranks == 2
    # a worker that has the extension but fails is reported as that failure, not as a missing extension
    with pytest.raises(EngineRequestError, match="/update_weights failed: HTTP 500.*Connection closed by peer") as err:
        asyncio.run(engine.receive_bucket(_bucket(), "g", 1, True))
    assert "no strop worker extension" not in str(err.value)


def _bucket():
    from strop.wire.buckets import plan_buckets

    return plan_buckets([("w", "float32", (2, 2))], 1 << 20)[0]


@pytest.mark.timeout(30)
def test_reset_prefix_cache_is_retried_while_vllm_reports_blocks_held():
    server, engine = _sync_engine(reset_fails=2)

    async def main():
        await engine.pause("abort")
        await engine.end_update(5)
        await engine.resume()
        return await engine.receipt()

    assert asyncio.run(main()) == (5, "stream", "ab" * 16)
    assert server.calls == [
        "/pause?mode=abort",
        "/finish_weight_update",
        *["/reset_prefix_cache"] * 3,
        "/update_weight_version",
        "/weight_info",
        "/resume",
        "/collective_rpc strop_receipt",
        "/weight_info",
    ]
    # paused with keep, the kept requests hold their blocks until resume: they are preempted by the reset
    server, engine = _sync_engine()
    asyncio.run(engine.pause("keep"))
    asyncio.run(engine.end_update(6))
    assert "/reset_prefix_cache?reset_running_requests=true" in server.calls


@pytest.mark.timeout(30)
def test_a_prefix_cache_that_never_resets_fails_the_update_before_the_version_is_labelled():
    server, engine = _sync_engine(reset_fails=None)
    with pytest.raises(
        EngineRequestError,
        match=r"^http://vllm.test: /reset_prefix_cache still answers "
        r"success=false after 8 attempts",
    ):
        asyncio.run(engine.end_update(5))
    assert server.calls.count("/reset_prefix_cache") == 8 and "/update_weight_version" not in server.calls
    assert server.label == "default"


@pytest.mark.timeout(30)
def test_a_vllm_receipt_of_an_incomplete_update_is_refused():
    server, engine = _sync_engine()
    server.receipt = {**server.receipt, "loaded": False, "missing": ["model.norm.weight"], "n_missing": 1}
    with pytest.raises(EngineRequestError, match=r"did not write every parameter.*1 not written.*model\.norm\.weight"):
        asyncio.run(engine.receipt())
    with pytest.raises(ValueError, match="vLLM pause mode must be one of"):
        asyncio.run(engine.pause("retract"))  # SGLang's mode: vLLM has no such one


def test_vllm_scores_a_probe_from_its_prompt_logprobs():
    def handler(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        body = json.loads(request.content)
        assert body["prompt"] == [7, 8, 9] and body["prompt_logprobs"] == 0 and body["temperature"] == 1.0
        # vLLM 0.32: one entry per prompt position (None for the first), keyed by token id, the prompt's own
        # token always listed (with prompt_logprobs=0 a sampled-better token may be listed too)
        return httpx.Response(
            200,
            json={
                "choices": [
                    {
                        "token_ids": [1],
                        "prompt_logprobs": [
                            None,
                            {"8": {"logprob": -1.5, "rank": 2}, "3": {"logprob": -0.5, "rank": 1}},
                            {"9": {"logprob": -0.25, "rank": 1}},
                        ],
                    }
                ]
            },
        )

    engine = VLLMEngine("http://vllm.test")
    engine._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    assert asyncio.run(engine.score([7, 8, 9])) == [-1.5, -0.25]


def _lora_server(loaded: set, routes: bool = True):
    """vLLM's answers for runtime LoRA (or, ``routes=False``, a server started without them)."""

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}] + [{"id": n} for n in sorted(loaded)]})
        if path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter") and not routes:
            return httpx.Response(404, json={"detail": "Not Found"})
        name = json.loads(request.content).get("lora_name")
        if path == "/v1/load_lora_adapter":
            loaded.add(name)
            return httpx.Response(200, text=f"Success: LoRA adapter '{name}' added successfully.")
        if path == "/v1/unload_lora_adapter":
            if name not in loaded:
                return httpx.Response(404, json={"error": {"message": f"The lora adapter '{name}' cannot be found."}})
            loaded.discard(name)
            return httpx.Response(200, text="Success")
        served = json.loads(request.content)["model"]
        return httpx.Response(
            200,
            json={"model": served, "choices": [{"token_ids": [5], "finish_reason": "length", "logprobs": None}]},
        )

    return handler


def test_a_vllm_server_without_runtime_lora_loading_is_refused_saying_how_to_start_it():
    engine = VLLMEngine("http://vllm.test")
    engine._client = httpx.AsyncClient(transport=httpx.MockTransport(_lora_server(set(), routes=False)))
    with pytest.raises(EngineRequestError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora"):
        asyncio.run(engine.check_adapters())


def test_a_restarted_vllm_server_lists_no_adapter_and_reads_as_the_base_until_it_is_loaded_again():
    loaded = {"policy-v7"}  # an earlier run's adapter
    engine = VLLMEngine("http://vllm.test")
    engine._client = httpx.AsyncClient(transport=httpx.MockTransport(_lora_server(loaded)))

    async def run():
        await engine.check_adapters()
        assert loaded == set() and await engine.get_weight_version() == 0  # the earlier run's, unloaded
        assert await engine.load_adapter("/w/v1-adapter", 1) == 1
        done = await engine.generate([1, 2], SamplingParams(max_new_tokens=1))
        assert done.weight_version == 1
        loaded.clear()  # the server restarted
        assert await engine.get_weight_version() == 0
        assert await engine.load_adapter("/w/v1-adapter", 1) == 1 and loaded == {"policy-v1"}

    asyncio.run(run())
