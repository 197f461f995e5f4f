"""Start and stop local servers: ``strop serve`` processes (``engine.launch: N``), and the vLLM and SGLang
servers of Ray's engine actors (:func:`engine_server`).

No server outlives the run that started it. Each runs in a session of its own, so stopping it
ends its whole process group; and it is started through the engine side's supervisor
(``python -m strop.serving.supervisor``, handed the program to run), which asks the kernel to SIGKILL it
when its parent dies (``PR_SET_PDEATHSIG``), so a trainer killed with SIGKILL takes its servers with it.
The bearer token travels in the environment, never in argv (which ``ps`` shows every user).

A server's output goes to ``<log_dir>/<port>.log`` where it is given one (a run's launched servers: the run
directory's ``engines/``), kept. Without one it goes to a temporary file, deleted when ``stop`` ends a server that
was running; a server that ended by itself keeps its file, whose path its error names.

A vLLM or SGLang server is reached only through strop's token guard (:mod:`strop.serving.guard`), which
listens on the advertised address and runs in the server's supervisor, so the two live and die together:
their own API keys leave routes open (vLLM's all but ``/v1/*``, among them the weight-loading
``/collective_rpc``), so the engine itself listens only where this user's processes reach it.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from strop.process import free_port
from strop.wire.auth import GUARD_TOKEN_ENV

GROUP_EXIT_S = 10.0  # for a killed server's process group to be gone
STROP_SERVE = (sys.executable, "-m", "strop.cli", "serve")  # the program of a LocalServer without ``command``
SUPERVISOR = (sys.executable, "-m", "strop.serving.supervisor")  # what every server is started under


@dataclass
class LocalServer:
    """One ``strop serve`` child process, on 127.0.0.1 unless ``host`` (another address needs a token); or,
    with ``command``, another server; with ``upstream`` too, that server listens there and strop's token guard
    on ``host:port`` in front of it."""

    model_path: str
    port: int
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # may hold the token
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    host: str = "127.0.0.1"
    command: list[str] | None = None  # another server's full command line (vllm_command); default strop serve
    upstream: str | None = None  # where ``command`` listens (unix:/path, 127.0.0.1:port): guarded on host:port
    token: str | None = field(default=None, repr=False)  # strop serve's or the guard's (health checks send it)
    private_dir: Path | None = None  # 0700, this server's: start-up secrets (deleted once it answers), its socket
    port_retries: int = 0  # times to start again on another free port when ``port`` was taken before it bound
    log_dir: Path | None = None  # where its output goes (<port>.log, kept); None: a temporary file (module doc)
    killed: bool = field(default=False, init=False, repr=False)  # ended by kill(), not by itself

    @property
    def name(self) -> str:
        return "strop serve" if self.command is None else Path(self.command[0]).name + " server"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "LocalServer":
        """Start the server. The kernel's parent-death signal follows the thread that starts it
        (Linux's rule): start servers from a thread that lives as long as they should."""
        if self.log_dir is None and self.log_path is None:
            fd, log = tempfile.mkstemp(prefix=f"strop-serve-{self.port}-", suffix=".log")
            self.log_path = Path(log)
        else:  # (started again: the same temporary log, appended to)
            if self.log_dir is not None:
                self.log_path = Path(self.log_dir) / f"{self.port}.log"
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.killed = False
        tied = [*SUPERVISOR, str(os.getpid())]
        env = {**os.environ, **self.env}
        if self.command is None:
            if self.token:  # strop serve's own check, on every route
                env["STROP_SERVE_TOKEN"] = self.token
            cmd = [
                *tied,
                "run",
                *STROP_SERVE,
                f"--model-path={self.model_path}",
                f"--host={self.host}",
                f"--port={self.port}",
                *self.args,
            ]
        elif self.upstream is None:
            cmd = [*tied, "exec", *self.command]
        else:
            if not self.token:
                raise ValueError(f"{self.name}: a guarded server (upstream={self.upstream!r}) needs a token")
            cmd = [*tied, "guard", self.host, str(self.port), self.upstream, *self.command]
            env[GUARD_TOKEN_ENV] = self.token
        self.proc = subprocess.Popen(cmd, stdout=fd, stderr=fd, env=env, start_new_session=True)
        os.close(fd)
        return self

    def wait_healthy(self, timeout_s: float = 180.0) -> "LocalServer":
        """Wait until /health answers 200; then the start-up files of ``private_dir`` (SGLang's key) are
        deleted: read by now, and a killed process never gets to delete them later."""
        deadline = time.monotonic() + timeout_s
        health = urllib.request.Request(
            self.url + "/health", headers={"Authorization": f"Bearer {self.token}"} if self.token else {}
        )
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()  # what it started, and its private folder
                if self.port_retries > 0 and "address already in use" in self.log_tail().lower():
                    self.port, self.port_retries = free_port(), self.port_retries - 1  # (another process took it)
                    return self.start().wait_healthy(max(deadline - time.monotonic(), 1.0))
                raise RuntimeError(
                    f"{self.name} on port {self.port} exited with code {self.proc.returncode} (its output: "
                    f"{self.log_path}):\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(health, timeout=2) as r:
                    if r.status == 200:
                        for f in self.private_dir.iterdir() if self.private_dir else ():
                            if f.is_file():  # (not the engine's socket)
                                f.unlink()
                        return self
            except (OSError, http.client.HTTPException):  # (an HTTP error: the guard's 502 while the engine starts;
                time.sleep(0.3)  # a reply that is not HTTP: another program on the port, before this one bound)
        tail = self.log_tail()  # (read before stop deletes a temporary log)
        self.stop()
        raise TimeoutError(f"{self.name} on port {self.port} not healthy within {timeout_s:.0f}s:\n{tail}")

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path and self.log_path.exists() else ""

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``grace_s``; then whatever of the
        group is left (a child the server started) is killed too."""
        if self.proc is None:
            return
        ended_here = self.proc.poll() is None or self.killed
        if ended_here:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait()
        self._signal_group(signal.SIGKILL)
        # a killed process lingers while the kernel frees its memory (GBs for an engine): return when the
        # group is gone, so that "stopped" means no process of it is left
        deadline = time.monotonic() + GROUP_EXIT_S
        while time.monotonic() < deadline and self._group_alive():
            time.sleep(0.05)
        if self.private_dir is not None:
            shutil.rmtree(self.private_dir, ignore_errors=True)
        if ended_here and self.log_dir is None and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)  # (a temporary log of a server that ran until asked to stop)

    def _group_alive(self) -> bool:
        """A process of the server's group is still running (not a zombie waiting to be reaped)."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:  # ended while being read
                continue
            if int(fields[2]) == self.proc.pid and fields[0] != "Z":
                return True
        return False

    def kill(self) -> None:
        """SIGKILL: the engine dies mid-request (failure tests)."""
        if self.proc is not None and self.proc.poll() is None:
            self._signal_group(signal.SIGKILL)
            self.proc.wait()
            self.killed = True

    def _signal_group(self, sig: int) -> None:
        try:  # the group is the server's pid (its own session); it may be gone already
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def model_flags(kind: str, model) -> list[str]:
    """``model``'s loading options (a ModelConfig: revision, trust_remote_code, attn_implementation) as the flags
    of a launched server of ``kind``, so it loads what the trainer loads: strop serve takes all three; vLLM and
    SGLang take ``--revision`` and ``--trust-remote-code`` (their attention is their own)."""
    flags = ["--trust-remote-code"] if model.trust_remote_code else []
    if model.revision:
        flags += ["--revision", model.revision]
    if kind == "strop" and model.attn_implementation:
        flags += ["--attn-implementation", model.attn_implementation]
    return flags


def engine_flags(engine) -> list[str]:
    """The ``engine`` section's own settings as launched strop serve flags (engine.speculative, cpu_kernels,
    compile_attention, compile_step)."""
    if engine.kind != "strop":
        return []
    flags = ["--speculative", str(engine.speculative)] if engine.speculative else []
    flags += ["--compile-attention"] if engine.compile_attention else []
    flags += ["--compile-step"] if engine.compile_step else []
    return flags + (["--cpu-kernels", engine.cpu_kernels] if engine.cpu_kernels != "auto" else [])


def adapter_slots(rollout) -> int:
    """How many LoRA adapter versions an engine may be serving at once in a run of ``rollout`` (its section): the
    newest, those rollouts still in flight started with (one behind in ``one_step_off``, up to
    ``max_staleness`` in ``async``), and one loading."""
    behind = {"sync": 0, "one_step_off": 1}.get(rollout.mode, rollout.max_staleness)
    return behind + 2


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM 0.32's --max-lora-rank takes


def vllm_lora_args(rank: int, slots: int) -> tuple[list[str], dict[str, str]]:
    """The flags and environment of a vLLM server that loads a LoRA run's adapters at run time: rank ``rank``
    (rounded up to a value vLLM takes) and ``slots`` adapters at once, in a batch and in its cache, so no adapter a
    request still uses is evicted (:func:`adapter_slots`)."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"model.lora_rank={rank}: vLLM serves LoRA adapters of rank {VLLM_LORA_RANKS[-1]} at most")
    n = str(slots)
    args = ["--enable-lora", "--max-lora-rank", str(fits[0]), "--max-loras", n, "--max-cpu-loras", n]
    return args, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def sglang_lora_args(rank: int, slots: int, targets: list[str]) -> list[str]:
    """The flags of an SGLang server (0.5.23) that loads a LoRA run's adapters at run time: rank ``rank`` on the
    modules ``targets``, and ``slots`` adapters loaded at once, each of them in a running batch (which counts
    requests of the base model too)."""
    n = str(slots)
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(rank),
        "--lora-target-modules",
        *targets,
        "--max-loaded-loras",
        n,
        "--max-loras-per-batch",
        str(slots + 1),
    ]


def launch_servers(
    n: int,
    model_path: str,
    *,
    args: list[str] = (),
    token: str | None = None,
    timeout_s: float = 180.0,
    log_dir: Path | None = None,
) -> list[LocalServer]:
    """Start ``n`` local servers on free ports and wait until every one answers /health.
    ``token``: required on every route; ``log_dir``: where their output goes (``<port>.log``)."""
    servers = []
    try:
        for _ in range(n):
            server = LocalServer(model_path, free_port(), list(args), token=token, port_retries=2, log_dir=log_dir)
            servers.append(server.start())
        for s in servers:
            s.wait_healthy(timeout_s)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


def vllm_command(program: list[str], model_path: str, socket_path: str, args: list[str] = ()) -> list[str]:
    """One vLLM OpenAI server as strop drives it: sampled-token logprobs after temperature, strop's worker
    extension and its broadcast as the weight-transfer backend (``gloo``, unless ``args`` name one) (its API key, VLLM_API_KEY, and VLLM_SERVER_DEV_MODE=1 travel in the
    environment), listening on the Unix socket ``socket_path`` only (its key guards /v1 alone: strop's token
    guard stands in front). ``program``: what starts it, e.g.
    ``[".../bin/python", "-m", "vllm.entrypoints.openai.api_server"]``."""
    return [
        *program,
        "--model",
        model_path,
        "--uds",
        socket_path,
        "--logprobs-mode",
        "processed_logprobs",
        "--worker-extension-cls",
        "strop.serving.vllm_worker.StropWorkerExtension",
        *([] if "--weight-transfer-config" in args else ["--weight-transfer-config", '{"backend": "gloo"}']),
        *args,
    ]


def sglang_command(
    program: list[str], model_path: str, host: str, port: int, config: str, args: list[str] = ()
) -> list[str]:
    """One SGLang server as strop drives it. Its API key (which every route but /health, /ready and /metrics then
    requires) cannot come from the environment: it is in ``config``, a YAML file of SGLang's ``--config`` that only
    this user can read (:func:`write_sglang_config`), never in argv. ``program``: what starts it, e.g.
    ``[".../bin/python", "-m", "sglang.launch_server"]``."""
    return [*program, "--model-path", model_path, "--host", host, "--port", str(port), "--config", config, *args]


def write_sglang_config(path: Path, api_key: str) -> str:
    """The YAML file of :func:`sglang_command`, readable by its owner only (written before it holds the key)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"api-key: {json.dumps(api_key)}\n")  # a JSON string is a YAML string
    return str(path)


def engine_server(
    kind: str,
    program: list[str],
    model_path: str,
    host: str,
    port: int,
    token: str,
    args: list[str] = (),
    env: dict[str, str] | None = None,
) -> LocalServer:
    """A vLLM or SGLang server as strop launches it (not started yet): strop's token guard on ``host:port``,
    which refuses every request without ``token``, and the engine behind it where only this user's processes
    reach it, with its own key set too. vLLM listens on a Unix socket in a 0700 folder of its own; SGLang,
    which cannot, on a free port of 127.0.0.1, where its key guards every route but ``/health*``,
    ``/metrics`` and OPTIONS. ``env``: more environment for the engine."""
    private = Path(tempfile.mkdtemp(prefix=f"strop-{kind}-"))  # mode 0700: this user's alone
    if kind == "vllm":
        sock = private / "engine.sock"
        if len(str(sock).encode()) > 107:  # sun_path's size on Linux, with its NUL
            shutil.rmtree(private)
            raise ValueError(
                f"vLLM's socket path {sock} is over the 107 bytes a Unix socket takes: set TMPDIR to a shorter folder"
            )
        command, upstream = vllm_command(program, model_path, str(sock), args), f"unix:{sock}"
        own = {"VLLM_API_KEY": token, "VLLM_SERVER_DEV_MODE": "1"}
    elif kind == "sglang":  # its API key in a file of SGLang's --config, deleted once it answers
        inner = free_port()
        config = write_sglang_config(private / "server.yaml", token)
        command, upstream, own = (
            sglang_command(program, model_path, "127.0.0.1", inner, config, args),
            f"127.0.0.1:{inner}",
            {},
        )
    else:
        shutil.rmtree(private)
        raise ValueError(f"engine kind {kind!r}: strop launches a guarded 'vllm' or 'sglang' server")
    return LocalServer(
        model_path,
        port,
        list(args),
        own | dict(env or {}),
        host=host,
        command=command,
        upstream=upstream,
        token=token,
        private_dir=private,
    )
