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
"""

from __future__ import annotations

import math
from pathlib import Path

from strop.engines.http import EngineRequestError, EngineVersionError, SGLangEngine, parse_weight_version
from strop.types import Completion, SamplingParams


class VLLMEngine(SGLangEngine):
    """A vLLM OpenAI-compatible server at ``url`` (pooled connections, retries and timeouts as
    :class:`SGLangEngine`)."""

    def __init__(self, url: str, *, model: str | None = None, **kw):
        super().__init__(url, **kw)
        self.model = model

    def __repr__(self) -> str:
        return f"VLLMEngine({self.url})"

    async def _model_name(self) -> str:
        if self.model is None:
            out = await self._call("GET", "/v1/models", timeout=10)
            self.model = out["data"][0]["id"]
        return self.model

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                       request_id: str | None = None) -> Completion:
        body = {"model": await self._model_name(), "prompt": list(prompt_ids), "max_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p,
                "top_k": sampling.top_k if sampling.top_k > 0 else -1, "logprobs": 0, "return_token_ids": True,
                "skip_special_tokens": False, "ignore_eos": not sampling.stop_token_ids}
        if sampling.stop_token_ids:
            body["stop_token_ids"] = [t for t in sampling.stop_token_ids if t >= 0]
        if sampling.seed is not None:  # (a per-request seed needs --max-num-batched-tokens large enough on CPU)
            body["seed"] = sampling.seed
        # vLLM's completions carry no weight version: the tokens are stamped with the version the server last
        # reported holding when the request left (read back after every load, and by the router's probes),
        # never with a version that arrived while the request ran
        version = self.weight_version
        out = await self._call("POST", "/v1/completions", json=body)
        return parse_completion(out, self.url, version)

    async def top_logprobs(self, prompt_ids: list[int], temperature: float, k: int = 8) -> dict[int, float]:
        """The top-k logprobs the server reports for the first generated position."""
        body = {"model": await self._model_name(), "prompt": list(prompt_ids), "max_tokens": 1,
                "temperature": temperature, "logprobs": k, "return_token_ids": True}
        out = await self._call("POST", "/v1/completions", json=body)
        top = out["choices"][0]["logprobs"]["top_logprobs"][0]
        return {str(t): float(v) for t, v in top.items()}

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
                f"{temperature}: start the server with --logprobs-mode processed_logprobs")

    async def load_weights(self, path: str | Path, version: int, checksum: str | None = None) -> int:
        """Reload from ``path``, reset the prefix cache, label the weights ``version`` and read the label
        back (``/update_weight_version``, ``/weight_info``: vLLM 0.32+, dev mode). vLLM reports no
        checksum strop can compare: receipt is the version the server reports holding."""
        await self._call("POST", "/collective_rpc", json={"method": "reload_weights",
                                                          "kwargs": {"weights_path": str(path)}}, retries=1)
        await self._call("POST", "/reset_prefix_cache", retries=1)
        await self._call("POST", "/update_weight_version", json={"new_version": str(version)}, retries=1)
        held = await self.get_weight_version()
        if held != version:
            raise EngineVersionError(f"{self.url}: asked to load weight version {version}, reports {held}")
        return held

    async def get_weight_version(self) -> int:
        """The label the server holds (``GET /weight_info``; ``"default"`` until strop sets one: version 0)."""
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
        return Completion(ids, logprobs, finish, version)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise EngineRequestError(f"{where}: unexpected /v1/completions answer ({type(exc).__name__}: {exc}): "
                                 f"{str(out)[:300]}") from None
