"""engine.verify_updates is refused at start where it cannot work, naming the options: engines whose digests the
trainer cannot reproduce (vLLM, SGLang), the adapter transport, and an embedded engine sharing the trainer's
tensors; it is accepted with the embedded engine and with strop serve over disk, delta or broadcast."""

import pytest

from strop.config import ConfigError, build_config
from strop.rule_reasons import why_not_shared
from strop.rules import RULES

SERVER = {"urls": ["http://127.0.0.1:1"]}


def broken(overrides: dict) -> list[str]:
    from tests.test_rules import _unchecked

    return [r.name for r in RULES if r.broken(_unchecked(overrides))]


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_engines_whose_digests_the_trainer_cannot_reproduce_are_refused_naming_the_kind(kind):
    overrides = {"engine": {"kind": kind, **SERVER, "verify_updates": "first"}}
    assert broken(overrides) == ["verified updates need engines that report their tensors"]
    with pytest.raises(ConfigError, match=rf"engine.verify_updates='first' .* engine.kind='{kind}' reports digests"):
        build_config(overrides=overrides)


@pytest.mark.parametrize("sync", ["adapter", "auto"])
def test_the_adapter_transport_is_refused(sync):
    overrides = {
        "engine": {"kind": "strop", **SERVER, "sync": sync, "verify_updates": "every"},
        "model": {"lora_rank": 8},
    }
    assert broken(overrides) == ["verified updates need whole weights"]
    with pytest.raises(
        ConfigError, match=rf"engine.verify_updates='every' with the adapter transport \(engine.sync='{sync}'"
    ):
        build_config(overrides=overrides)


def test_an_engine_sharing_the_trainers_tensors_is_refused_and_the_default_takes_a_copy():
    with pytest.raises(ConfigError, match="engine.share_weights=true: engine.verify_updates='first' overwrites"):
        build_config(overrides={"engine": {"share_weights": True, "verify_updates": "first"}})
    cfg = build_config(overrides={"engine": {"verify_updates": "first"}})
    assert "overwrites the engine's weights with noise" in why_not_shared(cfg)


@pytest.mark.parametrize(
    "engine",
    [
        {"verify_updates": "first"},
        *(
            {"kind": "strop", **SERVER, "sync": s, "verify_updates": "every"}
            for s in ("auto", "disk", "delta", "broadcast")
        ),
    ],
)
def test_the_embedded_engine_and_strop_serve_take_the_check(engine):
    cfg = build_config(overrides={"engine": engine, "model": {"lora_rank": 8} if engine.get("sync") == "disk" else {}})
    assert cfg.engine.verify_updates == engine["verify_updates"]
