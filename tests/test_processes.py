"""What a run leaves behind: after every ending (normal, error, SIGTERM, SIGKILL of the trainer) no
process it started remains; launched servers get the run's token; shutting down never hides the
run's own error and never waits forever."""

import asyncio
import signal
import time

import httpx
import pytest

from strop.config import build_config
from tests.proctree import Run, _alive, _cmdline
from tests.test_e2e import tiny_overrides

SECRET = "s3cret-launch-9c1e"


def _run_args(model_dir, run_dir, steps, *extra):
    return [
        f"--model.path={model_dir}",
        "--data.size=16",
        "--data.eval_size=0",
        "--rollout.prompts_per_step=2",
        "--rollout.n_samples_per_prompt=2",
        "--rollout.max_new_tokens=4",
        "--rollout.reward=tests.plugins:even_token_reward",
        f"--train.steps={steps}",
        "--train.micro_batch_size=4",
        "--run.progress=false",
        "--run.save_every=0",
        "--run.save_final=false",
        "--run.plot=false",
        "--run.threads=1",
        f"--run.dir={run_dir}",
        "--engine.kind=strop",
        "--engine.launch=1",
        '--engine.launch_args=["--threads=1"]',
        *extra,
    ]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ending", ["normal", "error", "sigterm", "sigkill"])
def test_no_process_of_the_run_remains_after_any_ending(tiny_model_dir, tmp_path, ending):
    """A real ``strop train`` with a launched strop serve: every descendant recorded while it ran
    is gone after it ends, however it ends (SIGKILL: the servers die with their parent)."""
    steps = 1 if ending in ("normal", "error") else 1000
    # (the run-time refusal, after the servers started: the trial at start is turned off)
    extra = ["--rollout.reward=tests.plugins:not_a_number_reward", "--rollout.check_reward=false"]
    extra = extra if ending == "error" else []
    run = Run(_run_args(tiny_model_dir, tmp_path / "run", steps, *extra))
    try:
        # servers up and the loop running: rollout has started (the router line is printed after launch)
        run.watch(lambda: "router over" in run.output and run.servers(), timeout_s=150)
        assert run.servers(), f"no strop serve child was seen:\n{run.output[-3000:]}"
        if ending == "sigterm":
            run.proc.send_signal(signal.SIGTERM)
        elif ending == "sigkill":
            run.proc.kill()
        run.watch(lambda: False, timeout_s=90)  # until the trainer exits
        code = run.proc.wait(timeout=30)
        run.reader.join(timeout=10)
        expected = {"normal": 0, "error": 1, "sigterm": 128 + signal.SIGTERM, "sigkill": -signal.SIGKILL}[ending]
        assert code == expected, f"exit code {code}:\n{run.output[-3000:]}"
        if ending == "sigterm":  # an orderly end: the summary says why
            assert '"status": "failed"' in (tmp_path / "run" / "summary.json").read_text()
            assert "SIGTERM" in (tmp_path / "run" / "summary.json").read_text()
        deadline = time.monotonic() + 15  # SIGKILL: the kernel's parent-death signal; the others: stop()
        while _alive(run.seen) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(run.seen), f"left behind after {ending}: {_alive(run.seen)}"
    finally:
        run.cleanup()


# ---- the launched servers' token ------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_a_launched_server_requires_the_runs_token_which_never_shows_in_ps(tiny_model_dir, tmp_path, monkeypatch):
    """engine.token reaches servers started by engine.launch (through the environment, never argv):
    their weight, group and abort routes refuse a request without it (401) and accept it with it."""
    from strop.setup_remote import remote_engine

    monkeypatch.delenv("STROP_ENGINE_TOKEN", raising=False)
    cfg = build_config(
        overrides=tiny_overrides(
            tiny_model_dir,
            tmp_path / "run",
            engine={"kind": "strop", "launch": 1, "launch_args": ["--threads=1"], "token": SECRET},
        )
    )
    router, servers = remote_engine(cfg, str(tiny_model_dir), tmp_path / "run", probe_ids=[1, 2])
    try:
        (server,) = servers
        assert SECRET not in _cmdline(server.proc.pid) and SECRET not in repr(servers)  # `ps` shows argv to all
        url = server.url
        for route, body in [
            ("/update_weights_from_disk", {"model_path": str(tiny_model_dir)}),
            (
                "/init_weights_update_group",
                {
                    "master_address": "127.0.0.1",
                    "master_port": 1,
                    "rank_offset": 1,
                    "world_size": 2,
                    "group_name": "g",
                    "backend": "gloo",
                },
            ),
            ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [], "group_name": "g"}),
            ("/abort_request", {"abort_all": True}),
            ("/flush_cache", {}),
        ]:
            for auth in ({}, {"Authorization": "Bearer wrong"}):
                r = httpx.post(url + route, json=body, headers=auth, timeout=30)
                assert r.status_code == 401, (route, auth, r.status_code, r.text)
        yes = {"Authorization": f"Bearer {SECRET}"}
        assert httpx.post(url + "/flush_cache", headers=yes, timeout=30).status_code == 200
        assert httpx.post(url + "/abort_request", json={"abort_all": True}, headers=yes, timeout=30).status_code == 200
        assert {c.headers.get("Authorization") for c in router.engines} == {f"Bearer {SECRET}"}
    finally:
        for s in servers:
            s.stop()
    # its output is the run's: in the run directory, kept after the server stopped
    assert server.log_path == tmp_path / "run" / "engines" / f"{server.port}.log"
    assert f"on http://127.0.0.1:{server.port}" in server.log_path.read_text()


@pytest.mark.timeout(60)
def test_a_temporary_server_log_is_deleted_when_stopped_and_kept_when_the_server_ended_by_itself(tmp_path):
    """Without a log_dir a server's output goes to a temporary file: gone once stop() ended the server (or kill()
    did), appended to when it is started again, kept (and named in the error) when the server ended by itself."""
    import sys

    from strop.engines.launch import LocalServer

    def server(code: str) -> LocalServer:
        return LocalServer("", 1, command=[sys.executable, "-c", code]).start()

    def printed(s: LocalServer, text: str) -> bool:
        deadline = time.monotonic() + 20
        while text not in s.log_tail() and time.monotonic() < deadline:
            time.sleep(0.05)
        return text in s.log_tail()

    long = "import time; print('serving', flush=True); time.sleep(60)"
    stopped, killed = server(long), server(long)
    assert printed(stopped, "serving") and printed(killed, "serving")
    path = stopped.log_path
    stopped.stop()
    assert not path.exists()
    killed.kill()
    first = killed.log_path
    killed.start()  # started again: the same file, appended to
    assert killed.log_path == first and printed(killed, "serving\nserving")
    killed.kill()
    killed.stop()
    assert not first.exists()

    failed = server("import sys; print('no model here', flush=True); sys.exit(3)")
    try:
        with pytest.raises(RuntimeError, match="exited with code 3") as err:
            failed.wait_healthy(20)
        assert str(failed.log_path) in str(err.value) and "no model here" in str(err.value)
        assert "no model here" in failed.log_path.read_text()  # (kept: stop() ran inside wait_healthy)
        failed.stop()
        assert failed.log_path.exists()
    finally:
        failed.log_path.unlink(missing_ok=True)


def test_launched_servers_get_a_fresh_token_when_none_is_set(tmp_path, monkeypatch):
    """No engine.token: servers this run starts still protect their weight routes, with a token
    made for the run and given to the router's clients."""
    import strop.engines.launch as launch
    from strop.setup_remote import remote_engine

    monkeypatch.delenv("STROP_ENGINE_TOKEN", raising=False)
    given = []

    def fake_launch(n, model_path, *, args=(), token=None, timeout_s=180.0, log_dir=None):
        given.append(token)
        return [launch.LocalServer(model_path, 40000 + i, list(args)) for i in range(n)]

    monkeypatch.setattr(launch, "launch_servers", fake_launch)
    cfg = build_config(overrides={"engine": {"kind": "strop", "launch": 2}, "run": {"dir": str(tmp_path / "r")}})
    router, _ = remote_engine(cfg, "unused", tmp_path / "r", probe_ids=[1])
    (token,) = given
    assert token and len(token) >= 32
    assert {c.headers.get("Authorization") for c in router.engines} == {f"Bearer {token}"}
    remote_engine(cfg, "unused", tmp_path / "r", probe_ids=[1])
    assert given[1] != token  # one per run


# ---- shutting down in process ---------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_failure_building_the_controller_still_stops_what_build_started(tiny_model_dir, tmp_path, monkeypatch):
    import strop.loop
    import strop.roles.rollout
    from strop.setup import Components

    closed = []
    monkeypatch.setattr(Components, "close", lambda self, run=None: closed.append(self))

    class Broken:
        def __init__(self, *args):
            raise RuntimeError("manager could not start")

    monkeypatch.setattr(strop.roles.rollout, "RolloutManager", Broken)
    with pytest.raises(RuntimeError, match="manager could not start"):
        strop.loop.train(build_config(overrides=tiny_overrides(tiny_model_dir, tmp_path / "run")))
    assert len(closed) == 1  # the launched servers (here: none) and the engine are stopped


@pytest.mark.timeout(120)
def test_a_failing_shutdown_never_hides_the_runs_own_error(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import strop.loop
    import strop.roles.rollout
    from strop.setup import Components

    def rollout(self, step):
        raise RuntimeError("the run's own error")

    def close(self, run=None):
        raise OSError("close failed too")

    monkeypatch.setattr(strop.roles.rollout.Rollout, "next", rollout)
    monkeypatch.setattr(Components, "close", close)
    with pytest.raises(RuntimeError, match="the run's own error"):
        strop.loop.train(build_config(overrides=tiny_overrides(tiny_model_dir, tmp_path / "run")))
    assert "close failed too" in capsys.readouterr().err  # said, not lost


@pytest.mark.timeout(60)
def test_waiting_on_the_event_loop_has_a_limit_and_cancels_what_it_waited_for():
    from strop.rollout.event_loop import EventLoopThread

    events = EventLoopThread(timeout_s=60)
    try:
        cancelled = []

        async def hangs():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

        t = time.monotonic()
        with pytest.raises(TimeoutError, match="hangs.*0.3s"):
            events.run(hangs(), timeout_s=0.3)
        assert time.monotonic() - t < 5
        deadline = time.monotonic() + 5
        while not cancelled and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cancelled

        async def own_timeout():  # the coroutine's own TimeoutError is not the wait's
            raise TimeoutError("the engine timed out")

        with pytest.raises(TimeoutError, match="the engine timed out"):
            events.run(own_timeout(), timeout_s=30)
    finally:
        events.close(timeout_s=5)
    assert not events.thread.is_alive() and events.loop.is_closed()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_the_ranks_of_nproc_end_with_their_launcher(tiny_model_dir, tmp_path, sig):
    """``strop train --nproc 2``: SIGTERM to the launcher stops both ranks before it exits; after a
    SIGKILL the kernel ends them (their parent-death signal)."""
    args = [a for a in _run_args(tiny_model_dir, tmp_path / "run", 1000) if not a.startswith("--engine.")]
    run = Run(["--nproc=2", *args])
    try:
        run.watch(lambda: "strop: device" in run.output and len(run.seen) >= 2, timeout_s=150)
        assert len(run.seen) >= 2, run.output[-3000:]
        run.proc.send_signal(sig)
        run.watch(lambda: False, timeout_s=60)
        assert run.proc.wait(timeout=30) == (128 + sig if sig == signal.SIGTERM else -sig), run.output[-3000:]
        deadline = time.monotonic() + 15
        while _alive(run.seen) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(run.seen), f"left behind: {_alive(run.seen)}"
    finally:
        run.cleanup()


@pytest.mark.timeout(240)
def test_a_server_whose_port_another_program_took_starts_again_on_a_free_one(tiny_model_dir):
    """Between free_port() and the server's bind another program may take the port (a gloo store of a process
    beside it, say). Health checks that reach that program's non-HTTP replies keep waiting, and the server that
    could not bind is started again on another free port; without retries, the error says what happened."""
    import socket
    import threading

    from strop.engines.launch import LocalServer

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(8)
    port, stop = taken.getsockname()[1], threading.Event()

    def answer_in_binary():  # (what a gloo store's port answered a health check with)
        taken.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = taken.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"\x00\x00@\x00\x00\x00@\xfe\x00\x00?\r\n")

    thread = threading.Thread(target=answer_in_binary, daemon=True)
    thread.start()
    servers = []
    try:
        for retries in (0, 1):
            server = LocalServer(str(tiny_model_dir), port, ["--threads=1"], port_retries=retries).start()
            servers.append(server)
            if retries == 0:
                with pytest.raises(RuntimeError, match=f"strop serve on port {port} exited") as err:
                    server.wait_healthy(120)
                assert "address already in use" in str(err.value).lower()
            else:
                assert server.wait_healthy(120) is server and server.port != port and server.port_retries == 0
                assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    finally:
        stop.set()
        thread.join(5)
        taken.close()
        for s in servers:
            s.stop()


def test_a_supervised_commands_exit_code_survives_its_watchdog_starting_late():
    """The supervisor forks a watchdog after starting the command and waits for that fork only: a command that
    ends before the fork's first child has exited keeps its own exit code (it was reaped by the wait for the
    fork, and reported as code 0, when the machine was slow), and the group's SIGTERM at the end does not reach the
    watchdog while it still has the supervisor's handler (which SIGKILLs the group: code -9)."""
    import subprocess
    import sys

    script = (
        "import os, sys, time\n"
        "from strop.serving import supervisor\n"
        "fork, forks = os.fork, []\n"
        "def late_fork():\n"
        "    pid = fork()\n"
        "    if pid == 0 and not forks:  # the watchdog's first process is slow: the command ends first\n"
        "        time.sleep(1.5)\n"
        "    forks.append(pid)\n"
        "    return pid\n"
        "os.fork = late_fork\n"
        "sys.exit(supervisor.supervise_group(os.getppid(), [sys.executable, '-c', 'import sys; sys.exit(3)']))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], start_new_session=True, timeout=60)
    assert done.returncode == 3
