"""SGLang's native API behind the :class:`~strop.engines.base.Engine` interface.

:class:`SGLangEngine` speaks ``/generate`` with token ids and ``return_logprob``; the same payloads work
against ``strop serve``. A request id per call, so one request can be aborted; connections, retries and
timeouts as every HTTP client's (:class:`strop.engines.http.HTTPEngine`). Weights arrive through disk
(``/update_weights_from_disk``) or by broadcast, driven by a transport of :mod:`strop.sync`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import uuid
from pathlib import Path

from strop.engines.adapters import ADAPTER_NAME, SGLangAdapters
from strop.engines.http import HTTPEngine
from strop.sync.disk import WeightWriter
from strop.types import Completion, SamplingParams
from strop.wire.routes import read_sglang_routes
from strop.wire.errors import (
    EngineReceiptError,
    EngineRequestError,
    EngineUnavailable,
    EngineVersionError,
    parse_weight_version,
)


MIN_SGLANG = "0.5.23"  # the first release with the weight-update session (begin/end_weight_update)


def _release(version: str) -> tuple[int, ...]:
    """ "0.5.23.post1" -> (0, 5, 23): the numeric release, for comparing server versions."""
    return (
        tuple(int(p) for p in re.match(r"\d+(?:\.\d+)*", version.strip()).group(0).split("."))
        if re.match(r"\d", version.strip())
        else ()
    )


class SGLangEngine(SGLangAdapters, HTTPEngine):
    """An SGLang (or ``strop serve``) server at ``url`` as an Engine."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 600.0,
        retries: int = 3,
        backoff_s: float = 0.25,
        token: str | None = None,
        writer: WeightWriter | None = None,
        require_checksum: bool = False,
        routes: bool = False,
    ):
        """``require_checksum``: a weight load must come back with the checksum of what the engine loaded
        (strop serve reports it; SGLang does not, and proves receipt by the version it reports).
        ``writer``: where :meth:`update_weights` writes the weights it loads (a router's transport writes its own).
        ``routes``: ask for each completion's routed experts (algo.routing_replay; strop.wire.routes)."""
        super().__init__(url, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s, token=token)
        self.writer, self.routes, self.require_checksum = writer, routes, require_checksum
        self.weight_version = 0  # the version the engine last reported holding (never a count kept here)
        self.group_ranks = 1  # ranks the server joins a weight-update group with (SGLang: one per TP worker)
        self._session_checksum = None  # strop serve's receipt of the last update session
        self._start_adapters()

    def __repr__(self) -> str:
        return f"SGLangEngine({self.url})"

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None
    ) -> Completion:
        body = {
            "input_ids": list(prompt_ids),
            "sampling_params": sampling_params(sampling),
            "return_logprob": True,
            "rid": request_id or uuid.uuid4().hex,
            **({"return_routed_experts": True} if self.routes else {}),
        }
        if self.adapter is None:
            return parse_generate(await self._call("POST", "/generate", json=body), self.url, len(prompt_ids))
        out, version = await self._adapter_request("/generate", body)
        return dataclasses.replace(parse_generate(out, self.url, len(prompt_ids)), weight_version=version)

    async def score(self, ids: list[int]) -> list[float]:
        """The engine's logprob of each token of ``ids`` after the first, given the ones before it (SGLang's
        ``input_token_logprobs`` from ``logprob_start_len: 0``, temperature 1)."""
        body = {
            "input_ids": list(ids),
            "return_logprob": True,
            "logprob_start_len": 0,
            "rid": uuid.uuid4().hex,
            "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
        }
        if self.adapter is None:
            out = await self._call("POST", "/generate", json=body)
        else:
            out, _ = await self._adapter_request("/generate", body)
        try:
            entries = out["meta_info"]["input_token_logprobs"]
            scored = [float(e[0]) for e in entries if e[0] is not None]
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise EngineRequestError(
                f"{self.url}: no input_token_logprobs in the /generate answer ({exc}): {str(out)[:300]}"
            ) from None
        if len(scored) != len(ids) - 1:
            raise EngineRequestError(f"{self.url}: scored {len(scored)} of the probe's {len(ids) - 1} tokens")
        return scored

    async def abort(self, request_id: str) -> bool:
        await self._call("POST", "/abort_request", json={"rid": request_id}, timeout=10, retries=0)
        return True

    async def abort_all(self) -> None:
        await self._call("POST", "/abort_request", json={"abort_all": True}, timeout=10, retries=0)

    async def health(self) -> bool:
        try:
            await self._call("GET", "/health", timeout=5, retries=0)
            return True
        except (EngineUnavailable, EngineRequestError):
            return False

    async def get_weight_version(self) -> int:
        """The version the engine reports holding: ``GET /model_info`` (SGLang 0.5.23 has no other route),
        or ``GET /get_weight_version`` on servers without it (older SGLang and strop serve). With adapters loaded
        at run time: the version of the newest, if the server lists it (strop.engines.adapters)."""
        if self.lora:
            self.weight_version = await self._adapter_held()
            return self.weight_version
        try:
            out = await self._call("GET", "/model_info", timeout=10, retries=0)
        except EngineRequestError as exc:
            if "HTTP 404" not in str(exc):
                raise
            out = await self._call("GET", "/get_weight_version", timeout=10, retries=0)
        if not isinstance(out, dict) or "weight_version" not in out:
            raise EngineVersionError(f"{self.url}: reports no weight version: {str(out)[:200]}")
        self.weight_version = parse_weight_version(out["weight_version"], self.url)
        return self.weight_version

    async def load_weights(
        self, path: str | Path, version: int, checksum: str | None = None, digests: dict[str, str] | None = None
    ) -> int:
        """Tell the engine to load ``path`` as ``version``; return the version it then reports holding.
        Receipt: the checksum it reports must be the trainer's (required with ``require_checksum``),
        and the version it reports (in the answer, else read back) must be ``version``. With
        ``digests`` (the delta form) the file holds only those tensors and the engine checks each."""
        body = {"model_path": str(path), "weight_version": str(version)}
        if digests is not None:
            body["digests"] = digests
        out = await self._call("POST", "/update_weights_from_disk", json=body, retries=1)
        if not out.get("success", False):
            raise EngineRequestError(f"{self.url}: update_weights_from_disk failed: {out.get('message')}")
        reported = out.get("checksum")
        if checksum is not None and (reported is not None or self.require_checksum) and reported != checksum:
            raise EngineRequestError(
                f"{self.url}: weights of version {version} arrived with checksum "
                f"{reported}, the trainer's is {checksum}"
            )
        held = (
            parse_weight_version(out["weight_version"], self.url)
            if "weight_version" in out
            else await self.get_weight_version()
        )
        self.weight_version = held
        if held != version:
            raise EngineVersionError(f"{self.url}: asked to load weight version {version}, reports {held}")
        return held

    async def load_adapter(self, path: str | Path, version: int, scaling: float, checksum: str | None) -> int:
        """strop serve: merge the LoRA adapter at ``path`` (strop.wire.lora) as ``version``; return the version it
        then reports. Receipt: the checksum of the weights it merged must be the trainer's, and the version
        ``version``. SGLang (no checksum required): loaded at run time, and requests name it."""
        if not self.require_checksum:
            return await self.load_runtime_adapter(path, version)
        body = {"lora_name": f"{ADAPTER_NAME}{version}", "lora_path": str(path), "scaling": scaling}
        out = await self._call("POST", "/load_lora_adapter", json=body | {"weight_version": version}, retries=1)
        if not out.get("success", False):
            raise EngineRequestError(f"{self.url}: load_lora_adapter failed: {out.get('message')}")
        if out.get("checksum") != checksum:
            raise EngineRequestError(
                f"{self.url}: the adapter of version {version} merged into weights with checksum "
                f"{out.get('checksum')}, the trainer's are {checksum}"
            )
        held = parse_weight_version(out["weight_version"], self.url)
        self.weight_version = held
        if held != version:
            raise EngineVersionError(f"{self.url}: asked to load adapter version {version}, reports {held}")
        return held

    # ---- broadcast sync, through SGLang's routes (strop serve answers the same ones) -------------------
    async def join_group(self, host: str, port: int, rank: int, world: int, backend: str, name: str) -> None:
        """Join the trainer's weight-update group as rank ``rank`` (returns once every rank joined)."""
        await self._call(
            "POST",
            "/init_weights_update_group",
            json={
                "master_address": host,
                "master_port": port,
                "rank_offset": rank,
                "world_size": world,
                "group_name": name,
                "backend": backend,
            },
            retries=0,
        )

    async def leave_group(self, name: str) -> None:
        """Destroy this engine's side of the weight-update group ``name`` (SGLang's route)."""
        await self._call("POST", "/destroy_weights_update_group", json={"group_name": name}, timeout=30, retries=0)

    async def check_broadcast(self) -> None:
        """Refuse, before a run starts, an SGLang server that cannot take strop's broadcast: one older than
        the weight-update session (``begin_weight_update``, SGLang 0.5.23), or data parallel inside one
        server (SGLang refuses its groups). A tensor-parallel server joins with one rank per TP worker.
        strop serve has no ``/server_info``: it takes the broadcast as one rank."""
        info = None
        for route in ("/server_info", "/get_server_info"):
            try:
                info = await self._call("GET", route, timeout=10, retries=0)
                break
            except EngineRequestError as exc:
                if "HTTP 404" not in str(exc):
                    raise
        if not isinstance(info, dict) or "version" not in info:
            return
        version = str(info["version"])
        if () < _release(version) < _release(MIN_SGLANG):
            raise EngineRequestError(
                f"{self.url}: SGLang {version} has no weight-update session (begin_weight_update, "
                f"SGLang >= {MIN_SGLANG}), which strop's broadcast needs: upgrade the server, or "
                "use engine.sync=disk"
            )
        if int(info.get("dp_size") or 1) > 1:
            raise EngineRequestError(
                f"{self.url}: SGLang {version} runs dp_size={info['dp_size']}, and refuses "
                "weight-update groups then: run one server per replica, or use engine.sync=disk"
            )
        self.group_ranks = int(info.get("tp_size") or 1)

    async def weights_manifest(self) -> list[tuple[str, str, tuple[int, ...]]] | None:
        """The (name, dtype, shape) of every tensor the engine expects (strop serve's ``/weights_manifest``);
        None where the engine cannot say (SGLang has no such route: it checks each bucket as it arrives)."""
        try:
            out = await self._call("GET", "/weights_manifest", timeout=30, retries=0)
        except EngineRequestError as exc:
            if "HTTP 404" in str(exc):
                return None
            raise
        try:
            return [(n, d, tuple(s)) for n, d, s in zip(out["names"], out["dtypes"], out["shapes"], strict=True)]
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineRequestError(
                f"{self.url}/weights_manifest: unreadable answer ({exc}): {str(out)[:200]}"
            ) from None

    async def pause(self, mode: str) -> None:
        """Stop generating for an update (SGLang's modes: abort, retract, in_place)."""
        await self._call("POST", "/pause_generation", json={"mode": mode}, timeout=60, retries=0)

    async def resume(self) -> None:
        await self._call("POST", "/continue_generation", json={}, timeout=60, retries=1)

    async def begin_update(self) -> None:
        """Open the weight-update session SGLang 0.5.23 requires around tensor and distributed updates."""
        try:
            out = await self._call("POST", "/begin_weight_update", json={}, timeout=60, retries=0)
        except EngineRequestError as exc:
            if "HTTP 404" in str(exc):
                raise EngineRequestError(
                    f"{self.url} has no /begin_weight_update (SGLang before {MIN_SGLANG}?): "
                    "strop's broadcast needs it; upgrade the server, or use engine.sync=disk"
                ) from exc
            raise
        self._check(out, "begin_weight_update")

    async def receive_bucket(self, bucket, group_name: str, version: int | None, last: bool) -> None:
        """Post one bucket's names, dtypes and shapes; the engine then joins the trainer's broadcast of it.
        The version labels the weights with the last bucket only (a failed update keeps the old label), and
        the cache is flushed with it."""
        body = bucket.payload() | {
            "group_name": group_name,
            "flush_cache": last,
            "weight_version": str(version) if last and version is not None else None,
        }
        self._check(
            await self._call("POST", "/update_weights_from_distributed", json=body, retries=0),
            "update_weights_from_distributed",
        )

    async def end_update(self, version: int) -> None:
        out = await self._call("POST", "/end_weight_update", json={}, timeout=300, retries=0)
        self._check(out, "end_weight_update")
        self._session_checksum = out.get("checksum")  # (strop serve: the digest of what the session received)

    async def receipt(self) -> tuple[int, str | None, str | None]:
        """The version the engine reports, and the checksum of the update where it computes one strop can
        compare: strop serve's digest of every byte its session received (``stream``, the answer to
        ``/end_weight_update``; required of strop serve). SGLang's checksums are of its own fused tensors,
        so the version (and the probe) is its receipt."""
        held = await self.get_weight_version()
        if not self.require_checksum:
            return held, None, None
        checksum, self._session_checksum = self._session_checksum, None
        if not isinstance(checksum, str):
            raise EngineReceiptError(f"{self.url}: no checksum of the update from /end_weight_update")
        return held, "stream", checksum

    def _check(self, out: dict, what: str) -> None:
        """SGLang answers update routes with ``{"success": bool, "message"}`` (a 200 may still say false)."""
        if not out.get("success", False):
            raise EngineRequestError(f"{self.url}: {what} failed: {out.get('message', out)}")

    async def update_weights(self, state_dict, version: int | None = None) -> int:
        if self.writer is None:
            raise ValueError(f"{self}: weights go through disk; give the engine a WeightWriter")
        version = self.weight_version + 1 if version is None else version
        path, checksum = await asyncio.to_thread(self.writer.write, state_dict, version)  # off the event loop
        return await self.load_weights(path, version, checksum)

    async def tensor_digests(self) -> dict[str, str]:
        """strop serve: a digest of each tensor it holds (``POST /weight_checker {action: checksum}``, vLLM's
        route: strop.wire.digest.tensor_digest, keyed ``dp0:pp0:pcp0:tp0:<name>``), for engine.verify_updates
        to compare with the trainer's. (vLLM answers the same route with digests of its own tensors.)"""
        out = await self._call("POST", "/weight_checker", json={"action": "checksum"}, retries=1)
        checksums = out.get("checksums") if isinstance(out, dict) else None
        if not isinstance(checksums, dict) or not checksums:
            raise EngineRequestError(f"{self.url}: /weight_checker answered no checksums: {str(out)[:200]}")
        return checksums


def sampling_params(sampling: SamplingParams) -> dict:
    """SGLang's ``sampling_params`` of ``sampling`` (stop strings kept in the text, special tokens decoded)."""
    sp = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "max_new_tokens": sampling.max_new_tokens,
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    if sampling.stop_token_ids:
        sp["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.seed is not None:
        sp["sampling_seed"] = sampling.seed
    return sp


def parse_generate(out: dict, where: str, prompt_tokens: int = 0) -> Completion:
    """An SGLang ``/generate`` answer as a Completion (logprobs from ``meta_info.output_token_logprobs``; routed
    experts, when asked for, from ``meta_info.routed_experts`` over the ``prompt_tokens`` and the output)."""
    try:
        meta = out["meta_info"]
        entries = meta.get("output_token_logprobs")
        ids = [int(e[1]) for e in entries] if entries else list(out.get("output_ids", []))
        logprobs = [float(e[0]) for e in entries] if entries is not None else None
        reason = meta.get("finish_reason") or {}
        kind = reason.get("type") if isinstance(reason, dict) else str(reason)
        finish = {"stop": "stop", "length": "length", "abort": "abort"}.get(kind, "abort")
        # the version that sampled the tokens, as the engine reports it; a request that spanned an update
        # has per-span versions (SGLang's weight_versions): its oldest counts
        spans = meta.get("weight_versions") or [{"version": meta.get("weight_version")}]
        version = min(parse_weight_version(span["version"], where) for span in spans)
        routes = meta.get("routed_experts")
        if routes is not None:
            routes = read_sglang_routes(routes, prompt_tokens + len(ids) - 1)
        return Completion(ids, logprobs, finish, version, None, routes)
    except EngineVersionError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise EngineRequestError(
            f"{where}: unexpected /generate answer ({type(exc).__name__}: {exc}): {str(out)[:300]}"
        ) from None
