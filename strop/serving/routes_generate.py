"""strop serve's SGLang-native routes: /generate, /abort_request, /health, /health_generate,
/get_weight_version, /model_info, /tokenize, /flush_cache (SGLang's names and payloads, so one client
serves both), over the one :class:`strop.serving.service.ServeService`."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field, StrictStr, model_validator

from strop.serving.openai import MAX_N, Seed, StopString
from strop.serving.service import StrictBody, sampling_of, seeds, service_of
from strop.types import SamplingParams
from strop.wire.routes import sglang_routes

log = logging.getLogger("strop.serve")
router = APIRouter()

Rid = Annotated[str, Field(max_length=512)]  # a request id is echoed back: a name, not a payload


# SGLang sampling fields strop does not implement: accepted at the value that changes nothing
_NEUTRAL = {
    "min_new_tokens": 0,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
}


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


class GenerateBody(StrictBody):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingBody | list[SamplingBody] = Field(default_factory=SamplingBody)
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    logprob_start_len: int = Field(
        -1,
        ge=-1,
        description="with return_logprob: also the logprobs of the "
        "prompt's tokens from this index on (input_token_logprobs; -1: none)",
    )
    top_logprobs_num: int = Field(0, ge=0, le=0)
    rid: Rid | list[Rid] | None = None
    stream: bool = False
    log_metrics: bool = True
    lora_path: str | None = Field(None, description="SGLang's: the adapter to decode with, by name: the one merged")
    return_routed_experts: bool = Field(
        False,
        description="SGLang's: meta_info.routed_experts, the experts each token was routed to (strop.wire.routes)",
    )
    routed_experts_start_len: int = Field(0, ge=0, description="with return_routed_experts: from this prompt token on")


class AbortBody(StrictBody):
    rid: Rid = ""
    abort_all: bool = False


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore")  # (SGLang's and vLLM's clients may send model and more)
    prompt: StrictStr
    add_special_tokens: bool = True


@router.get("/health")
async def health(request: Request):  # answers while paused or updating (it never touches the model)
    engine = service_of(request).engine
    return {
        "status": "ok",
        "weight_version": engine.weight_version,
        "paused": engine.paused,
        "updating": engine.updating,
    }


@router.get("/health_generate")
async def health_generate(request: Request):
    engine = service_of(request).engine
    out = await engine.generate([engine.pad_token_id], SamplingParams(temperature=0, max_new_tokens=1))
    return {"status": "ok", "tokens": len(out.token_ids)}


@router.get("/get_weight_version")
async def weight_version(request: Request):
    engine = service_of(request).engine
    return {"weight_version": engine.weight_version}


@router.get("/model_info")
async def model_info(request: Request):  # SGLang 0.5.23 reports the weight version here only
    svc = service_of(request)
    return {"model_path": svc.model_name, "weight_version": svc.engine.weight_version}


@router.post("/generate")
async def generate(body: GenerateBody, request: Request):
    """SGLang's /generate: one prompt (text or ids) answers an object, a list of prompts (or
    ``n`` > 1) a list, in order (prompt-major)."""
    svc = service_of(request)
    engine, decode, warned = svc.engine, svc.decode, svc.warned
    if body.stream:
        raise HTTPException(
            status_code=400, detail="stream=true is not supported by /generate; use /v1/completions with stream=true"
        )
    if (body.text is None) == (body.input_ids is None):
        raise HTTPException(status_code=400, detail="give exactly one of text and input_ids")
    if body.lora_path is not None and body.lora_path != svc.lora_name:  # (one adapter at a time: merged)
        raise HTTPException(
            status_code=400,
            detail=f"lora_path {body.lora_path[:100]!r} is not the adapter this server decodes with "
            f"({svc.lora_name!r}): strop serve merges one adapter at a time, the one loaded last",
        )
    batched = isinstance(body.text, list) or bool(body.input_ids and isinstance(body.input_ids[0], list))
    if body.text is not None:
        prompts = [svc.encode(t) for t in (body.text if batched else [body.text])]
    else:
        prompts = body.input_ids if batched else [body.input_ids]
    check_routes_asked(body, engine, prompts)
    sps = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params] * len(prompts)
    rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(prompts)
    if len(sps) != len(prompts) or len(rids) != len(prompts):
        raise HTTPException(
            status_code=400,
            detail=f"{len(prompts)} prompts, {len(sps)} sampling_params and "
            f"{len(rids)} rids: give one each (or one for all)",
        )
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
    outs = await asyncio.gather(
        *(svc.complete(ids, s, rid, stops, sp.skip_special_tokens) for ids, sp, rid, s, stops in jobs)
    )
    answers = []
    for (ids, sp, rid, _, _), (out, text, matched, _) in zip(jobs, outs):
        reason = {"type": out.finish_reason}
        if matched is not None:
            reason["matched"] = matched
        meta = {
            "id": rid,
            "finish_reason": reason,
            "prompt_tokens": len(ids),
            "completion_tokens": len(out.token_ids),
            "weight_version": out.weight_version,
        }
        if body.return_logprob:
            texts = [decode([t], False) for t in out.token_ids] if body.return_text_in_logprobs else None
            meta["output_token_logprobs"] = [
                [lp, t, texts[i] if texts else None] for i, (lp, t) in enumerate(zip(out.logprobs or [], out.token_ids))
            ]
            if body.logprob_start_len >= 0:  # SGLang's: the first token has no logprob (nothing before it)
                scored = [None] + await engine.score(list(ids))
                meta["input_token_logprobs"] = [
                    [lp, t, None] for lp, t in list(zip(scored, ids))[body.logprob_start_len :]
                ]
        if body.return_routed_experts and out.routed_experts is not None:  # (none: aborted before any forward)
            meta["routed_experts"] = sglang_routes(out.routed_experts, body.routed_experts_start_len)
        if matched is not None and sp.no_stop_trim:
            text = decode(out.token_ids, sp.skip_special_tokens)
        answers.append({"text": text, "output_ids": out.token_ids, "meta_info": meta})
    return answers if batched or len(answers) > 1 else answers[0]


def check_routes_asked(body: GenerateBody, engine, prompts: list[list[int]]) -> None:
    """Refuse ``return_routed_experts`` where no routes are recorded, or a start past a prompt (SGLang's bound)."""
    if not body.return_routed_experts:
        return
    if not engine.records_routes:
        raise HTTPException(
            status_code=400,
            detail="return_routed_experts: this server records no routed experts (its model has none that strop's "
            "decoder runs: a Qwen3-MoE model on the fast decoder records them)",
        )
    shortest = min(len(p) for p in prompts)
    if body.routed_experts_start_len > shortest:
        raise HTTPException(
            status_code=400,
            detail=f"routed_experts_start_len={body.routed_experts_start_len} is past a {shortest}-token prompt",
        )


@router.post("/abort_request")
async def abort_request(body: AbortBody, request: Request):
    engine = service_of(request).engine
    if body.abort_all:
        await engine.abort_all()
    elif body.rid:
        await engine.abort(body.rid)
    return {"success": True}


@router.post("/flush_cache")
async def flush_cache():
    return {"success": True}  # the embedded engine keeps no KV cache between batches


@router.post("/tokenize")
async def tokenize(
    body: TokenizeBody, request: Request
):  # a client compares tokenizers by it (a distillation teacher's)
    svc = service_of(request)
    engine, tokenizer = svc.engine, svc.tokenizer
    if tokenizer is None:
        raise HTTPException(status_code=400, detail="/tokenize needs a tokenizer (start with a model folder)")
    ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": engine.context_window}
