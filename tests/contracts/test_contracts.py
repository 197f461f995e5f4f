"""Hook contracts: strop's call sites, the signatures, and results on synthetic Samples.

Each hook's contract is pinned on both sides: CONTRACTS below must equal the
Protocols in strop/plugins.py (the documented signatures), and a real run calls
every hook through strop's own call sites with exactly those arguments.
"""

import inspect
import os

import pytest
import torch

from strop.cli import main
from strop.config import build_config
from strop.contracts import check_plugin
from strop.loop import train
from strop.plugins import HOOKS, PluginError
from strop.types import SamplingParams, Sample

# The documented contracts (docs/plugins.md). Changing one is a deliberate API change.
CONTRACTS = {
    "rollout": ("async", ("ctx", "groups", "sampling")),
    "generate": ("async", ("ctx", "sample", "sampling")),
    "reward": ("either", ("sample",)),
    "filter": ("sync", ("group",)),
    "postprocess": ("sync", ("samples", "step")),
    "advantage": ("sync", ("rewards", "group_ids", "mask")),
    "policy_loss": ("sync", ("logprobs", "old_logprobs", "advantages", "mask")),
    "data_source": ("sync", ("config", "split")),
    "tools": ("sync", ("config",)),
    "agent": ("either", ("base_url", "api_key", "row")),
}

EXAMPLES = [
    ("reward", "examples.plugins.rewards:concise_math_reward"),
    ("reward", "examples.plugins.rewards:rank_in_group_reward"),
    ("generate", "examples.plugins.generate:answer_prefix_generate"),
    ("rollout", "examples.plugins.rollout:rollout_with_best_of_group"),
    ("filter", "examples.plugins.filters:drop_uniform_groups"),
    ("postprocess", "examples.plugins.postprocess:overlong_penalty"),
    ("advantage", "examples.plugins.advantages:median_baseline"),
    ("policy_loss", "examples.plugins.losses:reinforce_loss"),
    ("data_source", "examples.plugins.data_sources:two_digit_sums"),
    ("tools", "examples.plugins.tools:number_theory_tools"),
    ("agent", "examples.plugins.agent:calculator_agent"),
]


def test_protocols_match_the_documented_contracts():
    assert set(HOOKS) == set(CONTRACTS)
    for name, (mode, params) in CONTRACTS.items():
        assert (HOOKS[name].mode, HOOKS[name].params) == (mode, params), name
        assert inspect.getdoc(HOOKS[name].protocol.__call__), f"{name} contract has no docstring"


def test_every_hook_has_an_example_and_docs():
    docs = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "plugins.md")).read()
    assert {hook for hook, _ in EXAMPLES} == set(HOOKS)
    for hook, path in EXAMPLES:
        assert path in docs, f"docs/plugins.md does not show {path}"
        assert f"`{hook}`" in docs


def test_call_sites_pass_exactly_the_contract(tiny_model_dir, tmp_path):
    """One real run with every hook replaced by a recorder: strop's call sites, pinned. (The
    tools hook makes generation multi-turn, which a generate hook would replace: it has its
    own run below.)"""
    from tests.contracts import recorders

    recorders.CALLS.clear()
    plugins = {hook: f"tests.contracts.recorders:{hook}" for hook in HOOKS if hook not in ("reward", "tools", "agent")}
    cfg = build_config(
        overrides={
            "model": {"path": str(tiny_model_dir)},
            "rollout": {
                "prompts_per_step": 2,
                "n_samples_per_prompt": 3,
                "max_new_tokens": 6,
                "reward": "tests.contracts.recorders:reward",
            },
            "train": {"steps": 1, "micro_batch_size": 4},
            "run": {"dir": str(tmp_path / "run"), "progress": False, "save_final": False, "plot": False},
            "plugins": plugins,
        }
    )
    train(cfg)
    expected_types = {
        "rollout": {"groups": list, "sampling": SamplingParams},
        "generate": {"sample": Sample, "sampling": SamplingParams},
        "reward": {"sample": Sample},
        "filter": {"group": list},
        "postprocess": {"samples": list, "step": int},
        "advantage": {"rewards": torch.Tensor, "group_ids": torch.Tensor, "mask": torch.Tensor},
        "policy_loss": {
            "logprobs": torch.Tensor,
            "old_logprobs": torch.Tensor,
            "advantages": torch.Tensor,
            "mask": torch.Tensor,
        },
        "data_source": {"split": str},
    }
    for hook, (_, params) in CONTRACTS.items():
        if hook in ("tools", "agent"):  # (each has its own run)
            continue
        calls = recorders.CALLS.get(hook)
        assert calls, f"strop never called the {hook} hook"
        for call in calls:
            assert tuple(k for k in call if k != "_values") == params, hook
            for arg, typ in expected_types[hook].items():
                assert issubclass(call[arg], typ), (hook, arg, call[arg])
    # shapes at the tensor call sites
    adv = recorders.CALLS["advantage"][0]["_values"]
    assert adv["rewards"].shape == adv["group_ids"].shape == (adv["mask"].shape[0],)
    loss = recorders.CALLS["policy_loss"][0]["_values"]
    assert loss["logprobs"].shape == loss["old_logprobs"].shape == loss["mask"].shape
    assert {c["_values"]["split"] for c in recorders.CALLS["data_source"]} == {"train", "eval"}
    assert all(isinstance(g[0], Sample) for c in recorders.CALLS["filter"] for g in [c["_values"]["group"]])


def test_tools_call_site_makes_the_rollout_multi_turn(tiny_model_dir, tmp_path, capsys):
    import json

    from strop.config import ToolsConfig
    from tests.contracts import recorders

    recorders.CALLS.clear()
    cfg = build_config(
        overrides={
            "model": {"path": str(tiny_model_dir)},
            "rollout": {
                "prompts_per_step": 2,
                "n_samples_per_prompt": 2,
                "max_new_tokens": 6,
                "reward": "tests.contracts.recorders:reward",
            },
            "train": {"steps": 1, "micro_batch_size": 4},
            "data": {"eval_size": 4},
            "eval": {"every": 0},
            "tools": {"max_turns": 3},
            "run": {"dir": str(tmp_path / "run"), "progress": False, "save_final": False, "plot": False},
            "plugins": {"tools": "tests.contracts.recorders:tools"},
        }
    )
    train(cfg)
    calls = recorders.CALLS["tools"]
    assert len(calls) == 1 and tuple(k for k in calls[0] if k != "_values") == CONTRACTS["tools"][1]
    assert calls[0]["config"] is ToolsConfig and calls[0]["_values"]["config"].max_turns == 3
    assert "strop: tools: calculator from tests.contracts.recorders:tools" in capsys.readouterr().out
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("turns_mean" in m for m in metrics), "the tools hook did not make the rollout multi-turn"
    evals = [m for m in metrics if "eval_accuracy" in m]
    assert evals and all(0.0 <= m["eval_tool_call_fraction"] <= 1.0 for m in evals)  # evaluation is multi-turn too
    # the model is told about the hook's tools: their schemas are in every prompt's system message
    from strop.models import load_tokenizer

    # (the first call is the reward's trial at start, on the first row before any model loads: a run's sample is last)
    prompt = load_tokenizer(str(tiny_model_dir)).decode(recorders.CALLS["reward"][-1]["_values"]["sample"].prompt_ids)
    assert "<tools>" in prompt and '"name": "calculator"' in prompt and "<tool_call>" in prompt


def test_tools_hook_refusals(tmp_path):
    from strop.rollout.toolbox import make_tools

    with pytest.raises(ValueError, match=r"plugins.tools='x:y' uses strop's multi-turn generate function"):
        build_config(overrides={"plugins": {"tools": "x:y", "generate": "a:b"}})
    cfg = build_config(
        overrides={"tools": {"enabled": ["calculator"]}, "plugins": {"tools": "tests.contracts.recorders:tools"}}
    )
    from tests.contracts import recorders

    with pytest.raises(PluginError, match=r"gives tool\(s\) \['calculator'\], which tools.enabled"):
        make_tools(cfg, recorders.tools)


@pytest.mark.parametrize("hook,path", EXAMPLES)
def test_examples_pass_the_checker(hook, path, capsys):
    assert main(["check-plugin", "--hook", hook, path]) == 0
    assert f"ok: {path} satisfies the {hook} hook contract" in capsys.readouterr().out


BROKEN = [
    (
        "reward",
        "tests.contracts.broken:reward_wrong_name",
        "parameter names ('s',) differ from the contract's ('sample',)",
    ),
    (
        "reward",
        "tests.contracts.broken:reward_two_params",
        "requires 2 parameter(s) ('sample', 'label'); the contract passes 1",
    ),
    ("reward", "tests.contracts.broken:reward_returns_text", "returned 'correct' (str); expected a float"),
    ("generate", "tests.contracts.broken:generate_sync", "must be an async function"),
    ("generate", "tests.contracts.broken:generate_breaks_invariants", "broke the Sample invariants"),
    ("generate", "tests.contracts.broken:generate_forgets_status", "left the sample PENDING"),
    ("filter", "tests.contracts.broken:filter_async", "must be a plain (sync) function"),
    ("filter", "tests.contracts.broken:filter_returns_int", "returned 1 (int); expected True (keep) or False (drop)"),
    (
        "advantage",
        "tests.contracts.broken:advantage_wrong_shape",
        "returned (1,); expected a tensor of shape (4,) or (4, 3)",
    ),
    ("policy_loss", "tests.contracts.broken:loss_without_info", "expected (per-token loss tensor, dict)"),
    ("postprocess", "tests.contracts.broken:postprocess_positional_only", "positional-only"),
    ("reward", "tests.contracts.broken:NOT_CALLABLE", "is a int, not a function"),
    ("reward", "tests.contracts.no_such_module:reward", "cannot import module 'tests.contracts.no_such_module'"),
    ("reward", "tests.contracts.broken:missing", "has no attribute 'missing'"),
    ("reward", "tests.contracts.raises_on_import:reward", "RuntimeError: this plugin module is broken at import"),
    ("tools", "tests.contracts.broken:tools_not_tools", "item 0 is a dict, not a strop.tools.Tool"),
    ("tools", "tests.contracts.broken:tools_duplicate_names", "tool names must be unique: ['calculator']"),
    ("tools", "tests.contracts.broken:tools_schema_mismatch", "does not take the schema's properties ['query']"),
    (
        "tools",
        "tests.contracts.broken:tools_returns_none",
        "tool 'shout' returned NoneType (None); a tool returns text",
    ),
    (
        "agent",
        "tests.contracts.broken:agent_returns_text",
        "returned 'well done' (str); expected a finite reward or None",
    ),
    ("agent", "tests.contracts.broken:agent_wrong_params", "parameter names ('url', 'key', 'row') differ"),
    ("agent", "tests.contracts.broken:agent_makes_no_call", "the agent made no call through the proxy"),
]


@pytest.mark.parametrize("hook,path,message", BROKEN, ids=[p.split(":")[1] for _, p, _ in BROKEN])
def test_broken_plugins_fail_with_a_clear_message(hook, path, message, capsys):
    assert main(["check-plugin", "--hook", hook, path]) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err and message in err, err
    assert f"{hook} hook" in err
    if any(word in message for word in ("parameter", "async", "sync", "positional-only")):
        assert "expected:" in err and "found:" in err  # both signatures shown


def test_bad_hook_at_load_time_fails_before_any_model_loads(tmp_path, capsys):
    code = main(
        [
            "train",
            "--train.steps=1",
            "--plugins.filter=tests.contracts.broken:filter_async",
            f"--run.dir={tmp_path / 'run'}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1 and "filter hook" in err and "must be a plain (sync) function" in err
    assert not (tmp_path / "run").exists()


def test_broken_generate_stops_the_run_naming_hook_and_sample(tiny_model_dir, tmp_path):
    import json

    cfg = build_config(
        overrides={
            "model": {"path": str(tiny_model_dir)},
            "rollout": {
                "prompts_per_step": 2,
                "n_samples_per_prompt": 2,
                "max_new_tokens": 4,
                "reward": "tests.plugins:even_token_reward",
            },
            "train": {"steps": 2},
            "data": {"eval_size": 0},
            "run": {"dir": str(tmp_path / "run"), "progress": False},
            "plugins": {"generate": "tests.contracts.broken:generate_breaks_invariants"},
        }
    )
    with pytest.raises(
        PluginError,
        match=r"generate hook tests\.contracts\.broken:generate_breaks_invariants "
        r"on sample group=\d+ index=\d+: broke the Sample invariants",
    ):
        train(cfg)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


def _user_plugins():
    """STROP_PLUGIN='reward=my_pkg.rewards:score,filter=my_pkg.filters:keep' checks your own plugins."""
    spec = os.environ.get("STROP_PLUGIN")
    if not spec:
        return EXAMPLES  # without one, the same check runs on the shipped examples
    return [tuple(item.split("=", 1)) for item in spec.split(",") if item.strip()]


@pytest.mark.parametrize("hook,path", _user_plugins())
def test_user_plugin(hook, path):
    """Run with STROP_PLUGIN=hook=pkg.module:function pytest tests/contracts -k user_plugin."""
    report = check_plugin(hook, path)
    assert report.hook == hook and report.result
