"""vLLM's RL routes as strop's engines drive them for an update: ``/pause`` and ``/resume``, the transfer phases
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``,
``/shutdown_weight_transfer_engine``) carrying strop's broadcast, and strop's worker extension through
``/collective_rpc`` (``strop_info``, ``strop_manifest``, ``strop_receipt``, ``strop_memory``). A mixin of
:class:`strop.engines.vllm.VLLMEngine`: a real vLLM and strop serve answer all of these alike."""

from __future__ import annotations

from strop.wire.errors import EngineReceiptError, EngineRequestError, EngineUnavailable

EXTENSION = "strop.serving.vllm_worker.StropWorkerExtension"
NO_EXTENSION_FALLBACK = f"start vLLM with --worker-extension-cls {EXTENSION}, or use engine.sync=disk"
PAUSE_MODES = ("abort", "wait", "keep")


class WeightTransferClient:
    """The update half of the vLLM dialect (see :class:`strop.engines.vllm.VLLMEngine` for the rest)."""

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
