"""strop serve and strop proxy load a model as strop train does (model.revision, trust_remote_code,
attn_implementation), and the servers a run launches get the run's model options: a model that ships its own
code is served only when told to trust it."""

import json
import shutil

import pytest

from strop.config import build_config
from strop.engines.launch import LocalServer, model_flags
from strop.process import free_port

CONFIGURATION = """from transformers import LlamaConfig


class RemoteConfig(LlamaConfig):
    model_type = "strop_remote_llama"
"""
MODELING = """from transformers import LlamaForCausalLM

from .configuration_remote import RemoteConfig


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig
"""


@pytest.fixture(scope="module")
def remote_code_model(tiny_model_dir, tmp_path_factory):
    """The tiny model as a model that ships its own code (a model type transformers does not know)."""
    path = tmp_path_factory.mktemp("remote-code") / "model"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config |= {
        "model_type": "strop_remote_llama",
        "architectures": ["RemoteForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_remote.RemoteConfig",
            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
        },
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "configuration_remote.py").write_text(CONFIGURATION)
    (path / "modeling_remote.py").write_text(MODELING)
    return path


def test_model_flags_name_what_each_server_takes():
    plain = build_config().model
    assert model_flags("strop", plain) == model_flags("vllm", plain) == model_flags("sglang", plain) == []
    model = build_config(
        overrides={"model": {"trust_remote_code": True, "revision": "v1.0", "attn_implementation": "eager"}}
    ).model
    assert model_flags("strop", model) == [
        "--trust-remote-code",
        "--revision",
        "v1.0",
        "--attn-implementation",
        "eager",
    ]
    # vLLM and SGLang choose their own attention; both take the other two under these names
    assert model_flags("vllm", model) == model_flags("sglang", model) == ["--trust-remote-code", "--revision", "v1.0"]


@pytest.mark.timeout(240)
def test_strop_serve_serves_a_remote_code_model_only_when_told(remote_code_model, tmp_path):
    untold = LocalServer(str(remote_code_model), free_port(), ["--threads=1"]).start()
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 1.*trust_remote_code"):
        untold.wait_healthy(120)
    told = LocalServer(str(remote_code_model), free_port(), ["--threads=1", "--trust-remote-code"]).start()
    try:
        told.wait_healthy(120)
        import httpx

        r = httpx.post(
            told.url + "/generate",
            json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
            timeout=60,
        )
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 3
    finally:
        told.stop()


def test_the_proxys_engine_loads_with_the_model_options(remote_code_model, tiny_model_dir):
    from strop.agents.serve import build_engine

    common = dict(device="cpu", dtype="float32", max_batch_size=2, seed=0)
    with pytest.raises(ValueError, match="trust_remote_code"):
        build_engine(str(remote_code_model), [], "strop", None, **common)
    engine, *_ = build_engine(
        str(remote_code_model), [], "strop", None, **common, model_options={"trust_remote_code": True}
    )
    assert type(engine.model).__name__ == "RemoteForCausalLM"
    engine, *_ = build_engine(
        str(tiny_model_dir), [], "strop", None, **common, model_options={"attn_implementation": "eager"}
    )
    assert engine.model.config._attn_implementation == "eager"


def test_servers_a_run_launches_get_its_model_options(monkeypatch, tiny_model_dir, tmp_path):
    import strop.engines.launch as launch
    from strop.setup_remote import remote_engine

    seen = {}

    def record(n, model_path, *, args=(), token=None, timeout_s=180.0, log_dir=None):
        seen.update(n=n, model_path=model_path, args=list(args))
        raise RuntimeError("recorded")  # stop here: what would have been launched is known

    monkeypatch.setattr(launch, "launch_servers", record)
    cfg = build_config(
        overrides={
            "model": {"path": str(tiny_model_dir), "trust_remote_code": True, "attn_implementation": "eager"},
            "engine": {"kind": "strop", "launch": 2, "launch_args": ["--threads=1"]},
        }
    )
    with pytest.raises(RuntimeError, match="recorded"):
        remote_engine(cfg, str(tiny_model_dir), tmp_path, probe_ids=[1, 2])
    assert seen["n"] == 2 and seen["args"][:4] == [
        "--trust-remote-code",
        "--attn-implementation",
        "eager",
        "--threads=1",
    ]
