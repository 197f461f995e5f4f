"""The kv-cache decoder's whole decode step compiled (strop.serving.compiled_step, ``engine.compile_step``): it
decodes the tokens the decoder's own step does, with logprobs within 1e-5 in fp32 (the sampler's block logsumexps
computed in its graph), for Llama and Qwen3 layers; one graph serves every decoder of a shape; small and
batch-invariant steps run the decoder's own step; where it cannot compile it says why once and runs the decoder's
own step; it composes with speculation, with whole runs (sync and async) and with strop serve (as the compiled
attention does); and where it would not run it is refused at start."""

import copy
import logging
import os
import shutil

import httpx
import pytest
import torch

from strop.serving import compiled_step
from strop.serving.compiled_step import CompiledStepDecoder
from strop.serving.cpu_kernels import unavailable
from strop.serving.embedded import EmbeddedEngine
from strop.serving.kvdecode import LlamaDecoder
from strop.serving.sampling import block_logsumexp
from strop.types import SamplingParams
from tests.tiny import make_tiny_model, make_tiny_qwen3, make_tiny_qwen3_moe

PROMPTS = [[5, 17, 230, 9, 5, 17], [44, 45, 46], [7, 8], [5, 17, 230, 9, 5, 17], [9, 9, 31, 4], [61, 3]]
compiles = pytest.mark.skipif(
    not any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "clang++") if c),
    reason="no C++ compiler here for Inductor",
)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model()


def decode(model, from_rows=2, prompts=PROMPTS, new_tokens=12, **kw):
    """Tokens, logprobs and the engine, every step of ``from_rows`` rows or more compiled when asked; the row
    counts of the steps the graph ran and of those the decoder's own step ran are in ``engine.ran``."""
    e = EmbeddedEngine(model, pad_token_id=0, default_stop_token_ids=[2], max_batch_size=8, **kw)
    if isinstance(e._fast, CompiledStepDecoder):
        e._fast.from_rows = from_rows
    e.ran = {"compiled": [], "own": []}
    e.handed, sample = [], e._sample  # per step: how far a block_lse handed to the sampler is from its logits' own

    def spy(logits, *a, block_lse=None, **kw):
        if block_lse is not None:
            e.handed.append(float((block_lse - block_logsumexp(logits)).abs().max()))
        return sample(logits, *a, block_lse=block_lse, **kw)

    e._sample = spy
    graph, own = compiled_step.CompiledStep.__call__, LlamaDecoder.step
    sps = [SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=i, stop_token_ids=[-1]) for i in range(6)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            compiled_step.CompiledStep,
            "__call__",
            lambda c, d, x, *a: e.ran["compiled"].append(len(x)) or graph(c, d, x, *a),
        )
        mp.setattr(LlamaDecoder, "step", lambda d, tokens, *a: e.ran["own"].append(len(tokens)) or own(d, tokens, *a))
        out = e.generate_batch(prompts, sps[: len(prompts)])
    return [c.token_ids for c in out], [torch.tensor(c.logprobs) for c in out], e


@compiles
@pytest.mark.parametrize(
    "make,kernels",
    [(make_tiny_model, "auto"), (make_tiny_qwen3, "auto")]
    + [(make_tiny_model, "mkl")] * (not unavailable("mkl", torch.float32)),
    ids=lambda v: getattr(v, "__name__", v),
)
def test_the_compiled_step_decodes_what_the_decoders_own_step_does_in_fp32(make, kernels):
    model = make()
    tokens, logprobs, e = decode(model, compile_step=True, cpu_kernels=kernels)
    want_tokens, want_logprobs, plain = decode(model, cpu_kernels=kernels)
    assert e._fast.kernel == plain._fast.kernel == (kernels if kernels != "auto" else e._fast.kernel)
    assert "decode step compiled from" in e.decode_path and "decode step compiled" not in plain.decode_path
    step = e._fast.compiled
    assert step.reason == "" and step.seconds > 0 and step.graphs == 2, (step.reason, step.graphs)
    assert e.ran["compiled"] and min(e.ran["compiled"]) >= 2  # (steps of 1 row ran the decoder's own step)
    assert tokens == want_tokens and all(len(t) == 12 for t in tokens)
    for a, b in zip(logprobs, want_logprobs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # each compiled step handed the sampler its logits' block logsumexps, computed in the graph
    assert len(e.handed) == len(e.ran["compiled"]) and max(e.handed) < 1e-5 and plain.handed == []
    # a second decoder of the same shape (a copy of the model, other weights) compiles nothing new
    graphs, other = step.graphs, copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.9)
    tokens2, logprobs2, e2 = decode(other, compile_step=True, cpu_kernels=kernels)
    want2 = decode(other, cpu_kernels=kernels)
    assert e2._fast.compiled.graphs == graphs and e2.ran["compiled"]
    assert tokens2 == want2[0] and tokens2 != tokens
    for a, b in zip(logprobs2, want2[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@compiles
def test_small_steps_run_the_decoders_own_step_and_larger_ones_the_graph(tiny):
    _, _, e = decode(tiny, from_rows=4, prompts=PROMPTS[:5], compile_step=True)
    assert e.ran["compiled"] and min(e.ran["compiled"]) >= 4  # (the five rows sit in 8 slots)
    assert e.ran["own"] == [], e.ran  # (no step of fewer rows: every one went through the graph or was too short)
    _, _, small = decode(tiny, from_rows=4, prompts=PROMPTS[:2], compile_step=True)
    assert small.ran["compiled"] == [] and small.ran["own"] and max(small.ran["own"]) == 2


@compiles
@pytest.mark.skipif(bool(unavailable("onednn", torch.float32)), reason="no oneDNN in this torch build")
def test_rows_finishing_apart_leave_the_batch_at_once_and_compile_nothing_more(tiny):
    """Both graphs (a cache view inside the cache, one at its first column) are compiled ahead; a batch whose rows
    finish one by one then runs each step on exactly its running rows, the cache compacted in place into a view of
    fewer slots, and compiles nothing more. Tokens equal the decoder's own step's, logprobs within 1e-5."""
    runs = {}
    for compiled in (True, False):
        e = EmbeddedEngine(tiny, pad_token_id=0, max_batch_size=8, compile_step=compiled, cpu_kernels="onednn")
        if compiled:
            e._fast.from_rows = 2
        rows, real = [], e._fast.step
        e._fast.step = lambda tokens, *a, real=real, rows=rows: rows.append(len(tokens)) or real(tokens, *a)
        sps = [SamplingParams(temperature=1.0, max_new_tokens=4 + 3 * i, seed=i, stop_token_ids=[-1]) for i in range(6)]
        runs[compiled] = e, rows, e.generate_batch(PROMPTS, sps)
    e, rows, outs = runs[True]
    assert e._fast.compiled.graphs == 2 and e._fast.compiled.reason == ""
    assert rows == runs[False][1] and sorted(set(rows), reverse=True) == [6, 5, 4, 3, 2, 1], rows
    for a, b in zip(outs, runs[False][2]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


@compiles
def test_speculation_composes_each_busy_period_decoding_as_it_would_without_it(tiny):
    """A busy period that drafts runs the batch-invariant kernels, never the graph; with the compiled step
    speculation still decodes bitwise what it decodes without it."""
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1]]
    spec_tokens, spec_logprobs, spec = decode(tiny, prompts=prompts, speculative=4, compile_step=True)
    want_tokens, want_logprobs, _ = decode(tiny, prompts=prompts, speculative=4)
    assert spec.ran["compiled"] == [] and spec.take_speculation_stats()
    assert spec_tokens == want_tokens
    assert all(torch.equal(a, b) for a, b in zip(spec_logprobs, want_logprobs))


def test_where_it_cannot_compile_it_says_why_once_and_runs_the_decoders_own_step(tiny, monkeypatch, caplog):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore lines")

    monkeypatch.setattr(torch, "compile", no_compiler)
    monkeypatch.setattr(compiled_step, "_STEPS", {})  # (a fresh compiled step for this shape)
    with caplog.at_level(logging.WARNING, logger="strop.serving"):
        tokens, logprobs, e = decode(tiny, compile_step=True)
    assert e._fast.compiled.reason == "RuntimeError: InvalidCxxCompiler: No working C++ compiler found"
    warned = [r.getMessage() for r in caplog.records if "decode step: not compiled" in r.getMessage()]
    assert len(warned) == 1 and "the decoder's own step runs" in warned[0], warned
    assert len(e.ran["compiled"]) == 1 and len(e.ran["own"]) > 1  # (tried once, then its own step every time)
    want_tokens, want_logprobs, _ = decode(tiny)
    assert tokens == want_tokens and all(torch.equal(a, b) for a, b in zip(logprobs, want_logprobs))


def test_the_engine_refuses_the_compiled_step_where_it_would_not_run(tiny):
    with pytest.raises(ValueError, match="compile_step compiles the kv-cache decoder's decode step, which is off"):
        EmbeddedEngine(tiny, pad_token_id=0, fast_decode=False, compile_step=True)
    with pytest.raises(ValueError, match="compile_step: batch-invariant steps attend row by row"):
        EmbeddedEngine(tiny, pad_token_id=0, batch_invariant=True, compile_step=True)
    with pytest.raises(ValueError, match=r"compile_step: routed-expert \(MoE\) layers are not in the compiled step"):
        EmbeddedEngine(make_tiny_qwen3_moe(), pad_token_id=0, compile_step=True)
    gelu = make_tiny_model()
    gelu.model.layers[1].mlp.act_fn = torch.nn.GELU()
    with pytest.raises(ValueError, match=r"compile_step: the MLP's activation \['GELU', 'SiLU.*'\] is not in"):
        EmbeddedEngine(gelu, pad_token_id=0, compile_step=True)
    EmbeddedEngine(tiny, pad_token_id=0, compile_step=True, compile_attention=True)  # (they compose)


@compiles
@pytest.mark.parametrize("option,what", [("compile_attention", "decode attention"), ("compile_step", "decode step")])
def test_strop_serve_compiles_the_attention_or_the_step_when_asked(start_server, option, what):
    from strop.engines.config import EngineConfig
    from strop.engines.launch import engine_flags

    flag = "--" + option.replace("_", "-")
    assert engine_flags(EngineConfig(kind="strop", launch=1, **{option: True})) == [flag]
    assert engine_flags(EngineConfig(kind="embedded", **{option: True})) == []
    servers = [start_server(None, flag), start_server(None)]
    rows = 32  # (strop serve's decoder compiles steps of 32 rows or more; smaller ones run as without it)
    body = {"input_ids": [[5, 17, 230, 9 + i] for i in range(rows)] + [[44, 45]], "return_logprob": True}
    body["sampling_params"] = {"temperature": 1.0, "max_new_tokens": 10, "stop_token_ids": [-1], "sampling_seed": 3}
    answers = []
    for server in servers:
        r = httpx.post(server.url + "/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        answers.append([(a["output_ids"], [e[0] for e in a["meta_info"]["output_token_logprobs"]]) for a in r.json()])
    log = servers[0].log_tail(20000)
    assert f"{what} compiled from 32 rows" in log and f"{what}: compiled in" in log
    assert what not in servers[1].log_tail(20000)
    assert [ids for ids, _ in answers[0]] == [ids for ids, _ in answers[1]] and len(answers[0][0][0]) == 10
    for (_, a), (_, b) in zip(*answers):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)


@compiles
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_rolls_out_with_the_compiled_step_sync_on_the_trainers_own_weights_and_async(
    mode, tiny_model_dir, tmp_path, monkeypatch
):
    """32 rows a step, so the graph runs; in sync mode the engine decodes from the trainer's own parameters, which
    the optimizer changes in place, in async mode (staleness 0) from the copy each update sends it: the compiled
    step must see each step's weights, norms included. Each step trains on the samples the decoder's own step
    draws, with their rollout logprobs within 1e-5, but for at most one: the two steps' numbers differ within
    1e-5, which moves a sample drawn within that of a token's bound in the sampler's CDF onto its neighbour
    (measured: 1 sample of 768 over six seeds, on an AMD EPYC with AVX2)."""
    import json
    from collections import Counter

    from strop.config import build_config
    from strop.loop import train
    from strop.rollout import schedulers
    from tests.test_e2e import tiny_overrides

    ran, trained = [], {}
    graph = compiled_step.CompiledStep.__call__
    monkeypatch.setattr(
        compiled_step.CompiledStep, "__call__", lambda c, d, x, *a: ran.append(len(x)) or graph(c, d, x, *a)
    )
    scheduler = schedulers.SyncScheduler if mode == "sync" else schedulers.AsyncScheduler
    take = scheduler.next

    async def next_recorded(self, step):
        groups = await take(self, step)
        trained[compiled].append([((s.prompt, tuple(s.response_ids)), s.rollout_logprobs) for g in groups for s in g])
        return groups

    monkeypatch.setattr(scheduler, "next", next_recorded)
    rollout = {"prompts_per_step": 8, "n_samples_per_prompt": 4, "max_new_tokens": 8, "mode": mode, "seed": 2}
    gaps = {}
    for compiled in (True, False):
        trained[compiled] = []
        run_dir = tmp_path / f"run-{compiled}"
        overrides = tiny_overrides(tiny_model_dir, run_dir, rollout=rollout, engine={"compile_step": compiled})
        if mode == "async":  # (staleness 0: step 2's samples are drawn on the weights step 1 sent the engine)
            overrides["algo"] = {"use_rollout_logprobs": True}
            overrides["rollout"] = {**rollout, "max_staleness": 0}
        assert train(build_config(overrides=overrides))["steps"] == 2
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        gaps[compiled] = [r["train_rollout_logprob_abs_diff"] for r in rows if "train_rollout_logprob_abs_diff" in r]
        assert (not compiled) or (ran and min(ran) >= 32), ran
    assert len(ran) > 2 and len(gaps[True]) == 2  # (the graph ran at both steps' rollouts)
    differ = 0
    for with_graph, without in zip(trained[True], trained[False], strict=True):
        assert sum(len(k[1]) for k, _ in with_graph) == 8 * 4 * 8  # (every sample, every token)
        differ += sum((Counter(k for k, _ in with_graph) - Counter(k for k, _ in without)).values())
        drawn = dict(without)
        for key, logprobs in with_graph:
            if key in drawn:
                torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(drawn[key]), rtol=0, atol=1e-5)
    assert differ <= 1, f"{differ} of 64 samples differ"
    # the rollout's logprobs are the trainer's own (within 1e-5): sync on its parameters, async on their copy
    assert max(gaps[True] + gaps[False]) < 1e-5, gaps
