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
from strop.types import Completion, SamplingParams
from strop.wire.errors import (
    EngineReceiptError,
    EngineRequestError,
    EngineUnavailable,
    EngineVersionError,
    parse_weight_version,
)


EXTENSION = "strop.serving.vllm_worker.StropWorkerExtension"
NO_EXTENSION_FALLBACK = f"start vLLM with --worker-extension-cls {EXTENSION}, or use engine.sync=disk"
PAUSE_MODES = ("abort", "wait", "keep")


class VLLMEngine(VLLMAdapters, SGLangEngine):
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

    # --- broadcast through strop's worker extension (strop.serving.vllm_worker) ---

    async def _rpc(self, method: str, timeout: float | None = None, **kwargs) -> list:
        """Call the extension's ``method`` on every worker (``/collective_rpc``: its arguments are strings)
        and return each worker's answer. Never retried: a bucket is one collective with the trainer."""
        import httpx

        body = {"method": method, "kwargs": {k: str(v) for k, v in kwargs.items()}}
        try:
            # a connection of its own: vLLM 0.32 closes the connection after an RPC that raised (uvicorn
            # sees the exception after the 500 went out), and the next request on it would fail
            r = await self._http().post(
                self.url + "/collective_rpc",
                json=body,
                headers={"Connection": "close"},
                timeout=timeout if timeout is not None else self.timeout_s,
            )
        except (httpx.TransportError, OSError) as exc:
            raise EngineUnavailable(f"{self.url}/collective_rpc {method}: {type(exc).__name__}: {exc}") from exc
        if r.status_code == 404:
            raise EngineRequestError(
                f"{self.url}: no /collective_rpc route: start vLLM with VLLM_SERVER_DEV_MODE=1 "
                f"(and --worker-extension-cls {EXTENSION}), or use engine.sync=disk"
            )
        if r.status_code >= 400:
            text = r.text
            # vLLM 0.32's worker answers AttributeError "... has no attribute 'strop_x'" (an in-process
            # engine: NotImplementedError "Method 'strop_x' is not implemented"), as HTTP 500 / 501
            if f"'{method}'" in text and ("no attribute" in text or "not implemented" in text):
                raise EngineRequestError(await self._no_extension(method))
            raise EngineRequestError(f"{self.url}: collective_rpc {method} failed: HTTP {r.status_code}: {text[:500]}")
        try:
            results = r.json()["results"]
        except (ValueError, KeyError, TypeError):
            results = None
        if not isinstance(results, list) or not results:
            raise EngineRequestError(f"{self.url}: collective_rpc {method}: unexpected answer {r.text[:300]!r}")
        return results

    async def _no_extension(self, method: str) -> str:
        try:
            version = (await self._call("GET", "/version", timeout=10, retries=1)).get("version", "unknown")
        except (EngineRequestError, EngineUnavailable):
            version = "unknown"
        return (
            f"{self.url}: vLLM {version} has no strop worker extension ({method!r} is not a worker method), "
            f"so it cannot receive weights by broadcast: {NO_EXTENSION_FALLBACK}"
        )

    async def check_broadcast(self) -> list[dict]:
        """Refuse, naming the engine, its vLLM version and the fallback, an engine without the extension or
        without strop's transfer backend. Every worker (TP and PP ranks) joins the group, as rank offset + its
        vLLM rank. Returns what each worker reports (pid, rank, device, dtype, transfer backend)."""
        workers = await self._rpc("strop_info", timeout=30)
        backends = {str(w.get("transfer_backend")) for w in workers}
        if not all(b == "StropGlooTransfer" or b.startswith("strop serve") for b in backends):
            raise EngineRequestError(
                f"{self.url}: its weight-transfer backend is {sorted(backends)}, not strop's broadcast: start "
                f'vLLM with --weight-transfer-config \'{{"backend": "gloo"}}\' (and --worker-extension-cls '
                f"{EXTENSION}), or use engine.sync=disk"
            )
        self.group_ranks = len(workers)
        return workers

    async def join_group(self, host: str, port: int, rank: int, world: int, backend: str, name: str) -> None:
        """``/init_weight_transfer_engine``. The server waits for the group as long as this client waits for any
        answer; the HTTP wait is a little longer, so a group that never forms comes back as the server's error."""
        info = {
            "master_address": host,
            "master_port": port,
            "rank_offset": rank,
            "world_size": world,
            "group_name": name,
            "backend": backend,
            "timeout_s": self.timeout_s,
        }
        await self._once("/init_weight_transfer_engine", {"init_info": info}, self.timeout_s + 30)

    async def leave_group(self, name: str) -> None:
        await self._once("/shutdown_weight_transfer_engine", None, 30)

    async def weights_manifest(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of every tensor the engine expects, from its checkpoint's headers."""
        out = (await self._rpc("strop_manifest", timeout=60))[0]
        return [(n, d, tuple(s)) for n, d, s in zip(out["names"], out["dtypes"], out["shapes"])]

    async def pause(self, mode: str = "abort") -> None:
        """Stop generation for an update (vLLM ``/pause``): ``abort`` ends running requests, ``wait`` lets
        them finish, ``keep`` freezes them until :meth:`resume`."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"vLLM pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        out = await self._call("POST", f"/pause?mode={mode}", retries=1)
        if out.get("status") != "paused":
            raise EngineRequestError(f"{self.url}: /pause?mode={mode} answered {str(out)[:200]}")
        self._pause_mode = mode

    async def resume(self) -> None:
        await self._call("POST", "/resume", timeout=30, retries=1)
        self._pause_mode = None

    async def begin_update(self) -> None:
        await self._once("/start_weight_update", None, 60)

    async def receive_bucket(self, bucket, group_name: str, version: int | None, last: bool) -> None:
        """``/update_weights`` for one bucket, concurrently with the trainer's broadcast of it (vLLM's NCCL
        fields; ``packed``: the bucket's tensors travel as one buffer)."""
        payload = bucket.payload()
        info = {
            "names": payload["names"],
            "dtype_names": payload["dtypes"],
            "shapes": payload["shapes"],
            "packed": bucket.flattened,
        }
        await self._once("/update_weights", {"update_info": info}, self.timeout_s + 30)

    async def end_update(self, version: int) -> None:
        """``/finish_weight_update`` (the layers are processed as vLLM's own reload does), reset the prefix cache,
        then label the weights ``version`` and read it back: the version is published only once no cached
        prefix of the old weights can serve it."""
        await self._once("/finish_weight_update", {}, self.timeout_s)
        await self._reset_prefix_cache()
        await self._label(version)

    async def receipt(self) -> tuple[int, str, str]:
        """(version, "stream", checksum) of the last update as every worker received it: the version the server
        reports holding and the digest of the bytes each worker received, in order. An update that did not
        write every parameter is refused here: the engine would serve some of its old weights."""
        answers = await self._rpc("strop_receipt", timeout=30)
        for r in answers:
            if not r.get("loaded"):
                raise EngineReceiptError(
                    f"{self.url}: the last update did not write every parameter of the model "
                    f"({r.get('n_missing')} not written, e.g. {r.get('missing')}; {r.get('buckets')} buckets received"
                    f"{', still open' if r.get('open') else ''}): it would serve stale weights"
                )
        checksums = {r["checksum"] for r in answers}
        if len(checksums) != 1:
            raise EngineReceiptError(f"{self.url}: its workers received different updates: {answers}")
        return await self.get_weight_version(), "stream", checksums.pop()

    async def _once(self, path: str, body: dict | None, timeout: float) -> dict:
        """POST one weight-transfer call, never retried (a chunk is one collective with the trainer), on a
        connection of its own (vLLM 0.32 closes a connection after a call that raised in its worker)."""
        import httpx

        try:
            r = await self._http().post(
                self.url + path, json=body or {}, headers={"Connection": "close"}, timeout=timeout
            )
        except (httpx.TransportError, OSError) as exc:
            raise EngineUnavailable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc
        if r.status_code == 404:
            raise EngineRequestError(
                f"{self.url}: no {path} route: start vLLM with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
                f'\'{{"backend": "gloo"}}\', or use engine.sync=disk'
            )
        if r.status_code >= 400:
            raise EngineRequestError(f"{self.url}: {path} failed: HTTP {r.status_code}: {r.text[:500]}")
        try:
            return r.json()
        except ValueError:
            return {}

    async def worker_memory(self, reset: bool = False) -> list[dict]:
        """Each worker process's resident and peak memory in MiB (``reset``: restart the peak after reading)."""
        return await self._rpc("strop_memory", timeout=30, reset=int(reset))

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
        return Completion(ids, logprobs, finish, version)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise EngineRequestError(
            f"{where}: unexpected /v1/completions answer ({type(exc).__name__}: {exc}): {str(out)[:300]}"
        ) from None
