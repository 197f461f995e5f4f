"""``strop serve``: the embedded engine behind HTTP, speaking the subset of SGLang's native API
strop uses, plus OpenAI-compatible completions for agent code.

Routes (SGLang names and payloads, so one client serves both):
  POST /generate                {text | input_ids, sampling_params, return_logprob, rid}
  GET  /health, /health_generate, /get_weight_version, /model_info, /v1/models
  POST /abort_request {rid}, /flush_cache, /update_weights_from_disk {model_path, weight_version}
  POST /pause_generation {mode}, /continue_generation, /begin_weight_update, /end_weight_update
  POST /init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group
  POST /update_weight_version {new_version};  GET|POST /weights_checker {action: "checksum"}
  GET  /weights_manifest  (strop's own: the names, dtypes and shapes an update must carry)
  POST /tokenize {prompt, add_special_tokens}  (as SGLang and vLLM: {tokens, count, max_model_len})
  POST /v1/completions, /v1/chat/completions  (token ids, logprobs and up to 20 top logprobs included;
                                              echo; stream (a chunk per decoded token), stop, n)

A broadcast update, as SGLang 0.5.23 takes it: pause, begin, one update call per bucket (each
joins the trainer's broadcast on the group), end, continue. From begin to end no batch runs,
so no row decodes on half-updated weights.

Concurrent requests are batched by the engine. Access: open on 127.0.0.1 without a token;
with a token every route, /health included, needs ``Authorization: Bearer <token>`` (generation
routes and /health stay open with ``public_generate``); bound elsewhere it refuses to start without one.
Weights load from disk only from inside ``weights_dir``. A bad request gets a 4xx with a
message and fails alone (requests batched with it are answered); the server keeps serving. A
request body over ``max_body_bytes`` (16 MiB) is refused with 413 before any of it is parsed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterable, Callable, Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from strop.serving.embedded import PAUSE_MODES, EmbeddedEngine, RequestError
from strop.wire.auth import bearer_token_matches
from strop.wire.errors import EngineVersionError, parse_weight_version
from strop.wire.digest import state_checksum, tensor_digest
from strop.serving.textstream import StreamedText
from strop.openmp import release_threads, releasing
from strop.types import Completion, SamplingParams

LOOPBACK = ("127.0.0.1", "localhost", "::1")
GENERATION_ROUTES = ("/generate", "/health_generate", "/get_weight_version", "/model_info", "/v1/completions",
                     "/v1/chat/completions", "/v1/models", "/tokenize")  # opened to all by public_generate
MAX_N = 128  # choices per request
MAX_LOGPROBS = 20  # most likely tokens per position a request may ask for (vLLM's default max_logprobs)
MAX_BODY_BYTES = 16 << 20  # a request body; a longer one gets 413 (strop serve and the agent proxy)
log = logging.getLogger("strop.serve")

Seed = Annotated[int, Field(ge=0, lt=2**64)]  # what a torch.Generator takes (negative seeds refused)
StopString = Annotated[str, Field(min_length=1)]
Version = Annotated[int, Field(ge=0, lt=2**63)]  # "7" is read as 7; "default" is refused
Rid = Annotated[str, Field(max_length=512)]  # a request id is echoed back: a name, not a payload


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# SGLang sampling fields strop does not implement: accepted at the value that changes nothing
_NEUTRAL = {"min_new_tokens": 0, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
            "repetition_penalty": 1.0, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
            "logit_bias": None}


class SamplingBody(BaseModel):
    """SGLang's ``sampling_params``; fields SGLang has that strop does not know are ignored (logged)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=2**31 - 1)  # SGLang's "off" is -1; 0 is accepted as off too
    max_new_tokens: int = Field(128, gt=0, le=2**31 - 1)
    stop: StopString | list[StopString] | None = None
    stop_token_ids: list[int] | None = None
    sampling_seed: Seed | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    no_stop_trim: bool = False  # the text keeps a matched stop string (the token ids always do)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    min_new_tokens: int = 0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    logit_bias: dict | None = None

    @model_validator(mode="after")
    def _only_neutral(self):
        for name, neutral in _NEUTRAL.items():
            if getattr(self, name) not in (neutral, None, {}):
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported by strop serve (only {neutral!r})")
        return self


class GenerateBody(_Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingBody | list[SamplingBody] = Field(default_factory=SamplingBody)
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    logprob_start_len: int = Field(-1, ge=-1, description="with return_logprob: also the logprobs of the "
                                   "prompt's tokens from this index on (input_token_logprobs; -1: none)")
    top_logprobs_num: int = Field(0, ge=0, le=0)
    rid: Rid | list[Rid] | None = None
    stream: bool = False
    log_metrics: bool = True


class AbortBody(_Body):
    rid: Rid = ""
    abort_all: bool = False


class DiskUpdateBody(_Body):
    model_path: str = Field(min_length=1)
    weight_version: Version | None = None
    digests: dict[str, str] | None = None  # delta form: the file holds only these tensors, each checked
    load_format: Literal["auto", "safetensors"] | None = Field(
        None, description="strop serve reads safetensors only; other formats are refused, not ignored")
    flush_cache: bool = True  # strop serve keeps no KV cache between batches: there is nothing to flush
    abort_all_requests: bool = False


class GroupBody(_Body):
    master_address: str = Field(min_length=1)
    master_port: int = Field(gt=0, lt=65536)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2, le=4096)
    group_name: str = Field("weight_update_group", min_length=1, max_length=256)
    backend: Literal["gloo", "nccl"] = "gloo"

    @model_validator(mode="after")
    def _rank_in_world(self):
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} must be below world_size {self.world_size}")
        return self


class GroupNameBody(_Body):
    group_name: str = Field("weight_update_group", min_length=1, max_length=256)


Selector = Literal["target", "draft", "all"]  # SGLang's: the main model, its speculative draft model, or both


class DistributedUpdateBody(_Body):
    """SGLang 0.5.23's ``UpdateWeightsFromDistributedReqInput``: one bucket of whole tensors."""

    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True  # strop serve keeps no prefix cache: there is nothing to flush
    abort_all_requests: bool = False
    weight_version: StrictStr | StrictInt | None = None  # the client sends it with the last bucket only
    load_format: Literal["flattened_bucket"] | None = None
    selector: Selector = "all"
    torch_empty_cache: bool = False


class PauseBody(_Body):
    mode: Literal[PAUSE_MODES] = "abort"


class ContinueBody(_Body):
    torch_empty_cache: bool = True


class SessionBody(_Body):
    selector: Selector = "all"


class VersionBody(_Body):
    new_version: StrictStr | StrictInt
    abort_all_requests: bool = True  # SGLang's default


class CheckerBody(_Body):
    action: str = "checksum"


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore")  # (SGLang's and vLLM's clients may send model and more)
    prompt: StrictStr
    add_special_tokens: bool = True


class _OpenAIBody(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # OpenAI clients send many optional fields
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)  # vLLM's extension
    seed: Seed | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    stop: StopString | list[StopString] | None = None
    stream: bool | None = False
    stream_options: dict | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict | None = None
    model: str | None = None

    @model_validator(mode="after")
    def _only_neutral(self):
        for name in ("frequency_penalty", "presence_penalty", "logit_bias"):
            if getattr(self, name) not in (None, 0, 0.0, {}):
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported by strop serve")
        return self


class CompletionBody(_OpenAIBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0, le=2**31 - 1, description="0 (with echo): no generation, the "
                                   "prompt's logprobs only (lm-eval-harness's loglikelihood)")
    logprobs: int | None = Field(None, ge=0, description="the sampled tokens' logprobs and, per token, the logprobs "
                                 f"of this many most likely tokens (at most {MAX_LOGPROBS})")
    echo: bool | None = Field(False, description="the prompt before the text; with logprobs, the prompt tokens' "
                              "logprobs first (the first token's null)")
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _supported(self):
        if self.suffix or self.best_of not in (None, self.n or 1):
            raise ValueError("suffix and best_of (other than n) are not supported by strop serve")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing: it needs echo (the prompt and its logprobs)")
        return self


class ChatBody(_OpenAIBody):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, gt=0, le=2**31 - 1)
    max_completion_tokens: int | None = Field(None, gt=0, le=2**31 - 1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, description=f"with logprobs, the most likely tokens at each "
                                     f"position (at most {MAX_LOGPROBS})")
    response_format: dict | None = None

    @model_validator(mode="after")
    def _supported(self):
        if self.response_format not in (None, {"type": "text"}):
            raise ValueError("response_format other than {'type': 'text'} is not supported by strop serve")
        return self


def _error(status: int, message: str) -> JSONResponse:
    """OpenAI's error shape (the openai SDK reads ``error.message``); SGLang clients read the text."""
    kind = "invalid_request_error" if status < 500 else "internal_error"
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}})


def load_weights_dir(path: str, device, root: str | None = None) -> dict:
    """Every ``*.safetensors`` file of a folder (or one file) as one state dict, on ``device``.
    With ``root``, every file must resolve (symlinks and ``..`` followed) inside it."""
    from safetensors.torch import load_file

    def inside(f: Path) -> bool:
        return root is None or f.resolve().is_relative_to(Path(root).resolve())

    p = Path(root or ".", path).resolve()
    files = sorted(p.glob("*.safetensors")) if inside(p) and p.is_dir() else [p]
    if not all(inside(f) for f in files):
        raise PermissionError(f"{path!r} is outside the weights folder {root} (strop serve --weights-dir)")
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no safetensors weights at {path!r}")
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f), device=str(device)))
        except Exception as exc:  # safetensors' own error for a file that is not one
            raise ValueError(f"{f} is not a safetensors file: {exc}") from exc
    return state


def _check_state(state: dict, own: dict, digests: dict | None) -> None:
    """Names, shapes (and, delta form, digests) before anything is copied: a rejected load leaves
    the model as it was. Without ``digests`` every tensor of the model must be there."""
    unknown = [n for n in state if n not in own]
    shapes = [n for n in state if n in own and tuple(state[n].shape) != tuple(own[n].shape)]
    missing = sorted(set(digests) ^ set(state)) if digests is not None else sorted(set(own) - set(state))
    changed = [n for n in state if digests and n in digests and tensor_digest(state[n]) != digests[n]]
    for what, names in (("unknown tensors", unknown), ("wrong shapes", shapes), ("missing tensors", missing),
                        ("tensors not matching their checksum", changed)):
        if names:
            raise ValueError(f"{what}: {names[:5]}")


class BodyLimit:
    """ASGI wrapper: a request body (sized or chunked) is read whole, at most ``limit()`` bytes, before
    the app sees it; a longer one gets ``error(413, message)`` (a short message that repeats none of
    the input) and the rest is never read. strop serve and the agent proxy both use it."""

    def __init__(self, app, limit: Callable[[], int], error: Callable[[int, str], Any]):
        self.app, self.limit, self.error = app, limit, error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, body, more = self.limit(), bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                answer = self.error(413, f"the request body is over {limit} bytes")
                return await answer(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}
        return await self.app(scope, replay, send)


def create_app(engine: EmbeddedEngine, *, tokenizer=None, token: str | None = None, model_name: str = "strop",
               public_generate: bool = False, weights_dir: str | None = None, max_body_bytes: int = MAX_BODY_BYTES):
    """The FastAPI application around ``engine``. ``token``: needed on every route, /health included
    (generation routes and /health stay open with ``public_generate``). ``weights_dir``: the only folder
    /update_weights_from_disk reads (None: that route is refused). ``max_body_bytes``: a longer
    request body gets 413 on every route."""
    app = FastAPI(title="strop serve", docs_url=None, redoc_url=None, openapi_url=None)
    warned: set[str] = set()

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError):
        where = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return _error(400 if "json_invalid" in str(exc.errors()) else 422, where)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _engine_error(request: Request, exc: Exception):  # a bug or an engine fault, never the caller's
        log.exception("strop serve: %s failed", request.url.path)
        return _error(500, f"{type(exc).__name__}: {exc}")

    @app.middleware("http")
    async def _authorise(request: Request, call_next):
        path = request.url.path
        # /health too: it tells the weight version and whether an update runs (public_generate opens it with
        # the generation routes)
        if token is None or (public_generate and (path in GENERATION_ROUTES or path == "/health")):
            return await call_next(request)
        if not bearer_token_matches(request.headers.get("authorization", ""), token):
            return _error(401, f"{path} needs the server's token: 'Authorization: Bearer <token>'")
        return await call_next(request)

    def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if tokenizer is not None else ""

    def encode(text: str) -> list[int]:
        if tokenizer is None:
            raise HTTPException(status_code=400, detail="a text prompt needs a tokenizer; send token ids")
        return tokenizer(text, add_special_tokens=True)["input_ids"]

    def check_job(ids: list[int], sampling: SamplingParams, stops: list[str], top: int = 0) -> None:
        """Refuse (400) a generation the engine would refuse, before it starts (or a stream's first byte)."""
        if sampling.max_new_tokens >= engine.context_window:  # no prompt leaves room for it (a shorter
            # limit that runs past the window with this prompt ends there, finish reason "length")
            raise HTTPException(status_code=400, detail=f"max_new_tokens {sampling.max_new_tokens} is not below "
                                f"the context window ({engine.context_window} tokens)")
        if stops and tokenizer is None:
            raise HTTPException(status_code=400, detail="stop strings need a tokenizer; send stop_token_ids")
        try:
            engine.check(ids, sampling, top)
        except RequestError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc

    async def complete(ids: list[int], sampling: SamplingParams, rid: str | None, stops: list[str],
                       skip_special_tokens: bool = True, top: int = 0) -> tuple[Completion, str, str | None, list]:
        """One generation, cut after the first stop string: (completion, its text up to and
        without the stop string, the stop string matched, per token its ``top`` most likely
        alternatives ``{token_id: logprob}``, or None each when ``top`` is 0)."""
        check_job(ids, sampling, stops, top)
        heard: list = []  # per token (id, logprob, alternatives), as decoded
        try:
            out = await engine.generate(ids, sampling, request_id=rid, top_logprobs=top,
                                        on_token=(lambda *token: heard.append(token)) if top else None)
        except RequestError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        out, text, matched = cut_at_stops(out, stops, lambda ids: decode(ids, skip_special_tokens))
        tops = [alternatives for _, _, alternatives in heard] if top else [None] * len(out.token_ids)
        return out, text, matched, tops[: len(out.token_ids)]

    def sampling_of(temperature, top_p, top_k, max_new_tokens, stop_ids, seed) -> SamplingParams:
        return SamplingParams(temperature=1.0 if temperature is None else temperature,
                              top_p=1.0 if top_p is None else top_p, top_k=max(top_k or 0, 0),
                              max_new_tokens=max_new_tokens, stop_token_ids=list(stop_ids or []), seed=seed)

    def seeds(seed: int | None, n: int) -> list[int | None]:
        """One seed per choice: n choices of one seeded request differ, and repeat when asked again."""
        return [None if seed is None else (seed + i) % 2**64 for i in range(n)]

    @app.get("/health")
    async def health():  # answers while paused or updating (it never touches the model)
        return {"status": "ok", "weight_version": engine.weight_version, "paused": engine.paused,
                "updating": engine.updating}

    @app.get("/health_generate")
    async def health_generate():
        out = await engine.generate([engine.pad_token_id], SamplingParams(temperature=0, max_new_tokens=1))
        return {"status": "ok", "tokens": len(out.token_ids)}

    @app.get("/get_weight_version")
    async def weight_version():
        return {"weight_version": engine.weight_version}

    @app.get("/model_info")
    async def model_info():  # SGLang 0.5.23 reports the weight version here only
        return {"model_path": model_name, "weight_version": engine.weight_version}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "strop",
                                            "max_model_len": engine.context_window}]}

    @app.post("/generate")
    async def generate(body: GenerateBody):
        """SGLang's /generate: one prompt (text or ids) answers an object, a list of prompts (or
        ``n`` > 1) a list, in order (prompt-major)."""
        if body.stream:
            raise HTTPException(status_code=400, detail="stream=true is not supported by /generate; use "
                                "/v1/completions with stream=true")
        if (body.text is None) == (body.input_ids is None):
            raise HTTPException(status_code=400, detail="give exactly one of text and input_ids")
        batched = isinstance(body.text, list) or bool(body.input_ids and isinstance(body.input_ids[0], list))
        if body.text is not None:
            prompts = [encode(t) for t in (body.text if batched else [body.text])]
        else:
            prompts = body.input_ids if batched else [body.input_ids]
        sps = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params] * len(prompts)
        rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(prompts)
        if len(sps) != len(prompts) or len(rids) != len(prompts):
            raise HTTPException(status_code=400, detail=f"{len(prompts)} prompts, {len(sps)} sampling_params and "
                                f"{len(rids)} rids: give one each (or one for all)")
        for name in {f for sp in sps for f in (sp.model_extra or {})} - warned:
            warned.add(name)
            log.warning("strop serve: /generate ignores sampling_params.%s (not a field strop knows)", name)
        jobs = []
        for ids, sp, rid in zip(prompts, sps, rids):
            stop_ids = [-1] if sp.ignore_eos and not sp.stop_token_ids else sp.stop_token_ids  # -1: no default stops
            stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
            for i, seed in enumerate(seeds(sp.sampling_seed, sp.n)):
                sampling = sampling_of(sp.temperature, sp.top_p, sp.top_k, sp.max_new_tokens, stop_ids, seed)
                one_rid = rid if sp.n == 1 or rid is None else f"{rid}-{i}"
                jobs.append((ids, sp, one_rid or uuid.uuid4().hex, sampling, stops))
        outs = await asyncio.gather(*(complete(ids, s, rid, stops, sp.skip_special_tokens)
                                      for ids, sp, rid, s, stops in jobs))
        answers = []
        for (ids, sp, rid, _, _), (out, text, matched, _) in zip(jobs, outs):
            reason = {"type": out.finish_reason}
            if matched is not None:
                reason["matched"] = matched
            meta = {"id": rid, "finish_reason": reason, "prompt_tokens": len(ids),
                    "completion_tokens": len(out.token_ids), "weight_version": out.weight_version}
            if body.return_logprob:
                texts = [decode([t], False) for t in out.token_ids] if body.return_text_in_logprobs else None
                meta["output_token_logprobs"] = [[lp, t, texts[i] if texts else None]
                                                 for i, (lp, t) in enumerate(zip(out.logprobs or [], out.token_ids))]
                if body.logprob_start_len >= 0:  # SGLang's: the first token has no logprob (nothing before it)
                    scored = [None] + await engine.score(list(ids))
                    meta["input_token_logprobs"] = [[lp, t, None] for lp, t in
                                                    list(zip(scored, ids))[body.logprob_start_len:]]
            if matched is not None and sp.no_stop_trim:
                text = decode(out.token_ids, sp.skip_special_tokens)
            answers.append({"text": text, "output_ids": out.token_ids, "meta_info": meta})
        return answers if batched or len(answers) > 1 else answers[0]

    @app.post("/abort_request")
    async def abort_request(body: AbortBody):
        if body.abort_all:
            await engine.abort_all()
        elif body.rid:
            await engine.abort(body.rid)
        return {"success": True}

    @app.post("/flush_cache")
    async def flush_cache():
        return {"success": True}  # the embedded engine keeps no KV cache between batches

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: DiskUpdateBody):
        """Read, check and (after loading) checksum the weights in threads: requests in flight keep
        decoding while a large file loads."""
        if weights_dir is None:
            raise HTTPException(status_code=403, detail="update_weights_from_disk is off: start strop serve with "
                                "--weights-dir DIR (the folder the trainer writes weights to)")
        own = engine.model.state_dict()
        try:
            state = await asyncio.to_thread(releasing(load_weights_dir), body.model_path, engine.device, weights_dir)
            await asyncio.to_thread(releasing(_check_state), state, own, body.digests)
        except PermissionError as exc:
            raise HTTPException(status_code=403, detail=f"update_weights_from_disk: {exc}") from exc
        except (OSError, ValueError) as exc:
            raise HTTPException(status_code=400, detail=f"update_weights_from_disk: {exc}") from exc
        if body.abort_all_requests:
            await engine.abort_all()
        version = await engine.update_weights(state, version=body.weight_version, strict=body.digests is None)
        return {"success": True, "message": "weights loaded", "weight_version": version,
                "checksum": await asyncio.to_thread(releasing(state_checksum), state)}

    groups: dict[str, Any] = {}

    async def destroy(name: str) -> bool:
        """Forget a weight-sync group and tear it down (NCCL: abort; gloo frees its sockets when the
        last reference goes). A receive still blocked on it ends at the group's timeout."""
        from strop.wire.group import close_group

        group = groups.pop(name, None)
        if group is None:
            return False
        await asyncio.to_thread(close_group, group)
        return True

    @app.post("/init_weights_update_group")
    async def init_group(body: GroupBody):
        """Join the trainer's weight-sync group as rank ``rank_offset`` (returns once every rank
        joined), built as SGLang builds it. Groups joined before are torn down: one trainer, one
        live group (a reconnect); a weight-update session the previous trainer left open ends
        too (its buckets came through the old group), while a pause stays until /continue_generation."""
        from strop.wire.group import make_group

        for name in list(groups):
            await destroy(name)
        if engine.updating:
            log.warning("strop serve: a new weight update group ends the session the previous trainer left open")
            try:
                engine.end_update()
            except RequestError:  # still opening (a batch is finishing): the new trainer's begin is refused
                pass
        try:
            group = await asyncio.to_thread(make_group, body.master_address, body.master_port, body.rank_offset,
                                            body.world_size, body.backend, name=body.group_name)
        except (RuntimeError, ValueError, OSError) as exc:
            raise HTTPException(status_code=400, detail=f"init_weights_update_group: {exc}") from exc
        groups[body.group_name] = group
        return {"success": True, "message": f"joined {body.group_name} as rank {body.rank_offset}"}

    @app.post("/destroy_weights_update_group")
    async def destroy_group(body: GroupNameBody):
        """Tear down a weight-sync group (the trainer's reconnect); no such group is no error."""
        found = await destroy(body.group_name)
        return {"success": True, "message": f"{'destroyed' if found else 'no'} group {body.group_name}"}

    def version_of(value, where: str) -> int:
        try:
            return parse_weight_version(value, where)
        except EngineVersionError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc

    def only_target(selector: str, where: str) -> None:
        if selector == "draft":
            raise HTTPException(status_code=400, detail=f"{where}: selector 'draft': strop serve has no draft model")

    def empty_cache(asked: bool) -> None:
        import torch

        if asked and engine.device.type == "cuda":
            torch.cuda.empty_cache()

    @app.post("/pause_generation")
    async def pause_generation(body: PauseBody | None = None):
        """SGLang's pause: no batch runs until /continue_generation, new requests wait. Only
        /continue_generation ends it (no deadline: see :meth:`EmbeddedEngine.pause`)."""
        mode = (body or PauseBody()).mode
        await engine.pause(mode)
        return {"message": f"generation paused ({mode})", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(body: ContinueBody | None = None):
        engine.resume()
        empty_cache((body or ContinueBody()).torch_empty_cache)
        return {"message": "generation continued", "status": "ok"}

    @app.post("/begin_weight_update")
    async def begin_weight_update(body: SessionBody | None = None):
        """Open a weight-update session: from now to /end_weight_update no batch runs (a batch
        running unpaused finishes first). One session at a time: a second begin is refused."""
        only_target((body or SessionBody()).selector, "begin_weight_update")
        try:
            await engine.begin_update()
        except RequestError as exc:
            raise HTTPException(status_code=400, detail=f"begin_weight_update: {exc}") from exc
        return {"success": True, "message": "weight update begun"}

    @app.post("/end_weight_update")
    async def end_weight_update(body: SessionBody | None = None):
        try:
            digest = engine.end_update()
        except RequestError as exc:
            raise HTTPException(status_code=400, detail=f"end_weight_update: {exc}") from exc
        # (strop's own field, the session's receipt: a digest of every byte received, in order)
        return {"success": True, "message": "weight update ended", "checksum": digest}

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(body: DistributedUpdateBody):
        """Receive one bucket the trainer broadcasts, inside a session. Everything is checked
        (session, names, dtypes, shapes, version, group) before the broadcast is joined: a refused
        bucket moves no byte. A broadcast that fails (the trainer died, the group timed out)
        answers 500 with the cause; the bucket's tensors may then be partly written, the version
        is unchanged and the session stays open until /end_weight_update (or a new group)."""
        from strop.wire.buckets import Bucket, first_mismatch, manifest_of

        where = "update_weights_from_distributed"
        if not engine.updating:
            raise HTTPException(status_code=400, detail=f"{where} must run between begin_weight_update() and "
                                "end_weight_update()")
        only_target(body.selector, where)
        try:
            bucket = Bucket.from_payload(body.names, body.dtypes, body.shapes, body.load_format)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=f"{where}: {exc}") from exc
        sent = list(zip(bucket.names, bucket.dtypes, bucket.shapes))
        held = [m for m in manifest_of(engine.model.state_dict()) if m[0] in bucket.names]
        wrong = first_mismatch(sent, held, "strop serve")
        if wrong is not None:
            raise HTTPException(status_code=400, detail=f"{where}: {wrong}; nothing was received")
        version = None if body.weight_version is None else version_of(body.weight_version, where)
        group = groups.get(body.group_name)
        if group is None:
            raise HTTPException(status_code=400, detail=f"{where}: no weight update group {body.group_name!r}: "
                                "call /init_weights_update_group first")
        if body.abort_all_requests:
            await engine.abort_all()
        try:
            await engine.receive_bucket(group, bucket)
        except RequestError as exc:
            raise HTTPException(status_code=400, detail=f"{where}: {exc}") from exc
        except Exception as exc:  # the collective failed: a peer is gone or the group timed out
            log.warning("strop serve: broadcast on %s failed: %s", body.group_name, exc)
            raise HTTPException(status_code=500, detail=f"{where}: the broadcast on group {body.group_name!r} "
                                f"failed ({type(exc).__name__}: {exc}); the weights may be partly updated, the "
                                f"version is still {engine.weight_version}") from exc
        out = {"success": True, "message": f"received {len(bucket.names)} tensors"}
        if version is not None:
            engine.weight_version = out["weight_version"] = version
        empty_cache(body.torch_empty_cache)
        return out

    @app.post("/update_weight_version")
    async def update_weight_version(body: VersionBody):
        """SGLang's relabel: the version changes, the weights do not (by default every request is
        aborted first, as SGLang does)."""
        version = version_of(body.new_version, "update_weight_version")
        if body.abort_all_requests:
            await engine.abort_all()
        engine.weight_version = version
        return {"success": True, "message": f"weight version set to {version}", "weight_version": version}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):  # a client compares tokenizers by it (a distillation teacher's)
        if tokenizer is None:
            raise HTTPException(status_code=400, detail="/tokenize needs a tokenizer (start with a model folder)")
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.context_window}

    @app.get("/weights_manifest")
    async def weights_manifest():
        """The model's tensors, each once (aliases dropped): a trainer compares its own before it
        sends anything."""
        from strop.wire.buckets import manifest_of

        manifest = manifest_of(engine.model.state_dict())
        return {"names": [n for n, _, _ in manifest], "dtypes": [d for _, d, _ in manifest],
                "shapes": [list(s) for _, _, s in manifest]}

    @app.api_route("/weights_checker", methods=["GET", "POST"])
    async def weights_checker(body: CheckerBody | None = None):
        """The checksum of the weights held (state_checksum over the manifest's tensors), to
        compare with the trainer's of what it sent."""
        action = (body or CheckerBody()).action
        if action != "checksum":
            raise HTTPException(status_code=400, detail=f"weights_checker: action {action!r} is not supported by "
                                "strop serve (only 'checksum')")
        return {"success": True, "checksum": await engine.weights_checksum(), "weight_version": engine.weight_version}

    def stops_of(body: _OpenAIBody) -> list[str]:
        return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])

    def openai_jobs(prompts: list[list[int]], body: _OpenAIBody, max_tokens: int) -> list[tuple[int, SamplingParams]]:
        """n jobs per prompt (prompt-major, as OpenAI numbers choices): [(prompt index, sampling)]."""
        return [(p, sampling_of(body.temperature, body.top_p, body.top_k, max_tokens, None, seed))
                for p in range(len(prompts)) for seed in seeds(body.seed, body.n or 1)]

    async def openai_choices(prompts: list[list[int]], body: _OpenAIBody, max_tokens: int, top: int = 0):
        """n choices per prompt: [(prompt index, completion, text, top alternatives per token)]."""
        jobs = openai_jobs(prompts, body, max_tokens)
        outs = await asyncio.gather(*(complete(prompts[p], s, None, stops_of(body), top=top) for p, s in jobs))
        return [(p, out, text, tops) for (p, _), (out, text, _, tops) in zip(jobs, outs)]

    def finish(out: Completion) -> str:
        return "length" if out.finish_reason == "abort" else out.finish_reason  # OpenAI has no "abort"

    def usage(prompts, completion_tokens: int) -> dict:
        prompt = sum(len(p) for p in prompts)
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens}

    def include_usage(body: _OpenAIBody) -> bool:
        return bool((body.stream_options or {}).get("include_usage"))

    def at_most_max_logprobs(name: str, n: int | None) -> None:
        if n is not None and n > MAX_LOGPROBS:  # (vLLM's max_logprobs refusal: 400)
            raise HTTPException(status_code=400, detail=f"{name}: {n} is above {MAX_LOGPROBS}, the most likely "
                                "tokens per position strop serve returns at most")

    def token_text(t: int) -> str:
        return decode([t], False) if tokenizer is not None else str(t)

    def completion_logprobs(ids: list[int], logprobs: list, tops: list, offset: int = 0) -> dict:
        """OpenAI's (and vLLM's) completion logprobs: per token its text, its logprob, a dict of the
        token and its most likely alternatives by text (None where a token has no logprob: an
        echoed prompt's first), and its offset in the text (cumulative token lengths from ``offset``)."""
        tokens = [token_text(t) for t in ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        top = [None if lp is None else {token: _json_logprob(lp), **{token_text(a): _json_logprob(v)
                                                                      for a, v in (alternatives or {}).items()}}
               for token, lp, alternatives in zip(tokens, logprobs, tops)]
        return {"tokens": tokens, "token_logprobs": [None if lp is None else _json_logprob(lp) for lp in logprobs],
                "top_logprobs": top, "text_offset": offsets}

    def chat_logprobs(ids: list[int], logprobs: list[float], tops: list) -> dict:
        """OpenAI's chat logprobs: per token its text, bytes, logprob and its most likely tokens, most likely first."""
        def entry(t: int, lp: float) -> dict:
            text = token_text(t)
            return {"token": text, "logprob": _json_logprob(lp), "bytes": list(text.encode())}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in (alternatives or {}).items()],
                             "token_id": t} for t, lp, alternatives in zip(ids, logprobs, tops)]}

    async def prompt_scores(ids: list[int], temperature: float | None, top: int) -> tuple[list, list]:
        """An echoed prompt's logprobs and alternatives, one per token (the first None: nothing before it)."""
        try:
            logprobs, tops = await engine.prompt_logprobs(ids, 1.0 if temperature is None else temperature, top)
        except RequestError as exc:
            raise HTTPException(status_code=400, detail=f"prompt: {exc}") from exc
        return [None, *logprobs], [None, *tops]

    async def streamed(prompts: list[list[int]], jobs: list[tuple[int, SamplingParams]], stops: list[str],
                       top: int):
        """Run ``jobs`` and yield, as the engine decodes them, ``(job, token_id, logprob, alternatives,
        text)`` per token, then ``(job, None, finish_reason, None, text)`` once per job: the tokens
        and text (through ``text``, the new text each carries) are those of the same request
        unstreamed. Text that could still turn out to be the start of a stop string, or an
        unfinished character, waits for the tokens after it. A job whose text reaches a stop string
        ends there (its engine request is aborted); every job still running when the client goes
        away is aborted."""
        queue: asyncio.Queue = asyncio.Queue()
        rids = [f"stream-{uuid.uuid4().hex}" for _ in jobs]

        async def run(j: int, ids: list[int], sampling: SamplingParams) -> None:
            try:
                out = await engine.generate(ids, sampling, rids[j], top_logprobs=top,
                                            on_token=lambda *token: queue.put_nowait((j, token)))
            except Exception as exc:  # ends the stream with an error event
                out = exc
            queue.put_nowait((j, out))

        tasks = [asyncio.ensure_future(run(j, prompts[p], s)) for j, (p, s) in enumerate(jobs)]
        texts = [StreamedText(decode, stops) for _ in jobs]  # each token decoded once (strop.serving.textstream)
        sent = [0] * len(jobs)  # characters of each job's text sent so far
        running = set(range(len(jobs)))
        try:
            while running:
                j, item = await queue.get()
                if j not in running:  # (tokens decoded after the job's stop string)
                    continue
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Completion):  # the request ended (every token was heard before)
                    # the whole answer decoded once, beside the loop: its text is the unstreamed answer's
                    _, text, matched = await asyncio.to_thread(cut_at_stops, item, stops, decode)
                    running.discard(j)
                    sent_text = texts[j].text[: sent[j]]
                    if not text.startswith(sent_text):  # (a tokenizer whose decoding is not prefix-stable)
                        log.warning("strop serve: a streamed answer's text, decoded token by token, is not a "
                                    "prefix of its whole decoding: the stream's text differs from the answer's")
                    yield j, None, "stop" if matched else finish(item), None, text[len(sent_text):]
                    continue
                token, logprob, alternatives = item
                texts[j].push(token)
                ready = texts[j].ready
                new = texts[j].text[sent[j]: ready]
                sent[j] = max(sent[j], ready)
                if texts[j].stop_at is not None:  # as cut_at_stops cuts the whole answer: before the stop string
                    running.discard(j)
                    await engine.abort(rids[j])
                    yield j, token, logprob, alternatives, new
                    yield j, None, "stop", None, ""
                    continue
                yield j, token, logprob, alternatives, new
        finally:  # the client went away or the stream failed: nothing decodes for nobody
            for j in running:
                await engine.abort(rids[j])
            tasks.clear()  # (each ends on its own once aborted)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        at_most_max_logprobs("logprobs", body.logprobs)
        p = body.prompt
        batched = bool(p) and not isinstance(p, str) and not isinstance(p[0], int)
        texts = list(p) if batched else [p]  # each a text or token ids
        prompts = [encode(x) if isinstance(x, str) else x for x in texts]
        top = body.logprobs or 0
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        scores = None
        if body.echo and body.logprobs is not None:  # the prompt's logprobs (lm-eval-harness's loglikelihood)
            scores = await asyncio.gather(*(prompt_scores(ids, body.temperature, top) for ids in prompts))

        def echoed(p: int) -> str:
            return texts[p] if isinstance(texts[p], str) else decode(prompts[p], False)

        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
        if max_tokens == 0:  # echo alone (checked by CompletionBody): the prompt, nothing generated
            choices = [(p, Completion([], [], "length", engine.weight_version), "", [])
                       for p, _ in openai_jobs(prompts, body, 1)]
        elif not body.stream:
            choices = await openai_choices(prompts, body, max_tokens, top)
        else:
            return stream_completions(body, head, prompts, scores, max_tokens, echoed)
        out_choices = []
        for i, (p, out, text, tops) in enumerate(choices):
            choice = {"index": i, "text": (echoed(p) if body.echo else "") + text, "finish_reason": finish(out),
                      "logprobs": None, "token_ids": out.token_ids, "prompt_token_ids": prompts[p]}
            if body.logprobs is not None:
                ids, logprobs, alternatives = out.token_ids, out.logprobs or [], tops
                if scores is not None:
                    ids, logprobs, alternatives = (prompts[p] + ids, scores[p][0] + logprobs, scores[p][1] + tops)
                choice["logprobs"] = completion_logprobs(ids, logprobs, alternatives)
            out_choices.append(choice)
        used = usage(prompts, sum(len(out.token_ids) for _, out, _, _ in choices))
        if not body.stream:
            return {**head, "choices": out_choices, "usage": used}
        # (an echo with nothing generated, streamed: one chunk per choice)
        return sse([{**head, "choices": [c]} for c in out_choices]
                   + ([{**head, "choices": [], "usage": used}] if include_usage(body) else []))

    def stream_completions(body: CompletionBody, head: dict, prompts, scores, max_tokens: int,
                           echoed) -> StreamingResponse:
        jobs = openai_jobs(prompts, body, max_tokens)
        stops, top = stops_of(body), body.logprobs or 0
        for p, s in jobs:
            check_job(prompts[p], s, stops, top)

        async def chunks():
            offsets, done = [0] * len(jobs), 0  # offsets: each choice's text so far, as its tokens spell it
            for i, (p, _) in enumerate(jobs):  # an echoed prompt first, as its own chunk
                if body.echo:
                    logprobs = None if scores is None else completion_logprobs(prompts[p], *scores[p])
                    if logprobs is not None:
                        offsets[i] = sum(len(t) for t in logprobs["tokens"])
                    yield {**head, "choices": [{"index": i, "text": echoed(p), "finish_reason": None,
                                                "logprobs": logprobs, "prompt_token_ids": prompts[p]}]}
            async for i, token, logprob, alternatives, text in streamed(prompts, jobs, stops, top):
                choice = {"index": i, "text": text, "finish_reason": None, "logprobs": None}
                if token is None:
                    choice["finish_reason"] = logprob
                else:
                    done += 1
                    choice["token_ids"] = [token]
                    if body.logprobs is not None:
                        choice["logprobs"] = completion_logprobs([token], [logprob], [alternatives], offsets[i])
                        offsets[i] += len(choice["logprobs"]["tokens"][0])
                yield {**head, "choices": [choice]}
            if include_usage(body):
                yield {**head, "choices": [], "usage": usage(prompts, done)}
        return sse(chunks())

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody):
        if tokenizer is None:
            raise HTTPException(status_code=400, detail="chat completions need a tokenizer (start with a model folder)")
        at_most_max_logprobs("top_logprobs", body.top_logprobs)
        if body.top_logprobs and not body.logprobs:  # (vLLM's refusal)
            raise HTTPException(status_code=400, detail="top_logprobs needs logprobs: true")
        messages = [_text_message(i, m) for i, m in enumerate(body.messages)]
        try:
            ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))
        except Exception as exc:  # the template rejected the messages: the caller's input
            raise HTTPException(status_code=400, detail=f"messages: {exc}") from exc
        limit = body.max_completion_tokens or body.max_tokens or 128
        top = (body.top_logprobs or 0) if body.logprobs else 0
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "created": created, "model": model_name}
        if body.stream:
            return stream_chat(body, {**head, "object": "chat.completion.chunk"}, ids, limit, top)
        choices = await openai_choices([ids], body, limit, top)
        used = usage([ids], sum(len(out.token_ids) for _, out, _, _ in choices))
        return {**head, "object": "chat.completion", "usage": used, "choices": [
            {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish(out),
             "logprobs": chat_logprobs(out.token_ids, out.logprobs or [], tops) if body.logprobs else None,
             "token_ids": out.token_ids, "prompt_token_ids": ids} for i, (_, out, text, tops) in enumerate(choices)]}

    def stream_chat(body: ChatBody, head: dict, ids: list[int], limit: int, top: int) -> StreamingResponse:
        jobs = openai_jobs([ids], body, limit)
        stops = stops_of(body)
        for _, s in jobs:
            check_job(ids, s, stops, top)

        async def chunks():
            done = 0
            for i in range(len(jobs)):
                yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "finish_reason": None}]}
            async for i, token, logprob, alternatives, text in streamed([ids], jobs, stops, top):
                if token is None:
                    yield {**head, "choices": [{"index": i, "delta": {"content": text} if text else {},
                                                "finish_reason": logprob}]}
                    continue
                done += 1
                yield {**head, "choices": [{"index": i, "delta": {"content": text}, "finish_reason": None,
                                            "logprobs": chat_logprobs([token], [logprob], [alternatives])
                                            if body.logprobs else None, "token_ids": [token]}]}
            if include_usage(body):
                yield {**head, "choices": [], "usage": usage([ids], done)}
        return sse(chunks())

    # outermost: a body over the limit is refused before anything (authorisation included) reads it
    app.add_middleware(BodyLimit, limit=lambda: max_body_bytes, error=_error)
    return app


def _json_logprob(logprob: float) -> float:
    return max(logprob, -9999.0)  # -inf is no JSON number; OpenAI and vLLM send -9999.0


def sse(chunks: Iterable[dict] | AsyncIterable[dict]) -> StreamingResponse:
    """Server-sent events, one per chunk as it comes (a list, or an async iterator whose chunks are
    sent as they are made), then ``[DONE]``. An iterator that fails ends the stream with an error
    event (OpenAI's error shape), as vLLM's does: the status line went out with the first chunk."""
    async def events():
        try:
            if isinstance(chunks, AsyncIterable):
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk)}\n\n"
            else:
                for chunk in chunks:
                    yield f"data: {json.dumps(chunk)}\n\n"
        except Exception as exc:
            log.warning("strop serve: a stream failed: %s: %s", type(exc).__name__, exc)
            status = 400 if isinstance(exc, RequestError) else 500
            yield f"data: {json.dumps({'error': {'message': f'{type(exc).__name__}: {exc}', 'code': status}})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def cut_at_stops(out: Completion, stops: list[str], decode) -> tuple[Completion, str, str | None]:
    """``out`` cut after the first of ``stops`` its text holds: (completion, its text up to and
    without the stop string, the stop string matched or None). The tokens keep the stop string
    (and their logprobs stay paired with them); the text does not."""
    text = decode(out.token_ids)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return out, text, None
    _, matched = min(hits)
    keep = _tokens_through(lambda k: any(s in decode(out.token_ids[:k]) for s in stops), len(out.token_ids))
    cut = Completion(out.token_ids[:keep], (out.logprobs or [])[:keep], "stop", out.weight_version)
    text = decode(cut.token_ids)
    return cut, text[: min(text.find(s) for s in stops if s in text)], matched


def _tokens_through(contains, n: int) -> int:
    """The fewest leading tokens whose text ``contains`` a stop string (``contains(n)`` holds):
    a binary search, as the decoded prefix only grows."""
    lo, hi = 1, n
    while lo < hi:
        mid = (lo + hi) // 2
        if contains(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _text_message(i: int, message: dict) -> dict:
    """A chat message with its content as one string (OpenAI's list of text parts joined)."""
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise HTTPException(status_code=400, detail=f"messages[{i}].content: only text parts are supported")
        message = {**message, "content": "".join(p["text"] for p in content)}
    elif content is not None and not isinstance(content, str):
        raise HTTPException(status_code=400, detail=f"messages[{i}].content must be a string or a list of text parts")
    return message


def serve(model_path: str, *, host: str = "127.0.0.1", port: int = 30000, token: str | None = None,
          public_generate: bool = False, weights_dir: str | None = None, max_batch_size: int = 64, seed: int = 0,
          device: str = "auto", dtype: str = "float32", batch_wait_ms: float = 5.0, fast_decode: bool = True) -> None:
    """Load the model and serve until stopped (SIGINT / SIGTERM)."""
    import torch
    import uvicorn

    from strop.cluster.process import resolve_device
    from strop.models import load_model, load_tokenizer, resolve_model_path

    if host not in LOOPBACK and not token:
        raise ValueError(f"--host {host} is reachable from other machines: pass --token (or STROP_SERVE_TOKEN) so "
                         "every route needs it")
    if public_generate and not token:
        raise ValueError("--public-generate needs --token (without one every route is open already)")
    path = resolve_model_path(model_path)
    tokenizer = load_tokenizer(path)
    model = load_model(path, dtype=getattr(torch, dtype)).to(resolve_device(device)).requires_grad_(False)
    stop = sorted({tokenizer.eos_token_id, tokenizer.pad_token_id} - {None})
    context = int(getattr(model.config, "max_position_embeddings", 2048))
    engine = EmbeddedEngine(model, pad_token_id=tokenizer.pad_token_id, default_stop_token_ids=stop,
                            max_batch_size=max_batch_size, context_window=context, seed=seed,
                            batch_wait_s=batch_wait_ms / 1000, fast_decode=fast_decode)
    app = create_app(engine, tokenizer=tokenizer, token=token, model_name=model_path, public_generate=public_generate,
                     weights_dir=weights_dir)
    print(f"strop serve: {model_path} on http://{host}:{port} (device {engine.device}; "
          f"{engine.decode_path})", flush=True)
    release_threads()  # this thread runs the event loop from here on; the engine's thread decodes (strop.openmp)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
