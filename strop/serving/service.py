"""strop serve's one service object: the engine, its tokenizer, the model's name, the folder weights load
from, and the weight-sync groups joined. Every route module (:mod:`strop.serving.routes_generate`,
:mod:`strop.serving.routes_weights`, :mod:`strop.serving.routes_openai`) reaches it through
:func:`service_of`; what several routes do (tokenize, check and run one generation) lives here once."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import HTTPException, Request
from pydantic import BaseModel, ConfigDict

from strop.serving.embedded import EmbeddedEngine
from strop.serving.request import RequestError
from strop.serving.transfer import WeightTransfer
from strop.serving.openai import cut_at_stops
from strop.types import Completion, SamplingParams
from strop.wire import group as wire_group  # (called through the module: tests stand in for its functions)


class StrictBody(BaseModel):
    """A request body of strop serve's own routes: unknown fields and non-finite numbers refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ServeService:
    """What strop serve's routes share. ``weights_dir``: the only folder /update_weights_from_disk reads
    (None: that route is refused)."""

    return_routes = False  # completion choices carry their routed experts (vLLM's --enable-return-routed-experts)

    def __init__(
        self,
        engine: EmbeddedEngine,
        tokenizer=None,
        model_name: str = "strop",
        weights_dir: str | None = None,
        weight_transfer: str = "gloo",
    ):
        self.engine, self.tokenizer, self.model_name, self.weights_dir = engine, tokenizer, model_name, weights_dir
        self.transfer = WeightTransfer(weight_transfer, weights_dir)  # vLLM's transfer phases (routes_transfer)
        self.transfer_lock = asyncio.Lock()  # one transfer call at a time: chunks pair with the trainer's sends
        self.sleeping = False  # /sleep (level 0) until /wake_up
        self.groups: dict[str, Any] = {}  # weight-sync groups joined, by name
        self.warned: set[str] = set()  # sampling fields already logged as ignored
        self.lora_base: dict[str, Any] = {}  # weights as before the first LoRA adapter merged (a full update resets)
        self.lora_name: str | None = None  # the adapter merged into the weights (/load_lora_adapter), by its name

    def weights_replaced(self) -> None:
        """A full load replaced the weights: a LoRA adapter loaded later merges over these (strop.serving.routes_lora)."""
        self.lora_base.clear()
        self.lora_name = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        tokenizer = self.tokenizer
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if tokenizer is not None else ""

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise HTTPException(status_code=400, detail="a text prompt needs a tokenizer; send token ids")
        return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    def token_text(self, t: int) -> str:
        return self.decode([t], False) if self.tokenizer is not None else str(t)

    def check_job(self, ids: list[int], sampling: SamplingParams, stops: list[str], top: int = 0) -> None:
        """Refuse (400) a generation the engine would refuse, before it starts (or a stream's first byte)."""
        engine = self.engine
        if sampling.max_new_tokens >= engine.context_window:  # no prompt leaves room for it (a shorter
            # limit that runs past the window with this prompt ends there, finish reason "length")
            raise HTTPException(
                status_code=400,
                detail=f"max_new_tokens {sampling.max_new_tokens} is not below "
                f"the context window ({engine.context_window} tokens)",
            )
        if stops and self.tokenizer is None:
            raise HTTPException(status_code=400, detail="stop strings need a tokenizer; send stop_token_ids")
        try:
            engine.check(ids, sampling, top)
        except RequestError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc

    async def complete(
        self,
        ids: list[int],
        sampling: SamplingParams,
        rid: str | None,
        stops: list[str],
        skip_special_tokens: bool = True,
        top: int = 0,
    ) -> tuple[Completion, str, str | None, list]:
        """One generation, cut after the first stop string: (completion, its text up to and
        without the stop string, the stop string matched, per token its ``top`` most likely
        alternatives ``{token_id: logprob}``, or None each when ``top`` is 0)."""
        self.check_job(ids, sampling, stops, top)
        heard: list = []  # per token (id, logprob, alternatives), as decoded
        try:
            out = await self.engine.generate(
                ids,
                sampling,
                request_id=rid,
                top_logprobs=top,
                on_token=(lambda *token: heard.append(token)) if top else None,
            )
        except RequestError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        out, text, matched = cut_at_stops(out, stops, lambda ids: self.decode(ids, skip_special_tokens))
        tops = [alternatives for _, _, alternatives in heard] if top else [None] * len(out.token_ids)
        return out, text, matched, tops[: len(out.token_ids)]

    async def prompt_scores(self, ids: list[int], temperature: float | None, top: int) -> tuple[list, list]:
        """An echoed prompt's logprobs and alternatives, one per token (the first None: nothing before it)."""
        try:
            logprobs, tops = await self.engine.prompt_logprobs(ids, 1.0 if temperature is None else temperature, top)
        except RequestError as exc:
            raise HTTPException(status_code=400, detail=f"prompt: {exc}") from exc
        return [None, *logprobs], [None, *tops]

    async def destroy_group(self, name: str) -> bool:
        """Forget a weight-sync group and tear it down (NCCL: abort; gloo frees its sockets when the
        last reference goes). A receive still blocked on it ends at the group's timeout."""
        group = self.groups.pop(name, None)
        if group is None:
            return False
        await asyncio.to_thread(wire_group.close_group, group)
        return True


def sampling_of(temperature, top_p, top_k, max_new_tokens, stop_ids, seed) -> SamplingParams:
    return SamplingParams(
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=max(top_k or 0, 0),
        max_new_tokens=max_new_tokens,
        stop_token_ids=list(stop_ids or []),
        seed=seed,
    )


def seeds(seed: int | None, n: int) -> list[int | None]:
    """One seed per choice: n choices of one seeded request differ, and repeat when asked again."""
    return [None if seed is None else (seed + i) % 2**64 for i in range(n)]


def service_of(request: Request) -> ServeService:
    """The service of the app serving ``request`` (:func:`strop.serving.server.create_app` set it)."""
    return request.app.state.service
