"""Start and stop local ``strop serve`` processes (``engine.launch: N``)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class LocalServer:
    """One ``strop serve`` child process on 127.0.0.1."""

    model_path: str
    port: int
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "LocalServer":
        fd, log = tempfile.mkstemp(prefix=f"strop-serve-{self.port}-", suffix=".log")
        self.log_path = Path(log)
        cmd = [sys.executable, "-m", "strop.cli", "serve", f"--model-path={self.model_path}", f"--port={self.port}",
               *self.args]
        self.proc = subprocess.Popen(cmd, stdout=fd, stderr=fd, env={**os.environ, **self.env})
        os.close(fd)
        return self

    def wait_healthy(self, timeout_s: float = 180.0) -> "LocalServer":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"strop serve on port {self.port} exited with code {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"strop serve on port {self.port} not healthy within {timeout_s:.0f}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path and self.log_path.exists() else ""

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        """SIGKILL: the engine dies mid-request (failure tests)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def launch_servers(n: int, model_path: str, *, args: list[str] = (), timeout_s: float = 180.0) -> list[LocalServer]:
    """Start ``n`` local servers on free ports and wait until every one answers /health."""
    from strop.parallel.launch import free_port

    servers = [LocalServer(model_path, free_port(), list(args)).start() for _ in range(n)]
    try:
        for s in servers:
            s.wait_healthy(timeout_s)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers
