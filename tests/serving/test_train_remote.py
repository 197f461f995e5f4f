"""`strop train` with rollouts from launched `strop serve` processes behind the router."""

import json
import re

import httpx
import pytest

from strop.config import build_config
from strop.loop import train
from tests.test_e2e import tiny_overrides


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sync", ["disk", "delta", "broadcast"])
def test_train_with_two_launched_servers(tiny_model_dir, tmp_path, capsys, sync):
    run_dir = tmp_path / "run"
    cfg = tiny_overrides(
        tiny_model_dir, run_dir, engine={"kind": "strop", "launch": 2, "launch_args": ["--threads=1"], "sync": sync}
    )
    summary = train(build_config(overrides=cfg))
    out = capsys.readouterr().out
    urls = re.search(r"router over 2 launched strop serve processes: (.*)", out).group(1).split(", ")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert summary["status"] == "completed" and len(steps) == 2
    # the servers sample with the weights the trainer has: engine and trainer logprobs agree
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-4 for r in steps)
    # after every update each server scored the probe as the trainer did (SGLang's input_token_logprobs)
    assert all(r["weight_probe_max_diff"] < 1e-4 for r in steps), [r["weight_probe_max_diff"] for r in steps]
    assert f"weight sync: {sync} (engine.sync)" in out
    written = sorted(p.name for p in (run_dir / "weights").glob("v*")) if sync != "broadcast" else []
    assert written == {"disk": ["v1", "v2"], "delta": ["v1-delta0", "v2-delta0"], "broadcast": []}[sync]
    for url in urls:  # launched by the run, stopped by the run
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
