"""model.attn_implementation, model.trust_remote_code and model.revision reach transformers; a hub id that is
neither cached nor reachable fails at once with one line; a cached one loads without the network."""

import os
import subprocess
import sys
import time

import pytest

import strop.models as models
from strop.config import build_config


def test_attn_implementation_reaches_the_model(tiny_model_dir):
    assert models.load_model(str(tiny_model_dir), attn_implementation="eager").config._attn_implementation == "eager"
    assert models.load_model(str(tiny_model_dir)).config._attn_implementation == "sdpa"  # transformers' default
    meta = models.meta_model(str(tiny_model_dir), attn_implementation="eager")
    assert meta.config._attn_implementation == "eager"
    cfg = build_config(overrides={"model": {"path": str(tiny_model_dir), "attn_implementation": "eager"}})
    model = models.load_model(cfg.model.path, **cfg.model.load_options())
    assert model.config._attn_implementation == "eager"


def test_the_options_default_to_todays_loading():
    cfg = build_config()
    assert cfg.model.load_options() == {"attn_implementation": None, "trust_remote_code": False, "revision": None}


def test_a_bad_attn_implementation_is_a_config_error(tmp_path):
    from strop.config import ConfigError

    with pytest.raises(ConfigError, match="attn_implementation"):
        build_config(overrides={"model": {"attn_implementation": "flash"}})


def test_revision_is_ignored_for_a_local_folder(tiny_model_dir):
    model = models.load_model(str(tiny_model_dir), revision="no-such-branch")
    assert model.config.num_hidden_layers == 2
    assert models.load_tokenizer(str(tiny_model_dir), revision="no-such-branch").pad_token_id is not None


def test_hub_id_revision_and_remote_code_are_passed_through(monkeypatch):
    import transformers

    calls = []

    def fake(kind):
        def from_pretrained(path, **kw):
            calls.append((kind, path, kw))
            raise RuntimeError("stop here")

        return from_pretrained

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake("model"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake("tokenizer"))
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", fake("config"))
    monkeypatch.setattr(models, "hub_offline", lambda: False)
    monkeypatch.setattr(models, "hub_reachable", lambda timeout=3.0: True)
    opts = {"attn_implementation": "eager", "trust_remote_code": True, "revision": "abc123"}
    for load in (models.load_model, models.load_tokenizer, models.load_config):
        with pytest.raises(RuntimeError, match="stop here"):
            load("some-org/some-model", **opts)
    model, tokenizer, config = calls
    assert model[:2] == ("model", "some-org/some-model")
    assert model[2]["revision"] == "abc123" and model[2]["trust_remote_code"] is True
    assert model[2]["attn_implementation"] == "eager"
    assert tokenizer == ("tokenizer", "some-org/some-model", {"trust_remote_code": True, "revision": "abc123"})
    assert config == ("config", "some-org/some-model", {"trust_remote_code": True, "revision": "abc123"})
    calls.clear()
    with pytest.raises(RuntimeError):
        models.load_model("gpt2")  # a bare hub id is a hub id; defaults add nothing
    assert calls[0][1] == "gpt2" and set(calls[0][2]) == {"dtype"}


def _fake_cache(root, repo, files=("config.json",)):
    commit = "0" * 40
    folder = root / f"models--{repo.replace('/', '--')}"
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    for f in files:
        (snap / f).write_text("{}")
    return snap


def test_offline_uses_the_cache_or_says_why_in_one_line(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snap = _fake_cache(tmp_path, "org/cached")
    assert models.resolve_model_path("org/cached") == str(snap)
    for repo, revision in (("org/missing", None), ("gpt2", None), ("org/cached", "v2")):
        t = time.perf_counter()
        with pytest.raises(FileNotFoundError) as err:
            models.resolve_model_path(repo, revision)
        assert time.perf_counter() - t < 1.0
        msg = str(err.value)
        assert msg.startswith(f"model {repo!r}") and "\n" not in msg and "does not exist" not in msg
        assert msg.endswith(
            "not a local folder, not in the local Hugging Face cache, and no network (HF_HUB_OFFLINE is set)"
        )
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.resolve_model_path("./not/here")  # a path, not a hub id
    with pytest.raises(FileNotFoundError, match="nor a valid hub id"):
        models.resolve_model_path("bad id!")


def _cli(tmp_path, model, **env):
    env = {k: v for k, v in {**os.environ, "HF_HOME": str(tmp_path / "hf"), **env}.items() if v != ""}
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "strop.cli", "train", f"--model.path={model}", "--run.progress=false"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, time.perf_counter() - t


@pytest.mark.parametrize(
    "model, env, why",
    [
        ("nonexistent-org/nope", {"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
        # the hub unreachable (a closed port on this machine): refused at once, a bare id included
        ("gpt2", {"HF_HUB_OFFLINE": "", "HF_ENDPOINT": "http://127.0.0.1:9"}, "connection refused or timed out"),
    ],
)
def test_the_cli_fails_with_one_line(tmp_path, model, env, why):
    proc = _cli(tmp_path, model, **env)[0]
    line = f"strop train: error: model {model!r}: not a local folder, not in the local Hugging Face cache, and no network ({why})"
    assert proc.returncode == 1, proc.stderr
    assert line in proc.stderr.splitlines() and "Traceback" not in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "hf") == []  # no run directory left behind


def test_an_unreachable_hub_is_refused_at_once_before_any_download(tmp_path, monkeypatch):
    """The CLI's wall clock is mostly Python's imports, which a loaded machine stretches; what must hold is that
    the refusal comes from the one bounded connection check, before transformers (and its retries) is asked."""
    import huggingface_hub.constants
    import transformers

    asked = []
    for cls in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(cls, "from_pretrained", lambda *a, **kw: asked.append(a))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # a closed port here
    monkeypatch.setattr(models, "hub_offline", lambda: False)
    for load in (models.load_config, models.load_tokenizer, models.load_model):
        t = time.perf_counter()
        with pytest.raises(FileNotFoundError, match=r"no network \(connection refused or timed out\)"):
            load("gpt2")
        assert time.perf_counter() - t < 1.5  # half the check's timeout (3 s): a refused port answers at once
    assert asked == []


def test_a_hub_error_is_one_line_naming_the_model(monkeypatch, tiny_model_dir):
    import transformers

    def missing(path, **kw):
        raise OSError(f"{path} is not a local folder and is not a valid model identifier\nIf this is a private repo...")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", missing)
    monkeypatch.setattr(models, "hub_offline", lambda: False)
    monkeypatch.setattr(models, "hub_reachable", lambda timeout=3.0: True)
    with pytest.raises(FileNotFoundError) as err:
        models.load_config("org/typo", revision="v1")
    assert (
        str(err.value)
        == "model 'org/typo' (revision 'v1'): org/typo is not a local folder and is not a valid model identifier"
    )
    with pytest.raises(OSError) as err:  # a local folder's own error is left as it is
        models.load_config(str(tiny_model_dir))
    assert type(err.value) is OSError


def test_the_single_gpu_example_validates_and_its_memory_arithmetic_holds():
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    path = Path(__file__).resolve().parents[1] / "examples" / "configs" / "single_gpu_qwen2.5_0.5b.yaml"
    cfg = build_config(str(path))
    assert cfg.model.path == "Qwen/Qwen2.5-0.5B-Instruct"  # the real hub id
    assert cfg.train.bf16_autocast and cfg.train.activation_checkpointing and cfg.engine.dtype == "bfloat16"
    assert cfg.train.lr_schedule == "cosine" and cfg.run.device == "cuda" and cfg.engine.kind == "embedded"
    text = path.read_text()
    # the shapes the comment states (Qwen2.5-0.5B's config.json), on the meta device: no download
    config = Qwen2Config(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert f"{n:,}" in text and "16 B x 0.494e9 = 7.9 GB" in text and round(16 * n / 1e9, 1) == 7.9
    kv = config.num_hidden_layers * 2 * config.num_key_value_heads * (config.hidden_size // 14) * 2
    assert kv == 12 * 1024 and "12 KiB a token" in text
    assert round(cfg.rollout.max_batch_size * 700 * kv / 1e9, 1) == 1.1
    assert round(1024 * config.vocab_size * 4 * 2 / 1e9, 1) == 1.2  # logits of one chunk and their gradient
    assert cfg.train.logprob_chunk_size == 1024 and cfg.train.micro_batch_size == 8


def test_hub_reachable_says_yes_to_a_listening_port_and_no_to_a_closed_one(monkeypatch):
    import socket

    import huggingface_hub.constants

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert models.hub_reachable() is True
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    t = time.perf_counter()
    assert models.hub_reachable(timeout=30.0) is False
    assert time.perf_counter() - t < 15.0  # answered by the refusal, not by the 30 s timeout
