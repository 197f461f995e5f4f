"""The mistakes a new user makes, through the real command (``python -m strop.cli train`` in a fresh directory):
each fails fast, before any model loads where it can, with one line that names what is wrong and how to fix it,
and leaves nothing behind; or, where the run goes on, its start lines say what it runs on."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

FAST_S = 20.0  # a refusal before any model loads: python, torch and the config (seconds here, on a shared CPU)
ROWS = [{"prompt": "1+1?", "label": "2"}, {"prompt": "2+2?", "label": "4"}, {"prompt": "3+1?", "label": "4"}]


def _small(tiny_model_dir) -> list[str]:
    return [
        f"--model.path={tiny_model_dir}",
        "--data.size=8",
        "--data.eval_size=0",
        "--rollout.prompts_per_step=2",
        "--rollout.n_samples_per_prompt=2",
        "--rollout.max_new_tokens=4",
        "--train.steps=1",
        "--run.progress=false",
        "--run.plot=false",
    ]


def _train(cwd: Path, *args: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "strop.cli", "train", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    return proc, time.monotonic() - t0


def _one_line_error(proc) -> str:
    """The refusal: its last line of stderr, with no traceback before it."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr.strip().splitlines()[-1]


def _files(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``folder``: its digest and modification time (ns)."""
    return {
        str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prompts(tmp_path) -> Path:
    (tmp_path / "my.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return tmp_path / "my.jsonl"


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory) -> Path:
    """A finished run on a prompt file given as data.path alone, with no checkpoint (run.save_every=0)."""
    cwd = tmp_path_factory.mktemp("finished")
    (cwd / "my.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    proc, _ = _train(cwd, *_small(tiny_model_dir), "--data.path=my.jsonl", "--run.save_every=0", "--run.dir=done")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = cwd / "done"
    assert (run / "final").is_dir() and (run / "metrics.jsonl").is_file() and not (run / "checkpoints").exists()
    return run


# ---- data -----------------------------------------------------------------------------------------------
def test_data_path_alone_trains_on_the_file_and_the_start_lines_say_so(finished_run):
    # before: data.path without data.source=file was ignored, the run trained on basic_arithmetic
    assert "source: file" in (finished_run / "config.yaml").read_text()
    assert json.loads((finished_run / "summary.json").read_text())["status"] == "completed"
    rows = [json.loads(x) for x in (finished_run / "samples.jsonl").read_text().splitlines()]
    assert rows and {r["prompt"] for r in rows} <= {q["prompt"] for q in ROWS}  # the file's prompts, not arithmetic


def test_start_lines_name_the_model_the_data_the_reward_and_the_engine(tiny_model_dir, prompts, tmp_path):
    proc, _ = _train(tmp_path, *_small(tiny_model_dir), "--data.path=my.jsonl", "--rollout.reward=exact_match")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = ["strop: " + x.split("strop: ", 1)[1] for x in proc.stdout.splitlines() if "strop: " in x]  # (no time)
    assert f"strop: model {tiny_model_dir}" in lines
    assert "strop: data: file my.jsonl: 3 training prompts; no held-out set (data.eval_path names one)" in lines
    assert "strop: reward: exact_match" in lines
    assert any(x.startswith("strop: engine: embedded") for x in lines)


def _bar(text: str) -> bool:
    """tqdm's bar as strop draws it: 'N/M [elapsed<left, rate]' with its unit, step."""
    return "1/1 [" in text and ("s/step" in text or "step/s" in text)


@pytest.mark.timeout(300)
def test_the_progress_bar_is_drawn_on_a_terminal_only(tiny_model_dir, tmp_path):
    import fcntl
    import os
    import pty
    import struct
    import termios

    args = [a for a in _small(tiny_model_dir) if a != "--run.progress=false"]  # run.progress at its default
    piped, _ = _train(tmp_path, *args, "--run.dir=piped")  # stderr into a pipe, as a log file or CI takes it
    assert piped.returncode == 0, piped.stderr[-3000:]
    assert not _bar(piped.stderr) and "\r" not in piped.stderr
    assert "strop: model" in piped.stdout  # (the start lines still come)
    master, slave = pty.openpty()  # stderr on a terminal of 80 columns (a new one has 0: tqdm would draw nothing)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "strop.cli", "train", *args, "--run.dir=tty"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=slave,
    )
    os.close(slave)
    drawn = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        drawn += chunk
    os.close(master)
    assert proc.wait(timeout=60) == 0, drawn.decode(errors="replace")[-3000:]
    assert _bar(drawn.decode(errors="replace"))
    log = (tmp_path / "tty" / "run.log").read_text()
    assert "strop: model" in log and not _bar(log)  # the run's log keeps the lines, never the bar


def test_start_lines_name_the_reasoning_gym_task(tiny_model_dir, tmp_path):
    proc, _ = _train(tmp_path, *_small(tiny_model_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "strop: data: reasoning-gym task 'basic_arithmetic'" in proc.stdout
    assert "8 training prompts (data.seed=1); no held-out set (data.eval_size=0)" in proc.stdout
    assert "strop: reward: math" in proc.stdout


def test_data_path_with_source_reasoning_gym_is_refused_naming_both(tiny_model_dir, prompts, tmp_path):
    proc, took = _train(tmp_path, *_small(tiny_model_dir), "--data.source=reasoning_gym", "--data.path=my.jsonl")
    assert proc.returncode == 2 and took < FAST_S, proc.stderr[-3000:]
    assert "data.path='my.jsonl'" in proc.stderr and "data.source='reasoning_gym'" in proc.stderr
    assert "data.source=file" in proc.stderr  # the fix
    assert list(tmp_path.iterdir()) == [prompts]


def test_eval_path_alone_asks_for_the_training_file(tiny_model_dir, prompts, tmp_path):
    proc, took = _train(tmp_path, *_small(tiny_model_dir), "--data.eval_path=my.jsonl")
    assert proc.returncode == 2 and took < FAST_S, proc.stderr[-3000:]
    assert "needs data.path" in proc.stderr and "data.eval_path='my.jsonl'" in proc.stderr


def test_a_missing_data_file_is_named_by_its_key(tiny_model_dir, tmp_path):
    proc, took = _train(tmp_path, *_small(tiny_model_dir), "--data.path=typo.jsonl")
    assert proc.returncode == 1 and took < FAST_S
    line = _one_line_error(proc)
    assert "data.path='typo.jsonl': no such file" in line and str(tmp_path / "typo.jsonl") in line
    assert list(tmp_path.iterdir()) == []  # no run directory


def test_an_eval_path_pointing_nowhere_is_named_by_its_key(tiny_model_dir, prompts, tmp_path):
    args = [*_small(tiny_model_dir), "--data.path=my.jsonl", "--data.eval_path=held/out.jsonl", "--data.eval_size=2"]
    proc, took = _train(tmp_path, *args)
    assert proc.returncode == 1 and took < FAST_S
    assert "data.eval_path='held/out.jsonl': no such file" in _one_line_error(proc)
    assert list(tmp_path.iterdir()) == [prompts]


def test_a_reward_that_cannot_score_the_file_fails_before_the_model_loads(tiny_model_dir, prompts, tmp_path):
    # before: every sample of step 1 failed (failed_samples.jsonl), then a traceback "no trainable sample"
    proc, took = _train(tmp_path, *_small(tiny_model_dir), "--data.path=my.jsonl", "--rollout.reward=reasoning_gym")
    assert proc.returncode == 1 and took < FAST_S
    line = _one_line_error(proc)
    assert "rollout.reward='reasoning_gym' cannot score my.jsonl:1" in line and "reasoning_gym_entry" in line
    assert "rollout.reward=math" in line  # the fix
    assert list(tmp_path.iterdir()) == [prompts]


def test_a_trl_reward_reading_a_column_the_file_lacks_fails_before_the_model_loads(tiny_model_dir, prompts, tmp_path):
    # before: only built-in rewards were tried at start; a user's reward failed every sample of step 1
    (tmp_path / "my_rewards.py").write_text(
        "def by_difficulty(completions, difficulty, **kwargs):\n    return [float(d) for d in difficulty]\n"
    )
    proc, took = _train(tmp_path, *_small(tiny_model_dir), "--data.path=my.jsonl", "--rollout.reward=my_rewards.py")
    assert proc.returncode == 1 and took < FAST_S
    line = _one_line_error(proc)
    assert "rollout.reward='my_rewards.py' cannot score my.jsonl:1" in line
    assert "difficulty" in line and "rollout.check_reward=false" in line  # the error, and the way past the trial
    assert not (tmp_path / "runs").exists() and {p.name for p in tmp_path.iterdir()} <= {
        "my.jsonl",
        "my_rewards.py",
        "__pycache__",
    }


# ---- the run directory ----------------------------------------------------------------------------------
def test_resume_of_a_finished_run_without_checkpoint_is_refused_and_touches_nothing(finished_run, tmp_path):
    # before: "no complete checkpoint ... starting again from step 0", metrics.jsonl and final/ written over
    run = tmp_path / "done"
    shutil.copytree(finished_run, run)
    before = _files(run)
    proc, took = _train(tmp_path, f"--resume={run}")
    assert proc.returncode == 1 and took < FAST_S, proc.stderr[-3000:]
    line = _one_line_error(proc)
    assert f"--resume {run}" in line and "no checkpoint to resume from" in line
    assert _files(run) == before  # every file as it was: contents and modification times


def test_a_new_run_into_a_finished_run_directory_is_refused_and_touches_nothing(tiny_model_dir, finished_run, tmp_path):
    run = tmp_path / "done"
    shutil.copytree(finished_run, run)
    before = _files(run)
    proc, took = _train(tmp_path, *_small(tiny_model_dir), f"--run.dir={run}")
    assert proc.returncode == 1 and took < FAST_S
    assert f"run.dir={str(run)!r} already exists" in _one_line_error(proc)
    assert _files(run) == before


@pytest.mark.parametrize("which", ["no/such/run", "empty"])
def test_resume_of_a_directory_that_is_no_run_is_refused(tmp_path, which):
    (tmp_path / "empty").mkdir()
    proc, took = _train(tmp_path, f"--resume={which}")
    assert proc.returncode == 2 and took < FAST_S
    assert f"--resume {which}: not a strop run directory" in _one_line_error(proc)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


# ---- the engine -----------------------------------------------------------------------------------------
def test_an_engine_url_that_refuses_connections_fails_at_start_naming_it(tiny_model_dir, tmp_path):
    # before: every sample failed, then a traceback "step 1: no trainable sample"
    url = f"http://127.0.0.1:{_free_port()}"
    proc, took = _train(tmp_path, *_small(tiny_model_dir), "--engine.kind=strop", f'--engine.urls=["{url}"]')
    assert proc.returncode == 1 and took < FAST_S, proc.stderr[-3000:]
    line = _one_line_error(proc)
    assert f"no server answers at {url}" in line and "Connection refused" in line and "engine.launch" in line
    assert list(tmp_path.iterdir()) == []


def test_an_engine_url_that_is_no_url_is_named(tiny_model_dir, tmp_path):
    proc, took = _train(tmp_path, *_small(tiny_model_dir), "--engine.kind=sglang", '--engine.urls=["localhost"]')
    assert proc.returncode == 1 and took < FAST_S
    assert "engine.urls: 'localhost' is not an http(s) URL" in _one_line_error(proc)


def test_the_reachability_check_takes_any_http_answer_and_gives_up_in_seconds():
    from strop.engines.http import EngineUnreachable, check_reachable

    class Refuses(BaseHTTPRequestHandler):  # up, but no /health of its own (or a token it wants): the router's
        def do_GET(self):
            self.send_response(401)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Refuses)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        check_reachable([f"http://127.0.0.1:{server.server_port}/"], deadline_s=1.0)
    finally:
        server.shutdown()
        server.server_close()
    dead = f"http://127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    with pytest.raises(EngineUnreachable, match=f"no server answers at {dead}"):
        check_reachable([dead], deadline_s=1.0)
    assert 0.7 < time.monotonic() - t0 < 3.0  # retried for about the deadline, no longer


# ---- the command line ----------------------------------------------------------------------------------
def test_a_misspelled_option_is_named_with_the_right_one(tmp_path):
    proc, took = _train(tmp_path, "--train.stpes=3")
    assert proc.returncode == 2 and took < FAST_S
    assert "--train.stpes" in proc.stderr and "--train.steps" in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "arg, said", [("--train.steps=abc", "valid integer"), ("--train.steps=-3", "greater than 0")], ids=["type", "neg"]
)
def test_a_bad_value_is_named_with_its_key_and_what_was_given(tmp_path, arg, said):
    proc, took = _train(tmp_path, arg)
    assert proc.returncode == 2 and took < FAST_S
    assert "train.steps:" in proc.stderr and said in proc.stderr and arg.split("=")[1] in proc.stderr
    assert list(tmp_path.iterdir()) == []
