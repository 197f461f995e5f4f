"""The Ray launcher: trainer ranks and engines as Ray actors, placed by the plan across the cluster's nodes.

Ray decides where processes run, not what they do: each trainer actor runs the same ``strop train``
as a rank of ``--nproc`` (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR from the plan, the master on
rank 0's node), so data parallel, FSDP2 and context parallel work unchanged, and rank 0 stays the
controller. Engine actors each own a server on their node (strop serve, vLLM or SGLang); their URLs reach
rank 0's router, which fails over when one dies and re-admits it, restarted by Ray, once it holds the
current weights. This process (the driver) only places, watches and stops: when a trainer rank dies, every
other rank gets ``cluster.stop_timeout_s`` to end on its own, then is killed; whatever happens,
the run's actors, their servers, the placement group and a local cluster it started end with it.

Several nodes need shared storage: the run directory (metrics, checkpoints, the weights engines load
from disk) and the working directory must be the same path on every node. Each actor checks that it
sees a file the driver wrote there before it starts.
"""

from __future__ import annotations

import logging
import json
import os
import secrets
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Callable

from strop.cluster.placement import Node, Plan, PlacementError, plan_placement
from strop.cluster.ray_actors import ClusterError, EngineServer, TrainerRank, free_port_here
from strop.engines.launch import LocalServer, adapter_slots, engine_flags, model_flags, sglang_lora_args, vllm_lora_args
from strop.config import secret_fields
from strop.models import resolve_model_path
from strop.process import free_port

log = logging.getLogger(__name__)

LOG_GRACE_S = 1.0
LOCAL_START_S = 120.0  # until `ray start --head` of a local cluster reports it runs
ENGINE_START_S = {"strop": 180.0, "vllm": 600.0, "sglang": 600.0}  # until a launched server answers /health
ENGINE_STOP_TIMEOUT_S = 30.0  # for the engine actors to stop their servers (SIGTERM, 10 s, SIGKILL) at the end
PIN = 0.001  # of a node's own resource, in each bundle: it holds the bundle to the node the plan chose


def import_ray():
    try:
        import ray
    except ImportError:
        raise ClusterError("cluster.launcher='ray' needs Ray: pip install -e '.[ray]' (from a checkout)") from None
    return ray


def connect(ray, address: str, timeout_s: float, namespace: str, what: str) -> None:
    """Join the cluster at ``address`` ('auto', 'host:port'); a bad address fails within ``timeout_s``. The
    run's actors are named in ``namespace`` (rank0, engine0, ...)."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # every rank's lines, each with its prefix
    if address is not None and address != "auto":
        host, _, port = address.removeprefix("ray://").rpartition(":")
        if not host or not port.isdigit():
            raise ClusterError(f"cluster.address={address!r}: expected 'auto' or 'host:port' of the head's GCS")
        try:
            socket.create_connection((host, int(port)), timeout=timeout_s).close()
        except OSError as exc:
            raise ClusterError(
                f"cluster.address={address!r}: cannot reach a Ray head there within {timeout_s:g}s "
                f"({exc}); start one with `ray start --head` or fix the address"
            ) from exc
    try:
        ray.init(address=address, namespace=namespace, configure_logging=False, log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ClusterError(f"{what}: {exc}") from exc


def start_local_cluster(timeout_s: float = LOCAL_START_S):
    """A one-node Ray cluster of the run's own, on loopback, that ends with this process, SIGKILL included:
    ``ray start --head --block`` in a process group tied to this process (strop.engines.launch), which holds
    the GCS, the raylet and the raylet's agents (``ray.init``'s own local cluster leaves those agents running
    when its driver is SIGKILLed). Ports are picked here and the auth token is the run's own (RAY_AUTH_TOKEN,
    which :func:`launch` sets before Ray is imported), so runs side by side never meet. Returns the head's
    process (``.stop()`` ends the cluster) and its GCS address."""
    gcs, dashboard, client, agent = (free_port() for _ in range(4))
    head = LocalServer(
        "",
        gcs,
        command=[
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs}",
            f"--dashboard-port={dashboard}",
            f"--ray-client-server-port={client}",
            f"--dashboard-agent-listen-port={agent}",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
    ).start()
    deadline = time.monotonic() + timeout_s
    while "Ray runtime started" not in head.log_tail(100_000):
        if head.proc.poll() is not None or time.monotonic() > deadline:
            state, tail = "exited" if head.proc.poll() is not None else "still starting", head.log_tail()
            head.stop()  # (which deletes the log of a head it ended)
            raise ClusterError(
                f"a local Ray cluster did not start within {timeout_s:g}s (`ray start --head` {state}):\n{tail}"
            )
        time.sleep(0.2)
    return head, f"127.0.0.1:{gcs}"


def cluster_nodes(ray) -> list[Node]:
    return [Node(n["NodeID"], n["NodeManagerAddress"], dict(n["Resources"])) for n in ray.nodes() if n["Alive"]]


def node_pins(nodes: list[Node]) -> dict[str, str]:
    """For each node, a resource only it has (``node:<ip>`` on a real cluster, a custom one when nodes
    share an address); a bundle asks for a sliver of it to land there."""
    pins = {}
    for n in nodes:
        own = [k for k in n.resources if k.startswith("node:") and not k.startswith("node:__")] + sorted(n.resources)
        unique = [
            k
            for k in own
            if "memory" not in k
            and k not in ("CPU", "GPU")
            and not any(k in m.resources for m in nodes if m.id != n.id)
        ]
        if not unique and len(nodes) > 1:
            raise ClusterError(
                f"node {n.id[:12]} ({n.address}) has no resource of its own to tell it apart from the "
                "other nodes at the same address: start each node with one, e.g. ray start "
                "--resources='{\"node_a\": 1}'"
            )
        pins[n.id] = unique[0] if unique else ""
    return pins


def reserve(ray, plan: Plan, timeout_s: float):
    """A placement group of the plan's bundles, each held to its node; a PlacementError naming what is
    not free if Ray cannot place it within ``timeout_s`` (never a hang)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    pins = node_pins(plan.nodes)
    bundles = [dict(b.resources) | ({pins[b.node]: PIN} if pins[b.node] else {}) for b in plan.bundles]
    pg = placement_group(bundles, strategy="PACK", name=f"strop-{uuid.uuid4().hex[:8]}")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise PlacementError(
            f"the plan's resources were not free within cluster.placement_timeout_s={timeout_s:g}s "
            f"(held by other work?): {_shortfall(ray, plan)}"
        )
    return pg


def _shortfall(ray, plan: Plan) -> str:
    """What each node of the plan lacks right now, e.g. "node 1a2b: CPU 2 needed, 0 free"."""
    try:
        from ray._private.state import available_resources_per_node

        free = available_resources_per_node()
    except Exception:  # (a private API: fall back to the cluster's totals)
        return f"the cluster has {ray.available_resources()} free"
    lines = []
    for n in plan.nodes:
        need: dict[str, float] = {}
        for b in plan.bundles:
            if b.node == n.id:
                for k, v in b.resources.items():
                    need[k] = need.get(k, 0.0) + v
        short = [
            f"{k} {v:g} needed, {free.get(n.id, {}).get(k, 0.0):g} free"
            for k, v in sorted(need.items())
            if free.get(n.id, {}).get(k, 0.0) < v - 1e-9
        ]
        if short:
            lines.append(f"missing on node {n.id[:12]} ({n.address}): " + ", ".join(short))
    return "; ".join(lines) or f"the cluster has {ray.available_resources()} free"


def _options(resources: dict[str, float], pg, index: int, **extra) -> dict:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    rest = dict(resources)
    return {
        "num_cpus": rest.pop("CPU", 0.0),
        "num_gpus": rest.pop("GPU", 0.0),
        "resources": rest,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
        **extra,
    }


def run_dir_of(cfg) -> Path:
    """The run directory, named here (``runs/<timestamp>`` unless run.dir) so that every actor writes
    into the same one."""
    if cfg.run.dir:
        return Path(cfg.run.dir).resolve()
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
    path = Path("runs") / stamp
    while path.exists():
        path, n = Path("runs") / f"{stamp}-{n}", n + 1
    return path.resolve()


def launch(cfg, argv: list[str], main: Callable[[list[str]], int]) -> int:
    """``strop train`` with ``cluster.launcher=ray``: place, start, watch and stop the run's actors.
    ``main``: the program every trainer rank runs in its actor (handed down from the front door), with
    ``argv``, the command line of every rank (the run directory is added here)."""
    c = cfg.cluster
    if c.address is None:  # read when ray is imported
        os.environ |= {
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # the local cluster binds 127.0.0.1 only
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
        }  # its head's and ours
    ray = import_ray()
    head, address = start_local_cluster() if c.address is None else (None, c.address)  # before ray.init reads it
    pg, actors, engines, marker = None, [], [], None
    try:
        connect(
            ray,
            address,
            c.connect_timeout_s,
            f"strop-{uuid.uuid4().hex[:12]}",
            "the run's local cluster" if head else f"cluster.address={c.address!r}",
        )
        nodes = cluster_nodes(ray)
        engine_resources = c.engine_resources if cfg.engine.launch else {}
        plan = plan_placement(
            nodes, c.trainer_ranks, c.trainer_resources, cfg.engine.launch, engine_resources, c.placement
        )
        log.info(
            f"strop: ray: {'a local cluster' if head else c.address}, {len(nodes)} node(s); "
            f"{c.placement} placement:\n{plan.table()}"
        )
        run_dir = run_dir_of(cfg)
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        marker = run_dir.parent / f".strop-ray-{uuid.uuid4().hex[:12]}"
        marker.write_text("a file every actor must see: the run directory is on shared storage\n")
        pg = reserve(ray, plan, c.placement_timeout_s)
        cwd = os.getcwd()
        env = {name: os.environ[name] for name in [*secret_fields().values(), "PYTHONPATH"] if name in os.environ}
        engines_at: list[dict] = []
        if cfg.engine.launch:
            token = cfg.engine.token.get_secret_value() if cfg.engine.token else secrets.token_urlsafe(32)
            engines, engines_at = start_engines(ray, cfg, plan, pg, token, str(run_dir), cwd, str(marker))
            actors += engines
            env |= {"STROP_ENGINE_URLS": json.dumps([w["url"] for w in engines_at]), "STROP_ENGINE_TOKEN": token}
        ranks = _start_ranks(ray, c, plan, pg)
        actors += ranks
        where = ray.get([a.where.remote() for a in ranks])
        report(where, engines_at)
        _check_plan(plan, where, engines_at)
        runs = _run_ranks(ray, c, plan, ranks, where, main, [*argv, f"--run.dir={run_dir}"], env, cwd, str(marker))
        code = supervise(ray, runs, where, c.stop_timeout_s)
        time.sleep(LOG_GRACE_S)  # Ray's log monitor delivers the actors' last lines before they are killed
        return code
    finally:
        stop(ray, actors, pg, head, marker, engines)


def _start_ranks(ray, c, plan: Plan, pg) -> list:
    """One actor per trainer rank, each in the bundle the plan gave it; never restarted (a dead rank ends the run)."""
    return [
        ray.remote(TrainerRank)
        .options(
            **_options(c.trainer_resources, pg, plan.rank_bundle(r), max_restarts=0, max_concurrency=2, name=f"rank{r}")
        )
        .remote(r)
        for r in range(c.trainer_ranks)
    ]


def _run_ranks(
    ray, c, plan: Plan, ranks: list, where: list[dict], main, argv: list[str], env: dict, cwd: str, marker: str
) -> dict:
    """Start ``main`` in every rank's actor with its rank's environment (the master on rank 0's node); returns
    each run's reference with its rank."""
    master_port = ray.get(ranks[0].free_port.remote())
    gpu = c.trainer_resources.get("GPU", 0) > 0
    common = {
        "WORLD_SIZE": str(c.trainer_ranks),
        "MASTER_ADDR": where[0]["ip"],
        "MASTER_PORT": str(master_port),
        "STROP_NODE_IP": where[0]["ip"],
    } | env
    return {
        ranks[r].run.remote(
            main,
            argv,
            # Ray shows each actor only its own GPU (CUDA_VISIBLE_DEVICES): cuda:0 there
            common | {"RANK": str(r), "LOCAL_RANK": "0" if gpu else str(plan.local_rank(r))},
            cwd,
            marker,
        ): r
        for r in range(c.trainer_ranks)
    }


def engine_args(cfg, run_dir: str) -> tuple[list[str], dict[str, str]]:
    """The flags and environment of each engine server the run launches: the model's loading options, a LoRA
    run's adapter settings for vLLM and SGLang (they load each version's adapter), strop serve's weights folder,
    then the user's engine.launch_args and engine.launch_env."""
    e = cfg.engine
    args, env = [*model_flags(e.kind, cfg.model), *engine_flags(e), *e.launch_args], dict(e.launch_env)
    if cfg.algo.routing_replay and e.kind in ("vllm", "sglang"):  # both servers' flag for returning the routes
        args = ["--enable-return-routed-experts", *args]
    lora, slots = cfg.model.lora_rank and e.sync in ("auto", "adapter"), adapter_slots(cfg.rollout)
    if lora and e.kind == "vllm":
        lora_args, lora_env = vllm_lora_args(cfg.model.lora_rank, slots)
        args, env = [*lora_args, *args], lora_env | env
    elif lora and e.kind == "sglang":
        args = [*sglang_lora_args(cfg.model.lora_rank, slots, list(cfg.model.lora_target_modules)), *args]
    if e.kind == "strop":  # the one folder its /update_weights_from_disk may read
        args.append(f"--weights-dir={Path(e.sync_dir or Path(run_dir) / 'weights').resolve()}")
    return args, env


def start_engines(ray, cfg, plan: Plan, pg, token: str, run_dir: str, cwd: str, marker: str) -> tuple[list, list]:
    """One actor per engine, each serving on its node; Ray restarts one that dies (``cluster.engine_restarts``
    times) on the same port, where the router finds it again. Returns the actors and where each runs
    (node, pid, URL, server pid), once every one is healthy."""
    e = cfg.engine
    args, env = engine_args(cfg, run_dir)
    model = cfg.model.path
    if e.kind != "strop":  # (strop serve resolves it itself; vLLM and SGLang need a folder or a hub id)
        model = resolve_model_path(model, cfg.model.revision)
        model = str(Path(model).resolve()) if Path(model).exists() else model
    spec = {
        "kind": e.kind,
        "model": model,
        "args": args,
        "command": list(e.launch_command),
        "env": env,
        "timeout_s": ENGINE_START_S[e.kind],
    }
    # each engine's port, picked on its own node (a restarted actor binds it again, where the router looks)
    pick = ray.remote(free_port_here)
    ports = ray.get([pick.options(**_options({}, pg, plan.engine_bundle(i))).remote() for i in range(e.launch)])
    engines = []
    for i in range(e.launch):
        options = _options(
            cfg.cluster.engine_resources,
            pg,
            plan.engine_bundle(i),
            name=f"engine{i}",
            max_restarts=cfg.cluster.engine_restarts,
            max_concurrency=2,
        )
        engines.append(ray.remote(EngineServer).options(**options).remote(i, spec, ports[i], token, cwd, marker))
    return engines, ray.get([x.where.remote() for x in engines])  # every one healthy (or its failure, raised here)


def report(ranks: list[dict], engines: list[dict]) -> None:
    """Print where each actor runs (as each reported it, beside the plan's table)."""
    for kind, found in (("rank", ranks), ("engine", engines)):
        for i, w in enumerate(found):
            extra = f", {w['url']}, server pid {w['server_pid']}" if "url" in w else ""
            log.info(f"strop: ray: {kind} {i} on node {w['node'][:12]} ({w['ip']}), pid {w['pid']}{extra}")


def _check_plan(plan: Plan, ranks: list[dict], engines: list[dict]) -> None:
    """Every actor runs on the node the plan gave it (each reported its own)."""
    for kind, found, node_of in (
        ("rank", ranks, plan.node_of_rank),
        ("engine", engines, lambda i: plan.bundles[plan.engine_bundle(i)].node),
    ):
        for i, w in enumerate(found):
            if w["node"] != node_of(i):
                raise ClusterError(f"{kind} {i} runs on node {w['node'][:12]}, the plan put it on {node_of(i)[:12]}")


def supervise(ray, runs: dict, where: list[dict], stop_timeout_s: float) -> int:
    """Wait for every rank; the first that fails or dies stops the run: the others get
    ``stop_timeout_s`` to end on their own, then are killed. Returns the run's exit code."""
    pending = list(runs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        rank = runs[done[0]]
        code, why = _outcome(ray, done[0])
        if code == 0:
            continue
        w = where[rank]
        log.warning(f"strop: rank {rank} on node {w['node'][:12]} ({w['host']}, {w['ip']}, pid {w['pid']}) {why}")
        if pending:
            _, left = ray.wait(pending, num_returns=len(pending), timeout=stop_timeout_s)
            if left:
                log.error(
                    f"strop: stopping rank(s) {sorted(runs[r] for r in left)}: still running "
                    f"{stop_timeout_s:g}s after rank {rank} failed"
                )
        return code
    return 0


def _outcome(ray, ref) -> tuple[int, str]:
    from ray.exceptions import RayActorError, RayTaskError

    try:
        code = ray.get(ref)
    except RayActorError as exc:
        return 1, f"died: {str(exc).splitlines()[0]}"
    except RayTaskError as exc:
        return 1, f"failed: {exc}"
    return code, f"exited with code {code}"


def stop(ray, actors: list, pg, head, marker: Path | None, engines: list = ()) -> None:
    """End the run's actors (their servers die with them), the placement group, and a local cluster. Each
    engine actor first stops its server and waits for the server's process group to end: killing the actor
    alone leaves that to the server's watchdog, which may finish after the run has returned."""
    if engines:
        try:
            ray.get([e.stop.remote() for e in engines], timeout=ENGINE_STOP_TIMEOUT_S)
        except Exception as exc:  # an actor already gone: its watchdog ends its server
            log.warning(f"strop: ray: an engine did not stop cleanly ({type(exc).__name__}); killing its actor")
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception as exc:  # already gone
            log.warning(f"strop: ray: could not kill {a}: {exc}")
    if pg is not None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(pg)
    if marker is not None:
        marker.unlink(missing_ok=True)
    ray.shutdown()
    if head is not None:  # the run's own local cluster
        head.stop()
