"""LoRA adapters loaded into a server at run time, as a LoRA run's weight updates (``engine.sync=adapter``,
strop.sync.adapter): vLLM (``/v1/load_lora_adapter``) and SGLang (``/load_lora_adapter``) alike.

Each version's adapter (a peft folder) is loaded as ``policy-v<version>`` and every request names the newest
(vLLM: its ``model``; SGLang: its ``lora_path``). A new name per version: both servers key their prefix cache by
adapter, so no prefix cached under an older adapter serves a newer one. A request in flight keeps the adapter it
started with (its tokens carry that version); an older adapter is unloaded once no request of this client uses
it. Where the answer names the adapter that served it (vLLM), that is checked. The version a server holds is
that of the adapter this client loaded last, if the server lists it (``/v1/models``, which both servers extend
with their adapters)."""

from __future__ import annotations

from pathlib import Path

from strop.wire.errors import EngineRefusedError, EngineRequestError, EngineUnavailable, EngineVersionError

ADAPTER_NAME = "policy-v"  # + the weight version: the name each adapter version is loaded and requested by


def adapter_version(name: str, where: str) -> int:
    """The weight version in an adapter's name (``policy-v<version>``)."""
    if not name.startswith(ADAPTER_NAME) or not name[len(ADAPTER_NAME) :].isdigit():
        raise EngineVersionError(f"{where}: served by {name!r}, not one of strop's adapters ({ADAPTER_NAME}<N>)")
    return int(name[len(ADAPTER_NAME) :])


class RuntimeAdapters:
    """The adapter half of an HTTP engine (its ``_call``, ``_http``, ``url`` and ``timeout_s``). A dialect says
    where adapters load and unload (``load_route``, ``unload_route``), how a request names one (:meth:`_name`),
    which adapter an answer says served it (:meth:`_served`) and how the server is started for it
    (``howto``)."""

    load_route = unload_route = howto = ""

    def _name(self, body: dict, name: str) -> None:
        raise NotImplementedError

    def _served(self, out: dict) -> str | None:
        """The adapter the answer names (None: this server's answers name none)."""
        return None

    def _start_adapters(self) -> None:
        """(called by the engine's __init__)"""
        self.lora = False  # weights arrive as LoRA adapters (engine.sync=adapter): versions are adapter names
        self.adapter: str | None = None  # the newest adapter loaded: requests name it
        self._adapters: dict[str, int] = {}  # every adapter this client loaded and has not unloaded: requests in flight

    async def _adapter_request(self, path: str, body: dict) -> tuple[dict, int]:
        """POST ``body`` to ``path`` naming the newest adapter, kept loaded while the request runs; the answer and
        the version of the adapter that served it."""
        name = self.adapter  # (no await since the caller checked it: the adapter this request keeps)
        self._name(body, name)
        self._adapters[name] = self._adapters.get(name, 0) + 1
        try:
            out = await self._call("POST", path, json=body)
        finally:
            self._adapters[name] -= 1
            await self._unload_idle()
        served = self._served(out) if isinstance(out, dict) else "(no answer)"
        if served is not None and served != name:
            raise EngineVersionError(f"{self.url}: asked for adapter {name!r}, the answer was served by {served!r}")
        return out, adapter_version(name, self.url)

    async def _adapter_held(self) -> int:
        """The version of the adapter this client loaded last if the server lists it, else 0 (the base model: a
        restarted server lists none, and before the first load there is none)."""
        listed = self.adapter is not None and self.adapter in await self._listed()
        return adapter_version(self.adapter, self.url) if listed else 0

    async def load_runtime_adapter(self, path: str | Path, version: int) -> int:
        """Load the peft adapter folder ``path`` as ``policy-v<version>`` (its scale is in its config; the server
        computes no checksum strop can compare) and make it what requests name; unload older ones no request
        uses. Returns ``version`` once the server lists the adapter (``/v1/models``)."""
        name = f"{ADAPTER_NAME}{version}"
        self.lora = True
        try:  # (again after a restart: the server lists none of what this client loaded before)
            await self._adapter_post(self.load_route, {"lora_name": name, "lora_path": str(path)})
        except EngineRefusedError as exc:
            if "already" not in str(exc):  # (vLLM: "has already been loaded"; SGLang: "already exists")
                raise
        self._adapters.setdefault(name, 0)
        self.adapter = name
        held = await self.get_weight_version()
        if held != version:
            raise EngineVersionError(f"{self.url}: asked to load adapter {name}, lists {ADAPTER_NAME}{held} newest")
        await self._unload_idle()
        return held

    async def check_adapters(self, rank: int = 0, slots: int = 0) -> None:
        """Refuse, saying how to start it, a server without runtime LoRA loading (asked to unload an adapter no
        one loaded: the server answers that it has no such adapter where the route exists)."""
        try:
            await self._adapter_post(self.unload_route, {"lora_name": f"{ADAPTER_NAME}none"})
        except EngineRefusedError:
            pass
        self.lora = True
        for name in await self._listed():  # an earlier run's adapters: this run's versions start again at 1
            if name.startswith(ADAPTER_NAME) and name not in self._adapters:
                await self._adapter_post(self.unload_route, {"lora_name": name})

    async def _listed(self) -> list[str]:
        """The names the server serves (``/v1/models``: the model, then each adapter loaded)."""
        out = await self._call("GET", "/v1/models", timeout=10, retries=0)
        try:
            return [m["id"] for m in out["data"]]
        except (KeyError, TypeError) as exc:
            raise EngineVersionError(f"{self.url}: /v1/models lists no models ({exc!r}): {str(out)[:200]}") from None

    async def _unload_idle(self) -> None:
        """Unload every adapter older than the newest that no request of this client uses."""
        for name in [n for n, inflight in self._adapters.items() if n != self.adapter and inflight <= 0]:
            del self._adapters[name]
            try:
                await self._adapter_post(self.unload_route, {"lora_name": name})
            except (EngineRefusedError, EngineUnavailable):
                pass  # (gone already, or the server is: nothing is served by it either way)

    async def _adapter_post(self, path: str, body: dict):
        """POST to a LoRA route (the httpx response); a 404 without the route says how to start the server."""
        import httpx

        try:
            r = await self._http().post(self.url + path, json=body, timeout=self.timeout_s)
        except (httpx.TransportError, OSError) as exc:
            raise EngineUnavailable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc
        if r.status_code == 404 and r.text.replace(" ", "") == '{"detail":"NotFound"}':  # FastAPI's: no such route
            raise EngineRequestError(
                f"{self.url}: no {path} route: start the server with {self.howto}, or use engine.sync=disk (the "
                "merged weights)"
            )
        if r.status_code >= 500:
            raise EngineUnavailable(f"{self.url}{path}: HTTP {r.status_code}: {r.text[:300]}")
        if r.status_code >= 400:
            raise EngineRefusedError(f"{self.url}{path}: HTTP {r.status_code}: {r.text[:500]}", r.status_code)
        return r


class SGLangAdapters(RuntimeAdapters):
    """SGLang's dialect: ``/load_lora_adapter`` and ``/unload_lora_adapter``; a request names the adapter in
    ``lora_path`` (its GenerateReqInput field: a loaded adapter's name, or a path); answers name none."""

    load_route, unload_route = "/load_lora_adapter", "/unload_lora_adapter"
    howto = "--enable-lora --max-lora-rank R --lora-target-modules ... --max-loaded-loras N --max-loras-per-batch N+1"

    def _name(self, body: dict, name: str) -> None:
        body["lora_path"] = name

    async def check_adapters(self, rank: int = 0, slots: int = 0) -> None:
        """As every server's, and from SGLang's ``/server_info`` (its server arguments) before the run starts: LoRA
        enabled, adapters of ``rank`` taken, ``slots`` adapters loaded at once (a server without the route,
        strop serve, is not asked)."""
        await super().check_adapters(rank, slots)
        try:
            info = await self._call("GET", "/server_info", timeout=10, retries=0)
        except EngineRequestError as exc:
            if "HTTP 404" in str(exc):
                return
            raise
        if not isinstance(info, dict):
            return
        fix = f"start it with {self.howto} (R >= {rank}, N >= {slots}), or use engine.sync=disk (the merged weights)"
        if info.get("enable_lora") is False:
            raise EngineRequestError(f"{self.url}: SGLang runs without LoRA (enable_lora false): {fix}")
        if rank and isinstance(info.get("max_lora_rank"), int) and info["max_lora_rank"] < rank:
            raise EngineRequestError(
                f"{self.url}: SGLang takes adapters of rank {info['max_lora_rank']} at most, this run's are {rank}: {fix}"
            )
        if slots and isinstance(info.get("max_loaded_loras"), int) and info["max_loaded_loras"] < slots:
            raise EngineRequestError(
                f"{self.url}: SGLang keeps {info['max_loaded_loras']} adapters loaded, this run may be serving "
                f"{slots} versions at once (rollout.max_staleness + 2): {fix}"
            )


class VLLMAdapters(RuntimeAdapters):
    """vLLM's dialect: ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (plain-text answers); a request
    names the adapter as its ``model``, and each answer names the one that served it."""

    load_route, unload_route = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
    howto = "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora --max-lora-rank R --max-loras N --max-cpu-loras N"

    def _name(self, body: dict, name: str) -> None:
        body["model"] = name

    def _served(self, out: dict) -> str | None:
        return str(out.get("model"))

    check_adapters = RuntimeAdapters.check_adapters  # (not SGLang's, which VLLMEngine inherits through SGLangEngine)

    async def load_adapter(self, path: str | Path, version: int, scaling: float | None = None, checksum=None) -> int:
        """Load the adapter at run time as ``policy-v<version>`` (vLLM computes no checksum strop can compare)."""
        return await self.load_runtime_adapter(path, version)
