"""Start and stop local ``strop serve`` processes (``engine.launch: N``).

No server outlives the run that started it. Each runs in a session of its own, so stopping it
ends its whole process group; and it is started through this module's ``__main__``, which asks
the kernel to SIGKILL it when its parent dies (``PR_SET_PDEATHSIG``), so a trainer killed with
SIGKILL takes its servers with it. The bearer token travels in the environment, never in argv
(which ``ps`` shows every user).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class LocalServer:
    """One ``strop serve`` child process, on 127.0.0.1 unless ``host`` (another address needs a token)."""

    model_path: str
    port: int
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # may hold the token
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    host: str = "127.0.0.1"
    command: list[str] | None = None  # another server's full command line (vllm_command); default strop serve

    @property
    def name(self) -> str:
        return "strop serve" if self.command is None else Path(self.command[0]).name + " server"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "LocalServer":
        """Start the server. The kernel's parent-death signal follows the thread that starts it
        (Linux's rule): start servers from a thread that lives as long as they should."""
        fd, log = tempfile.mkstemp(prefix=f"strop-serve-{self.port}-", suffix=".log")
        self.log_path = Path(log)
        tied = [sys.executable, "-m", "strop.engines.launch", str(os.getpid())]
        cmd = [*tied, "serve", f"--model-path={self.model_path}", f"--host={self.host}", f"--port={self.port}",
               *self.args] if self.command is None else [*tied, "exec", *self.command]
        self.proc = subprocess.Popen(cmd, stdout=fd, stderr=fd, env={**os.environ, **self.env}, start_new_session=True)
        os.close(fd)
        return self

    def wait_healthy(self, timeout_s: float = 180.0) -> "LocalServer":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} on port {self.port} exited with code {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"{self.name} on port {self.port} not healthy within {timeout_s:.0f}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path and self.log_path.exists() else ""

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``grace_s``; then whatever of the
        group is left (a child the server started) is killed too."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait()
        self._signal_group(signal.SIGKILL)

    def kill(self) -> None:
        """SIGKILL: the engine dies mid-request (failure tests)."""
        if self.proc is not None and self.proc.poll() is None:
            self._signal_group(signal.SIGKILL)
            self.proc.wait()

    def _signal_group(self, sig: int) -> None:
        try:  # the group is the server's pid (its own session); it may be gone already
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def launch_servers(n: int, model_path: str, *, args: list[str] = (), token: str | None = None,
                   timeout_s: float = 180.0) -> list[LocalServer]:
    """Start ``n`` local servers on free ports and wait until every one answers /health.
    ``token``: required by their weight, group and abort routes (passed as STROP_SERVE_TOKEN)."""
    from strop.cluster.process import free_port

    env = {"STROP_SERVE_TOKEN": token} if token else {}
    servers = []
    try:
        for _ in range(n):
            servers.append(LocalServer(model_path, free_port(), list(args), dict(env)).start())
        for s in servers:
            s.wait_healthy(timeout_s)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


def supervise_group(parent: int, command: list[str]) -> int:
    """Run ``command`` in this process's group (LocalServer made it a session of its own) and end the whole
    group, the command's own children included, when ``parent`` dies or this process is told to stop: a
    parent-death signal reaches only a direct child, and vLLM's engine and worker processes would outlive it.
    Under Ray, an actor's death also SIGKILLs its direct children (this process); a watchdog that is not
    its child then ends the group."""
    from strop.cluster.process import die_with_parent

    signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
    die_with_parent(parent, signal.SIGTERM)
    child = subprocess.Popen(command)
    _watch(parent)
    code = child.wait()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)  # whatever the command left behind, and the watchdog (this process ignores it)
    return code


def _watch(parent: int, every_s: float = 0.5) -> None:
    """A grandchild of this process, in its group, re-parented away from it: once ``parent`` is gone, it
    SIGKILLs the group (itself included)."""
    if os.fork() == 0:
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            while True:
                time.sleep(every_s)
                try:
                    os.kill(parent, 0)
                except ProcessLookupError:
                    os.killpg(0, signal.SIGKILL)
        os._exit(0)
    os.wait()


def vllm_command(program: list[str], model_path: str, host: str, port: int, args: list[str] = ()) -> list[str]:
    """One vLLM OpenAI server as strop drives it: sampled-token logprobs after temperature, and strop's worker
    extension for the broadcast (its API key, VLLM_API_KEY, and VLLM_SERVER_DEV_MODE=1 travel in the
    environment). ``program``: what starts it, e.g. ``[".../bin/python", "-m", "vllm.entrypoints.openai.api_server"]``."""
    return [*program, "--model", model_path, "--host", host, "--port", str(port), "--logprobs-mode",
            "processed_logprobs", "--worker-extension-cls", "strop.engines.vllm_worker.StropWorkerExtension", *args]


def sglang_command(program: list[str], model_path: str, host: str, port: int, config: str, args: list[str] = ()
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


if __name__ == "__main__":  # python -m strop.engines.launch PARENT_PID serve|exec ...: a server tied to its parent
    from strop.cluster.process import die_with_parent

    if sys.argv[2] == "exec":  # another program, which may start processes of its own (vLLM does)
        sys.exit(supervise_group(int(sys.argv[1]), sys.argv[3:]))
    die_with_parent(int(sys.argv[1]))
    from strop.cli import main

    sys.exit(main(sys.argv[2:]))
