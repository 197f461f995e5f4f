"""vLLM's OpenAI-compatible server behind the Engine interface.

Prompt token ids in (``/v1/completions`` with a token-id prompt), sampled ids and their
logprobs out (``return_token_ids: true``, ``logprobs: 0``). vLLM reports the raw model's
logprobs unless the server runs with ``--logprobs-mode processed_logprobs``; strop's
trainer computes ``log_softmax(logits / temperature)``, so :meth:`VLLMEngine.check_logprobs`
probes the server at start and refuses one whose logprobs would not match (any
temperature other than 1 with raw logprobs).

Weights: vLLM reloads from disk without a restart only in dev mode
(``VLLM_SERVER_DEV_MODE=1``: ``POST /collective_rpc`` with ``reload_weights``); the
prefix cache is reset after every load, or cached prefixes keep old weights. Each load is
labelled with its version (``/update_weight_version``) and the label read back
(``/weight_info``), so the version strop trusts is the one the server reports holding: a
restarted server says ``"default"`` (its initial weights), whatever strop loaded before.

LoRA (``engine.sync=adapter``): each version's adapter is loaded at run time under its own name and requests
name it (:mod:`strop.engines.adapters`).

Broadcast (``engine.sync=broadcast``): vLLM's weight-transfer routes (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) with strop's broadcast as the server's
backend (:mod:`strop.serving.vllm_transfer`, ``--weight-transfer-config '{"backend": "gloo"}'``, registered by
strop's worker extension); generation is paused around the update (``/pause``, ``/resume``), the prefix cache
reset after it (retried while blocks are still held) and the version read back. The receipt is each worker's
digest of every byte it received (the extension's ``strop_receipt``), which the trainer compares with the digest
of what it sent. strop serve answers every one of these routes, so this class drives it too.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

from strop.engines.adapters import VLLMAdapters
from strop.engines.sglang import SGLangEngine
from strop.engines.weight_transfer import WeightTransferClient
from strop.types import Completion, SamplingParams
from strop.wire.routes import read_vllm_routes
from strop.wire.errors import (
    EngineRequestError,
    EngineVersionError,
    parse_weight_version,
)


class VLLMEngine(WeightTransferClient, VLLMAdapters, SGLangEngine):
    """A vLLM OpenAI-compatible server at ``url`` (pooled connections, retries and timeouts as
    :class:`SGLangEngine`)."""

    # /reset_prefix_cache answers success=false while blocks are held: tries before giving up (backoff doubles)
    reset_cache_attempts = 8

    def __init__(self, url: str, *, model: str | None = None, **kw):
        super().__init__(url, **kw)
        self.model = model
        self._pause_mode = None

    def __repr__(self) -> str:
        return f"VLLMEngine({self.url})"

    async def _model_name(self) -> str:
        """What requests name: the newest adapter once one is loaded, else the server's model."""
        if self.adapter is not None:
            return self.adapter
        if self.model is None:
            out = await self._call("GET", "/v1/models", timeout=10)
            self.model = out["data"][0]["id"]
        return self.model

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None
    ) -> Completion:
        body = {
            "model": await self._model_name(),
            "prompt": list(prompt_ids),
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "ignore_eos": not sampling.stop_token_ids,
        }
        if sampling.stop_token_ids:
            body["stop_token_ids"] = [t for t in sampling.stop_token_ids if t >= 0]
        if sampling.seed is not None:  # (a per-request seed needs --max-num-batched-tokens large enough on CPU)
            body["seed"] = sampling.seed
        if self.adapter is not None:  # (the completion names the adapter, whose name gives the version)
            out, version = await self._adapter_request("/v1/completions", body)
        else:  # vLLM's completions carry no weight version: stamped with the one the server last reported holding
            version = self.weight_version  # when the request left (read back after every load, and by the probes)
            out = await self._call("POST", "/v1/completions", json=body)
        return parse_completion(out, self.url, version)

    async def top_logprobs(self, prompt_ids: list[int], temperature: float, k: int = 8) -> dict[int, float]:
        """The top-k logprobs the server reports for the first generated position."""
        body = {
            "model": await self._model_name(),
            "prompt": list(prompt_ids),
            "max_tokens": 1,
            "temperature": temperature,
            "logprobs": k,
            "return_token_ids": True,
        }
        out = await self._call("POST", "/v1/completions", json=body)
        top = out["choices"][0]["logprobs"]["top_logprobs"][0]
        return {str(t): float(v) for t, v in top.items()}

    async def score(self, ids: list[int]) -> list[float]:
        """The engine's logprob of each token of ``ids`` after the first, given the ones before it (vLLM's
        ``prompt_logprobs``: each position lists the prompt's own token; temperature 1)."""
        body = {
            "model": await self._model_name(),
            "prompt": list(ids),
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 0,
        }
        out = await self._call("POST", "/v1/completions", json=body)
        try:
            positions = out["choices"][0]["prompt_logprobs"][1:]  # (the first token has none)
            scored = [float(at[str(t)]["logprob"]) for t, at in zip(ids[1:], positions)]
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise EngineRequestError(
                f"{self.url}: no prompt_logprobs in the /v1/completions answer ({exc!r}): {str(out)[:300]}"
            ) from None
        if len(scored) != len(ids) - 1:
            raise EngineRequestError(f"{self.url}: scored {len(scored)} of the probe's {len(ids) - 1} tokens")
        return scored

    async def check_logprobs(self, temperature: float, probe_ids: list[int]) -> None:
        """Refuse a server whose logprobs ignore temperature when the run samples at ``temperature != 1``.

        Two probes of the same first position at temperature 1 and 0.5: with processed logprobs
        the top tokens' values differ (0.5 sharpens the distribution); raw logprobs are identical.
        """
        if abs(temperature - 1.0) < 1e-9 or temperature <= 0:
            return  # raw and processed logprobs coincide at temperature 1; greedy rollouts are not trained on
        at_one = await self.top_logprobs(probe_ids, 1.0)
        at_half = await self.top_logprobs(probe_ids, 0.5)
        shared = [t for t in at_one if t in at_half and math.isfinite(at_one[t]) and math.isfinite(at_half[t])]
        if shared and all(abs(at_one[t] - at_half[t]) < 1e-6 for t in shared):
            raise EngineRequestError(
                f"{self.url}: vLLM reports raw logprobs (temperature ignored), but this run samples at temperature "
                f"{temperature}: start the server with --logprobs-mode processed_logprobs"
            )

    async def load_weights(self, path: str | Path, version: int, checksum: str | None = None) -> int:
        """Reload from ``path``, reset the prefix cache, label the weights ``version`` and read the label
        back (``/update_weight_version``, ``/weight_info``: vLLM 0.32+, dev mode). vLLM reports no
        checksum strop can compare: receipt is the version the server reports holding."""
        await self._call(
            "POST",
            "/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
            retries=1,
        )
        await self._reset_prefix_cache()
        return await self._label(version)

    async def _label(self, version: int) -> int:
        """Label the weights ``version`` and read the label back (refused if it did not take)."""
        await self._call("POST", "/update_weight_version", json={"new_version": str(version)}, retries=1)
        held = await self.get_weight_version()
        if held != version:
            raise EngineVersionError(f"{self.url}: asked to load weight version {version}, reports {held}")
        return held

    async def _reset_prefix_cache(self) -> None:
        """Drop the KV cached under the old weights. vLLM refuses (success=false) while blocks are still
        held, e.g. by a request that is finishing: retried with backoff, then an error naming the engine.
        Paused with ``keep``, the kept requests hold their blocks until resume: they are preempted
        (recomputed on the new weights), as vLLM's ``reset_running_requests`` does."""
        query = "?reset_running_requests=true" if self._pause_mode == "keep" else ""
        for attempt in range(self.reset_cache_attempts):
            out = await self._call("POST", "/reset_prefix_cache" + query, timeout=30, retries=1)
            if out.get("success", True):  # (vLLM before 0.32 answered 200 with no body)
                return
            if attempt + 1 < self.reset_cache_attempts:
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise EngineRequestError(
            f"{self.url}: /reset_prefix_cache still answers success=false after "
            f"{self.reset_cache_attempts} attempts (blocks still held by running requests): "
            "the old weights' KV cache would serve the new weights"
        )

    async def get_weight_version(self) -> int:
        """The label the server holds (``GET /weight_info``; ``"default"`` until strop sets one: version 0). With
        adapters (engine.sync=adapter): the version of the adapter this client loaded last if the server lists it
        (``/v1/models``), else 0, the base model (a restarted server lists none; none was loaded yet)."""
        if self.lora:
            self.weight_version = await self._adapter_held()
            return self.weight_version
        out = await self._call("GET", "/weight_info", timeout=10, retries=0)
        if not isinstance(out, dict) or "weight_version" not in out:
            raise EngineVersionError(f"{self.url}: /weight_info reports no weight version: {str(out)[:200]}")
        self.weight_version = parse_weight_version(out["weight_version"], self.url)
        return self.weight_version

    async def abort(self, request_id: str) -> bool:
        return False  # vLLM aborts a request when its connection closes; no route by id

    async def abort_all(self) -> None:
        await self._call("POST", "/abort_requests", json={}, timeout=10, retries=0)


def parse_completion(out: dict, where: str, version: int) -> Completion:
    """A vLLM ``/v1/completions`` choice as a Completion."""
    try:
        choice = out["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        lps = choice.get("logprobs") or {}
        logprobs = [float(x) for x in lps.get("token_logprobs", [])] if lps else None
        finish = {"stop": "stop", "length": "length", "abort": "abort"}.get(choice.get("finish_reason"), "abort")
        if logprobs is not None and len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} token ids but {len(logprobs)} logprobs")
        routes = choice.get("routed_experts")  # a server started with --enable-return-routed-experts
        return Completion(ids, logprobs, finish, version, None, None if routes is None else read_vllm_routes(routes))
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise EngineRequestError(
            f"{where}: unexpected /v1/completions answer ({type(exc).__name__}: {exc}): {str(out)[:300]}"
        ) from None
