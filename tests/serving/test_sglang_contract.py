"""Every payload strop's SGLang client sends, checked field by field against SGLang 0.5.23's own request
structures (``sglang_0_5_23_requests.json``, read from the release's wheel by
``scripts/check_sglang_contract.py``, which names each structure's source file).

SGLang ignores a body key it does not know (msgspec ``extra_behavior="ignore"``) and rejects a value of
the wrong type: so an unknown key is a silent no-op and a wrong type a refused update. Both fail here.
A real SGLang server needs a GPU build; this is the part of the contract that runs on a laptop.
"""

import ast
import asyncio
import json
from pathlib import Path

import httpx
import pytest

from strop.engines.sglang import SGLangEngine
from strop.wire.buckets import Bucket
from strop.types import SamplingParams

CONTRACT = json.loads((Path(__file__).parent / "sglang_0_5_23_requests.json").read_text())
BY_ROUTE = {c["route"]: (name, c) for name, c in CONTRACT["classes"].items()}


def conforms(value, annotation: ast.expr) -> bool:
    """Whether a JSON value is accepted by a field of this (Python source) type annotation."""
    if isinstance(annotation, ast.Name):
        kind = annotation.id
        return {
            "str": isinstance(value, str),
            "int": isinstance(value, int) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
            "float": isinstance(value, (int, float)) and not isinstance(value, bool),
            "bytes": isinstance(value, str),
            "Any": True,
        }.get(kind, isinstance(value, dict))
    if isinstance(annotation, ast.Constant) and annotation.value is None:
        return value is None
    if isinstance(annotation, ast.Subscript):
        head = annotation.value.id if isinstance(annotation.value, ast.Name) else ast.unparse(annotation.value)
        args = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
        if head == "Optional":
            return value is None or conforms(value, args[0])
        if head == "Union":
            return any(conforms(value, a) for a in args)
        if head == "Annotated":
            return conforms(value, args[0])
        if head in ("List", "list"):
            return isinstance(value, list) and all(conforms(v, args[0]) for v in value)
        if head in ("Dict", "dict"):
            return isinstance(value, dict)
        if head == "Literal":
            return value in [a.value for a in args]
    raise AssertionError(f"annotation {ast.unparse(annotation)} not understood by this test")


def check_payload(route: str, body: dict | None) -> None:
    name, spec = BY_ROUTE[route]
    where = f"{name} ({spec['source']}, SGLang {CONTRACT['sglang_version']})"
    fields = spec["fields"]
    body = body or {}
    for key, value in body.items():
        assert key in fields, f"{route}: strop sends {key!r}, which {where} does not have (SGLang would ignore it)"
        annotation = ast.parse(fields[key]["annotation"], mode="eval").body
        assert conforms(value, annotation), (
            f"{route}: {key}={value!r} does not fit {fields[key]['annotation']} of {where}"
        )
    for key, field in fields.items():
        assert not field["required"] or key in body, f"{route}: {where} requires {key!r}, strop does not send it"


def recording_engine(answers: dict) -> tuple[SGLangEngine, list]:
    seen, held = [], {"weight_version": "default"}

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        seen.append((request.method, request.url.path, body))
        if (body or {}).get("weight_version") is not None:  # SGLang applies a version only when one is given
            held["weight_version"] = body["weight_version"]
        if request.url.path == "/model_info":
            return httpx.Response(200, json=dict(held))
        return httpx.Response(200, json=answers.get(request.url.path, {"success": True}))

    engine = SGLangEngine("http://sglang.test")
    engine._client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    return engine, seen


def every_call(engine: SGLangEngine):
    lone = Bucket(("model.embed_tokens.weight",), ("bfloat16",), ((10, 4),), flattened=False)
    flat = Bucket(("a", "b"), ("float32", "float32"), ((2, 2), (3,)), flattened=True)

    async def run():
        await engine.join_group("10.0.0.1", 29500, 1, 3, "nccl", "strop-sync-1-ab")
        await engine.pause("retract")
        await engine.begin_update()
        await engine.receive_bucket(lone, "strop-sync-1-ab", 7, last=False)
        await engine.receive_bucket(flat, "strop-sync-1-ab", 7, last=True)
        await engine.end_update(7)
        await engine.resume()
        await engine.receipt()
        await engine.leave_group("strop-sync-1-ab")
        await engine.load_weights("/w/v8", 8)
        await engine.generate(
            [1, 2, 3],
            SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=4, stop_token_ids=[2], seed=3),
            request_id="r1",
        )
        await engine.abort("r1")
        await engine.abort_all()

    asyncio.run(run())


ANSWERS = {
    "/update_weights_from_disk": {"success": True, "message": "ok"},
    "/generate": {
        "output_ids": [4],
        "meta_info": {
            "output_token_logprobs": [[-0.5, 4, None]],
            "finish_reason": {"type": "length"},
            "weight_version": "8",
        },
    },
}


def test_every_payload_the_sglang_client_sends_fits_sglangs_request_structures():
    engine, seen = recording_engine(ANSWERS)
    every_call(engine)
    engine.routes = True  # algo.routing_replay: /generate asks for the routed experts as well
    asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4)))
    assert seen[-1][1] == "/generate" and seen[-1][2]["return_routed_experts"] is True
    posted = [(path, body) for method, path, body in seen if method == "POST"]
    assert {p for p, _ in posted} >= {
        "/init_weights_update_group",
        "/pause_generation",
        "/begin_weight_update",
        "/update_weights_from_distributed",
        "/end_weight_update",
        "/continue_generation",
        "/destroy_weights_update_group",
        "/update_weights_from_disk",
        "/generate",
        "/abort_request",
    }
    for path, body in posted:
        check_payload(path, body)
    for method, path, _ in seen:
        assert method in BY_ROUTE.get(path, (None, {"methods": ["GET"]}))[1]["methods"], (method, path)


def test_the_update_payloads_carry_the_session_rules_sglang_needs():
    engine, seen = recording_engine(ANSWERS)
    every_call(engine)
    buckets = [b for _, p, b in seen if p == "/update_weights_from_distributed"]
    assert [b["load_format"] for b in buckets] == [None, "flattened_bucket"]
    # the version labels the weights with the last bucket only, and the radix cache is flushed with it
    # (SGLang's flush_cache defaults to true: left out, every bucket would flush)
    assert [(b["weight_version"], b["flush_cache"]) for b in buckets] == [(None, False), ("7", True)]
    paths = [p for _, p, _ in seen]
    assert (
        paths.index("/pause_generation")
        < paths.index("/begin_weight_update")
        < paths.index("/update_weights_from_distributed")
        < paths.index("/end_weight_update")
        < paths.index("/continue_generation")
    )
    # the version is read where SGLang 0.5.23 reports it
    assert ("GET", "/model_info", None) in seen


@pytest.mark.parametrize(
    "route, body, why",
    [
        (
            "/update_weights_from_distributed",
            {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]], "bucket_bytes": 4},
            "strop sends 'bucket_bytes', which",
        ),
        (
            "/update_weights_from_distributed",
            {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]], "weight_version": 7},
            "weight_version=7 does not fit Optional[str]",
        ),
        (
            "/init_weights_update_group",
            {"master_address": "h", "master_port": "1", "rank_offset": 1, "world_size": 2},
            "master_port='1' does not fit int",
        ),
        ("/pause_generation", {"mode": "keep"}, "does not fit Literal"),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"]}, "requires 'shapes'"),
    ],
)
def test_the_contract_check_catches_what_sglang_would_ignore_or_refuse(route, body, why):
    with pytest.raises(AssertionError, match=why.replace("[", r"\[").replace("]", r"\]")):
        check_payload(route, body)


def test_the_contract_is_sglang_0_5_23_read_from_its_wheel():
    assert CONTRACT["sglang_version"] == "0.5.23" and len(CONTRACT["wheel_sha256"]) == 64
    name, spec = BY_ROUTE["/update_weights_from_distributed"]
    assert spec["source"].endswith("io_struct.py") and name == "UpdateWeightsFromDistributedReqInput"
    assert spec["fields"]["flush_cache"]["default"] == "True" and spec["fields"]["names"]["required"]


def serving(routes: dict) -> SGLangEngine:
    """An SGLang client whose server answers ``routes`` ({path: (status, json)}) and 404 elsewhere."""

    def handle(request: httpx.Request) -> httpx.Response:
        status, body = routes.get(request.url.path, (404, {"detail": "Not Found"}))
        return httpx.Response(status, json=body)

    engine = SGLangEngine("http://sglang.test")
    engine._client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    return engine


@pytest.mark.parametrize(
    "info, why",
    [
        (
            {"version": "0.5.12", "tp_size": 1},
            r"http://sglang.test: SGLang 0.5.12 has no weight-update session .*"
            r"SGLang >= 0.5.23.* or use engine.sync=disk",
        ),
        (
            {"version": "0.5.23", "dp_size": 2},
            r"SGLang 0.5.23 runs dp_size=2.*one server per replica.*engine.sync=disk",
        ),
    ],
)
def test_a_server_that_cannot_take_the_broadcast_is_refused_naming_it_its_version_and_the_fallback(info, why):
    from strop.wire.errors import EngineRequestError

    with pytest.raises(EngineRequestError, match=why):
        asyncio.run(serving({"/server_info": (200, info)}).check_broadcast())


def test_a_tensor_parallel_server_joins_with_one_rank_per_worker_and_strop_serve_with_one():
    sglang = serving({"/server_info": (200, {"version": "0.5.23.post2", "tp_size": 4, "dp_size": 1})})
    asyncio.run(sglang.check_broadcast())
    strop_serve = serving({})  # no /server_info
    asyncio.run(strop_serve.check_broadcast())
    assert (sglang.group_ranks, strop_serve.group_ranks) == (4, 1)


def test_a_server_without_the_update_session_is_named_with_the_fallback():
    from strop.wire.errors import EngineRequestError

    with pytest.raises(EngineRequestError, match=r"http://sglang.test has no /begin_weight_update .*engine.sync=disk"):
        asyncio.run(serving({}).begin_update())
    with pytest.raises(EngineRequestError, match="begin_weight_update failed: a weight-update session is already open"):
        asyncio.run(
            serving(
                {
                    "/begin_weight_update": (
                        200,
                        {"success": False, "message": "a weight-update session is already open"},
                    )
                }
            ).begin_update()
        )


def test_the_runtime_adapter_payloads_fit_sglangs_lora_structures():
    """A LoRA run into SGLang (engine.sync=adapter): load each version's adapter, name it in every request,
    unload the older one; each body checked against SGLang 0.5.23's LoadLoRAAdapterReqInput,
    UnloadLoRAAdapterReqInput and GenerateReqInput."""
    listed = {"data": [{"id": "base"}]}
    answers = dict(ANSWERS)
    answers["/v1/models"] = listed
    answers["/generate"] = dict(
        ANSWERS["/generate"],
        meta_info=ANSWERS["/generate"]["meta_info"]
        | {"input_token_logprobs": [[None, 1, None], [-1.0, 2, None], [-2.0, 3, None]]},
    )
    engine, seen = recording_engine(answers)

    async def run():
        await engine.check_adapters()
        for version in (1, 2):
            listed["data"] = [{"id": "base"}, {"id": f"policy-v{version}"}]
            assert await engine.load_adapter(f"/w/v{version}-adapter", version, 2.0, "unused") == version
            done = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4), request_id=f"r{version}")
            assert done.weight_version == version  # the adapter's version, not the base's label ("8")
        await engine.score([1, 2, 3])

    asyncio.run(run())
    posted = [(path, body) for method, path, body in seen if method == "POST"]
    for path, body in posted:
        check_payload(path, body)
    loads = [b for p, b in posted if p == "/load_lora_adapter"]
    assert loads == [{"lora_name": f"policy-v{v}", "lora_path": f"/w/v{v}-adapter"} for v in (1, 2)]
    assert [b["lora_path"] for p, b in posted if p == "/generate"] == ["policy-v1", "policy-v2", "policy-v2"]
    # the older adapter unloaded once idle (after the start's probe of a name no one loaded)
    assert [b["lora_name"] for p, b in posted if p == "/unload_lora_adapter"] == ["policy-vnone", "policy-v1"]


@pytest.mark.parametrize(
    "info,why",
    [
        ({"version": "0.5.23", "enable_lora": False}, r"SGLang runs without LoRA \(enable_lora false\): start it with"),
        ({"enable_lora": True, "max_lora_rank": 8, "max_loaded_loras": 4}, "rank 8 at most, this run's are 16"),
        ({"enable_lora": True, "max_lora_rank": 16, "max_loaded_loras": 2}, "keeps 2 adapters loaded, this run may"),
    ],
)
def test_an_sglang_server_that_cannot_serve_the_runs_adapters_is_refused_at_start(info, why):
    from strop.wire.errors import EngineRequestError

    routes = {
        "/unload_lora_adapter": (400, {"success": False, "error_message": "policy-vnone is not loaded"}),
        "/v1/models": (200, {"data": [{"id": "m"}]}),
        "/server_info": (200, info),
    }
    with pytest.raises(EngineRequestError, match=why):
        asyncio.run(serving(routes).check_adapters(16, 3))
    # the same server with room for them, and strop serve (no /server_info), are taken
    ok = dict(routes, **{"/server_info": (200, {"enable_lora": True, "max_lora_rank": 16, "max_loaded_loras": 3})})
    asyncio.run(serving(ok).check_adapters(16, 3))
    asyncio.run(serving({k: v for k, v in routes.items() if k != "/server_info"}).check_adapters(16, 3))
