"""The Ray actors of a run (strop.cluster.ray_cluster places them): a trainer rank running ``strop train``,
an engine owning its server on its node, and what each tells the driver about where it runs.

Each actor first checks that it sees a file the driver wrote on the shared storage, so a node without it
fails with a message that says why instead of training on files the others cannot see.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Callable

from strop.engines.launch import LocalServer, engine_server


class ClusterError(RuntimeError):
    """The Ray cluster cannot be reached or used as configured."""


class TrainerRank:
    """A trainer rank: ``strop train`` with this rank's environment, in a Ray actor (the program handed down
    from the front door, run in the actor's process)."""

    def __init__(self, rank: int):
        self.rank = rank

    def __repr__(self) -> str:  # Ray prefixes the actor's output lines with it
        return f"rank{self.rank}"

    def where(self) -> dict:
        return _where()

    def free_port(self) -> int:
        return free_port_here()

    def run(self, main: Callable[[list[str]], int], argv: list[str], env: dict[str, str], cwd: str, marker: str) -> int:
        _check_shared(cwd, marker, f"rank {self.rank}")
        os.chdir(cwd)
        os.environ.update(env)
        # imports resolve as in the driver: its PYTHONPATH, then its working directory (as `python -m` does)
        for entry in [*env.get("PYTHONPATH", "").split(os.pathsep), cwd][::-1]:
            if entry and entry not in sys.path:
                sys.path.insert(0, entry)
        return main(argv)


class EngineServer:
    """An engine: a ``strop serve``, vLLM or SGLang server process on this actor's node (with the GPUs Ray gave
    the actor), started when the actor starts (again on the same port when Ray restarts it) and killed with the
    actor (parent-death signal). Every route on the node's address needs the run's token: strop serve checks
    it itself; vLLM and SGLang are reached only through strop's token guard."""

    def __init__(self, index: int, spec: dict, port: int, token: str, cwd: str, marker: str):
        _check_shared(cwd, marker, f"engine {index}")
        os.chdir(cwd)
        self.index, host = index, _node_ip()
        if spec["kind"] == "strop":  # its own token check covers every route
            self.server = LocalServer(
                spec["model"], port, list(spec["args"]), dict(spec["env"]), host=host, token=token
            )
        else:  # vLLM's and SGLang's keys leave routes open: strop's token guard on the node's address, the engine
            # where only this user's processes reach it (strop.engines.launch.engine_server)
            program = spec["command"] or [
                sys.executable,
                "-m",
                {"vllm": "vllm.entrypoints.openai.api_server", "sglang": "sglang.launch_server"}[spec["kind"]],
            ]
            self.server = engine_server(
                spec["kind"], program, spec["model"], host, port, token, spec["args"], spec["env"]
            )
        self.server.start().wait_healthy(spec["timeout_s"])

    def __repr__(self) -> str:
        return f"engine{self.index}"

    def where(self) -> dict:
        return _where() | {"url": self.server.url, "server_pid": self.server.proc.pid}

    def stop(self) -> None:
        self.server.stop()


def _where() -> dict:
    import ray

    return {
        "node": ray.get_runtime_context().get_node_id(),
        "ip": _node_ip(),
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }


def free_port_here() -> int:
    """A port free on this node's address (run in an actor or task on the node that will bind it)."""
    with socket.socket() as s:
        s.bind((_node_ip(), 0))
        return s.getsockname()[1]


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _check_shared(cwd: str, marker: str, who: str) -> None:
    if not Path(marker).is_file() or not Path(cwd).is_dir():
        raise ClusterError(
            f"{who} on {socket.gethostname()} cannot see {marker}, written by the driver: a run across "
            f"nodes needs the run directory's parent and the working directory {cwd} on shared "
            "storage, at the same path on every node"
        )
