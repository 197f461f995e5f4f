"""The KV-cache decoder: the same tokens and logprobs as the Hugging Face path, a group's prompt
prefilled once, continuous batching, and weight changes seen at once."""

import asyncio

import pytest
import torch

from strop.serving import kvdecode
from strop.serving.embedded import EmbeddedEngine
from strop.serving.sampling import _blocks, _invert_cdf, _sample_blocks
from strop.serving import batch as batches
from strop.serving.batch import Batch
from strop.serving.cpu_kernels import unavailable
from strop.serving.linear import can_pack
from strop.train.logprob import response_logprobs
from strop.types import SamplingParams

PROMPTS = [
    [5, 17, 230, 9],
    [44, 3],
    [8, 8, 8, 8, 8, 8, 1],
    [5, 17, 230, 9],
    [300, 301, 302, 303, 304, 305, 306, 307, 308],
]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[-1])


def engine(model, **kw):
    return EmbeddedEngine(model, pad_token_id=0, default_stop_token_ids=[2], **kw)


def full_forward_logprobs(model, prompt, out, temperature):
    ids = torch.tensor([prompt + out.token_ids])
    positions = torch.arange(len(prompt), ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        lp, _ = response_logprobs(model, ids, torch.ones_like(ids), positions, temperature=temperature)
    return lp[0]


def test_the_tiny_model_runs_on_the_fast_path_and_other_models_fall_back(tiny_model):
    assert engine(tiny_model)._fast is not None
    assert "fast_decode=False" in engine(tiny_model, fast_decode=False).decode_path
    assert kvdecode.unsupported_reason(torch.nn.Linear(2, 2)) is not None


@pytest.mark.parametrize("max_batch_size", [64, 2])
def test_fast_path_matches_the_transformers_path(tiny_model, max_batch_size):
    """Greedy tokens identical, logprobs within 1e-4, also when rows join a running batch (2 at once)."""
    fast = engine(tiny_model, max_batch_size=max_batch_size).generate_batch(PROMPTS, GREEDY)
    slow = engine(tiny_model, fast_decode=False).generate_batch(PROMPTS, GREEDY)
    for _prompt, a, b in zip(PROMPTS, fast, slow):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)


def test_sampled_logprobs_equal_a_full_forward_with_joining_rows(tiny_model):
    """Rows admitted mid-decode sit at other cache columns; their logprobs still match a full forward."""
    prompts = PROMPTS * 3
    outs = engine(tiny_model, max_batch_size=4, seed=3).generate_batch(
        prompts,
        [SamplingParams(temperature=0.8, max_new_tokens=5 + 3 * i, stop_token_ids=[-1]) for i in range(len(prompts))],
    )
    for prompt, out in zip(prompts, outs):
        torch.testing.assert_close(
            torch.tensor(out.logprobs), full_forward_logprobs(tiny_model, prompt, out, 0.8), rtol=0, atol=1e-4
        )


def test_a_groups_prompt_is_prefilled_once(tiny_model):
    """8 samples of one prompt: one prefill of its tokens, and each sample is what it would be alone."""
    e = engine(tiny_model)
    prompt = [11, 12, 13, 14, 15, 16]
    sps = [SamplingParams(temperature=1.0, max_new_tokens=8, seed=100 + i, stop_token_ids=[-1]) for i in range(8)]
    batch = Batch(e._fast, e._sample_rows, pad_token_id=0)
    rows = [e._row(prompt, sp) for sp in sps]
    batch.admit([prompt] * 8, rows)
    while batch.live:
        batch.step()
    assert batch.prefilled_tokens == len(prompt) and batch.prompt_tokens == 8 * len(prompt)
    alone = [e.generate_batch([prompt], sp)[0] for sp in sps]
    assert [r.token_ids for r in rows] == [a.token_ids for a in alone]
    assert len({tuple(r.token_ids) for r in rows}) > 1  # independent samples, not copies


def test_a_long_request_does_not_hold_up_short_ones(tiny_model):
    """A short request sent while a long one decodes joins the running batch and finishes first."""
    e = engine(tiny_model)
    order = []

    async def ask(name, prompt, n, delay):
        await asyncio.sleep(delay)
        out = await e.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=n, stop_token_ids=[-1]))
        order.append((name, len(out.token_ids)))

    joined = []
    real = e._advance
    e._advance = lambda batch, prompts, rows: joined.append((len(rows), batch.live)) or real(batch, prompts, rows)

    async def main():
        await asyncio.gather(ask("long", [5, 6, 7], 200, 0.0), ask("short", [9, 10], 3, 0.05))

    asyncio.run(main())
    assert order == [("short", 3), ("long", 200)]
    assert (1, 1) in joined  # the short request was admitted while the long one ran


def test_weight_updates_wait_for_running_rows_and_apply_to_new_ones(tiny_model):
    e = engine(tiny_model)
    new = {k: v + 0.05 for k, v in tiny_model.state_dict().items()}

    async def main():
        first = asyncio.ensure_future(e.generate([5, 6, 7], SamplingParams(max_new_tokens=60, stop_token_ids=[-1])))
        await asyncio.sleep(0.02)
        version = await e.update_weights(new, version=7)
        second = await e.generate([5, 6, 7], GREEDY)
        return await first, version, second

    first, version, second = asyncio.run(main())
    assert first.weight_version == 0 and len(first.token_ids) == 60  # finished on the old weights
    assert version == 7 and second.weight_version == 7
    want = engine(tiny_model, fast_decode=False).generate_batch([[5, 6, 7]], GREEDY)[0]  # model now holds `new`
    assert second.token_ids == want.token_ids


def test_weights_changed_in_place_are_seen_by_the_next_step(tiny_model):
    e = engine(tiny_model)
    before = e.generate_batch(PROMPTS, GREEDY)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in tiny_model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    after = e.generate_batch(PROMPTS, GREEDY)
    want = engine(tiny_model, fast_decode=False).generate_batch(PROMPTS, GREEDY)
    for a, w, b in zip(after, want, before):
        assert a.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-4)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) > 1e-2  # the change is visible


def test_two_level_inverse_cdf_follows_the_distribution_and_never_picks_a_zero():
    g = torch.Generator().manual_seed(0)
    V = 3000  # not a multiple of the 1024-token chunk: the padded tail has no mass
    probs = torch.zeros(V)
    support = torch.tensor([0, 1023, 1024, 2047, 2999])
    probs[support] = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])
    n = 40000
    u = torch.rand(n, 1, generator=g)
    u[:3] = torch.tensor([[0.0], [1.0 - 1e-9], [0.5]])
    picks = _invert_cdf(probs.expand(n, V).contiguous(), u)
    assert set(picks.unique().tolist()) <= set(support.tolist())
    freq = torch.bincount(picks, minlength=V)[support].float() / n
    torch.testing.assert_close(freq, probs[support], rtol=0, atol=0.01)


def test_sampling_from_block_logsumexps_follows_the_distribution_and_never_picks_a_zero():
    """The default sampler never builds the (B, V) probabilities: block masses from per-block
    logsumexps, then one block exponentiated. Same checks as the two-level CDF above, on logits."""
    g = torch.Generator().manual_seed(1)
    V = 3000
    logits = torch.full((V,), float("-inf"))
    support = torch.tensor([0, 1023, 1024, 2047, 2999])
    probs = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])
    logits[support] = probs.log() + 7.0  # an arbitrary shift: only differences matter
    n = 40000
    u = torch.rand(n, 1, generator=g)
    u[:3] = torch.tensor([[0.0], [1.0 - 1e-9], [0.5]])
    blocks = _blocks(logits.expand(n, V).contiguous())
    block_lse = torch.logsumexp(blocks, dim=-1)
    lse = torch.logsumexp(block_lse, dim=-1, keepdim=True)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1).expand(n, 1))
    picks = _sample_blocks(blocks, block_lse, lse, u)
    assert set(picks.unique().tolist()) <= set(support.tolist())
    freq = torch.bincount(picks, minlength=V)[support].float() / n
    torch.testing.assert_close(freq, probs, rtol=0, atol=0.01)
    # the same uniform numbers pick the same tokens as the two-level CDF over the probabilities
    assert torch.equal(picks[:2000], _invert_cdf(torch.softmax(logits, -1).expand(2000, V).contiguous(), u[:2000]))


def test_an_engine_error_reaches_every_request_and_the_engine_recovers(tiny_model, monkeypatch):
    """The second decode step fails after one row finished in it: that row is answered too (with
    the error), nothing waits forever, and the engine serves the next request."""
    e = engine(tiny_model)
    calls = {"n": 0}
    real = e._advance

    def broken(batch, prompts, rows):
        calls["n"] += 1
        out = real(batch, prompts, rows)
        if calls["n"] == 2:
            assert out, "a row should finish in the failing step"
            raise RuntimeError("boom in decode")
        return out

    e._advance = broken
    sps = [SamplingParams(max_new_tokens=3 if i == 0 else 20, stop_token_ids=[-1]) for i in range(len(PROMPTS))]

    async def main():
        got = await asyncio.wait_for(
            asyncio.gather(*(e.generate(p, sp) for p, sp in zip(PROMPTS, sps)), return_exceptions=True), timeout=30
        )
        again = await asyncio.wait_for(e.generate(PROMPTS[0], sps[1]), timeout=30)
        return got, again

    got, again = asyncio.run(main())
    assert all(isinstance(g, RuntimeError) and "boom in decode" in str(g) for g in got)
    assert len(again.token_ids) == 20


def _slot_counts(e, n: int = 40):
    """The rows of each decode step and the cache layouts made (``_relayout`` calls) over a batch of ``n`` rows
    that finish one by one."""
    sizes, layouts = [], []
    real, relayout = e._fast.step, Batch._relayout
    e._fast.step = lambda tokens, *a: sizes.append(len(tokens)) or real(tokens, *a)
    prompts = [[5, 6, 7 + i] for i in range(n)]
    Batch._relayout = lambda self, *a: layouts.append(a[1]) or relayout(self, *a)
    try:
        outs = e.generate_batch(prompts, [SamplingParams(max_new_tokens=1 + i, stop_token_ids=[-1]) for i in range(n)])
    finally:
        Batch._relayout = relayout
    assert [len(o.token_ids) for o in outs] == [1 + i for i in range(n)]
    return sizes, layouts


@pytest.mark.skipif(bool(unavailable("mkl", torch.float32)), reason="this torch build has no MKL")
def test_on_mkl_the_slot_count_changes_only_at_bucket_boundaries(tiny_model):
    """MKL's weights are packed for a row count: rows finishing one by one free their slots, and the slot count
    (and the packing) changes only when a whole bucket is free, not once per finished row."""
    assert [batches.slots_for(n) for n in (1, 2, 3, 5, 16, 17, 33, 64)] == [1, 2, 4, 8, 16, 32, 48, 64]
    sizes, layouts = _slot_counts(engine(tiny_model, cpu_kernels="mkl"))
    changes = [b for a, b in zip(sizes, sizes[1:]) if a != b]
    assert sizes[0] == 48 and changes == [32, 16, 8, 4, 2, 1]
    assert layouts == [48]  # (the first row ended on its first token; the compactions keep the tensors)


@pytest.mark.parametrize("kernel", ["onednn", "plain"])
def test_where_any_row_count_runs_a_step_computes_only_the_running_rows(tiny_model, kernel):
    """Where one packing serves every row count (oneDNN) or nothing is packed, a step computes exactly the rows
    still running: each finished row leaves the batch at once, moved out of the cache in place (one layout
    for the whole batch), and every row's tokens equal those of the transformers path."""
    if unavailable(kernel, torch.float32):
        pytest.skip(unavailable(kernel, torch.float32))
    assert [batches.slots_for(n, 1) for n in (1, 3, 17, 63)] == [1, 3, 17, 63]
    e = engine(tiny_model, cpu_kernels=kernel)
    sizes, layouts = _slot_counts(e)
    assert sizes == list(range(39, 0, -1)) and layouts == [39]  # (row i ends after i + 1 tokens: 39 run on)
    regained, real = [], Batch._regain
    e = engine(tiny_model, cpu_kernels=kernel)
    greedy = [SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=[-1]) for n in (150, 2, 150, 5)]
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14], [15, 16]]

    async def main():  # the short row ends, the batch runs on with 2 slots, then a row joins the third
        first = [asyncio.ensure_future(e.generate(p, sp)) for p, sp in zip(prompts[:3], greedy[:3])]
        await first[1]
        await asyncio.sleep(0.02)
        return await asyncio.gather(*first, e.generate(prompts[3], greedy[3]))

    Batch._regain = lambda self, n: regained.append((n, len(self.rows), self._base_keys.shape[1])) or real(self, n)
    try:
        fast = asyncio.run(main())
    finally:
        Batch._regain = real
    slow = engine(tiny_model, fast_decode=False).generate_batch(prompts, greedy)
    assert [o.token_ids for o in fast] == [o.token_ids for o in slow]
    assert regained == [(1, 2, 3)]  # (the joining row took back the slot the compaction left)


def test_the_fused_norm_is_bitwise_the_models_own(tiny_model):
    """The decoder's fp32 RMSNorm is one fused kernel; it must equal the transformers module exactly
    (the fast path is checked against a full forward only to 1e-4, so a drift would hide there)."""
    import copy

    norm = copy.deepcopy(tiny_model.model.layers[0].input_layernorm)
    with torch.no_grad():
        norm.weight.normal_()
        x = torch.randn(5, 3, norm.weight.shape[0]) * 3
        assert torch.equal(kvdecode.LlamaDecoder._norm(norm, x), norm(x))
        assert torch.equal(
            kvdecode.LlamaDecoder._norm(norm, x.double()).float(), norm.double()(x.double()).float()
        )  # other dtypes: the module's formula


@pytest.fixture(scope="module")
def tiny_qwen3():
    from tests.tiny import make_tiny_qwen3

    return make_tiny_qwen3().eval()  # its q/k norms drawn away from 1: a decoder that skipped them would differ


def test_qwen3_decodes_on_the_fast_path_as_the_transformers_path_does(tiny_qwen3):
    """Qwen3 (per-head query/key norms before the rotation, an untied output projection): greedy tokens equal to
    Hugging Face's forward, logprobs within 1e-4, and sampled rows joining a running batch match the trainer's
    full forward within 1e-5."""
    fast_engine = engine(tiny_qwen3, max_batch_size=2)
    assert fast_engine._fast is not None and kvdecode.unsupported_reason(tiny_qwen3) is None
    fast = fast_engine.generate_batch(PROMPTS, GREEDY)
    slow = engine(tiny_qwen3, fast_decode=False).generate_batch(PROMPTS, GREEDY)
    for a, b in zip(fast, slow):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)
    sampled = PROMPTS * 2
    outs = engine(tiny_qwen3, max_batch_size=4, seed=3).generate_batch(
        sampled,
        [SamplingParams(temperature=0.8, max_new_tokens=5 + 3 * i, stop_token_ids=[-1]) for i in range(len(sampled))],
    )
    for prompt, out in zip(sampled, outs):
        torch.testing.assert_close(
            torch.tensor(out.logprobs), full_forward_logprobs(tiny_qwen3, prompt, out, 0.8), rtol=0, atol=1e-5
        )  # the trainer-vs-engine gap of issue 23


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_weights_change_no_token_and_no_logprob(tiny_model, dtype, monkeypatch):
    """The decoder keeps its linears pre-packed where this CPU has a packed kernel (MKL's for fp32,
    oneDNN's for bf16: the libraries F.linear itself calls for those dtypes); tokens and logprobs must
    be bitwise those of plain F.linear, with rows joining and leaving (several packed row counts) and
    a prefill whose row count is not the packed one. (The kernel is named: ``auto`` picks oneDNN for
    fp32 on CPUs other than Intel's, another library than F.linear's, whose last bits differ.)"""
    import copy

    model = copy.deepcopy(tiny_model).to(dtype)
    packs = []
    real = kvdecode.PackedLinear.pack
    monkeypatch.setattr(kvdecode.PackedLinear, "pack", lambda self, rows: packs.append(rows) or real(self, rows))
    prompts = PROMPTS * 2
    sps = [
        SamplingParams(temperature=0.9, max_new_tokens=4 + 3 * i, seed=i, stop_token_ids=[-1])
        for i in range(len(prompts))
    ]
    outs = {}
    kernel = "mkl" if dtype == torch.float32 else "onednn"
    can = can_pack(model.model.embed_tokens.weight) and not unavailable(kernel, dtype)
    for prepack in (True, False):
        e = engine(model, max_batch_size=4, cpu_kernels=kernel if can else "auto")
        e._fast.prepack = prepack and e._fast.prepack
        outs[prepack] = e.generate_batch(prompts, sps)
    assert (len(set(packs)) > 1) == can  # packed, for several row counts, exactly where the CPU can
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_all_of_an_engines_model_work_runs_on_its_one_thread(tiny_model):
    """Decode steps and weight loads handed off the event loop run on the engine's own single thread.
    A pool would spread them over several threads, and on a CPU each thread that calls torch gets its
    own OpenMP team, whose idle spinning slowed rollouts on 2 cores by 1.2-2.6x."""
    import copy
    import threading

    model = copy.deepcopy(tiny_model)
    e = engine(model, max_batch_size=4)
    steps, loads = [], []
    real_step, real_load = e._fast.step, e._load
    e._fast.step = lambda *a: steps.append(threading.get_ident()) or real_step(*a)
    e._load = lambda *a: loads.append(threading.get_ident()) or real_load(*a)
    new = {k: v + 0.01 for k, v in model.state_dict().items()}

    async def main():
        for round in range(3):
            await asyncio.gather(
                *[
                    e.generate(p, SamplingParams(max_new_tokens=6 + i, seed=i, stop_token_ids=[-1]))
                    for i, p in enumerate(PROMPTS * 3)
                ]
            )
            await e.update_weights(new, version=round + 1)

    asyncio.run(main())
    assert len(steps) > 30 and len(loads) == 3
    assert set(steps) == set(loads) and len(set(steps)) == 1
    assert threading.get_ident() not in steps


def _os_threads() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one torch thread: no OpenMP workers to free")
def test_release_threads_frees_the_calling_threads_openmp_workers():
    """A thread's parallel torch op gives it OpenMP workers for the thread's life; releasing frees
    them (counted as the process's OS threads) and the next op brings them back."""
    import threading

    from strop.openmp import release_threads

    counts = []

    def work():
        torch.ones(1 << 24).add_(1).sum()  # large enough to run in parallel
        counts.append(_os_threads())
        counts.append(release_threads())
        counts.append(_os_threads())
        torch.ones(1 << 24).add_(1).sum()
        counts.append(_os_threads())

    t = threading.Thread(target=work)
    t.start()
    t.join()
    with_pool, released, without, again = counts
    assert released is True
    assert without <= with_pool - (torch.get_num_threads() - 1) and again == with_pool


def test_the_engine_thread_and_the_waiting_caller_free_their_openmp_pools(tiny_model, monkeypatch):
    """Only the thread that works keeps its OpenMP pool: the engine's thread frees its own when the
    engine goes idle, and a thread waiting on the run's event loop frees its own before it waits."""
    import threading

    from strop.serving import scheduler
    from strop.rollout import event_loop

    freed = []
    monkeypatch.setattr(scheduler, "release_threads", lambda: freed.append(("engine", threading.get_ident())))
    monkeypatch.setattr(event_loop, "release_threads", lambda: freed.append(("caller", threading.get_ident())))
    e = engine(tiny_model, max_batch_size=4)
    steps = []
    real_step = e._fast.step
    e._fast.step = lambda *a: steps.append(threading.get_ident()) or real_step(*a)

    async def rollout():
        return await asyncio.gather(*[e.generate(p, GREEDY) for p in PROMPTS])

    loop = event_loop.EventLoopThread(timeout_s=60)
    try:
        for _ in range(2):
            loop.run(rollout())
            e._worker.submit(lambda: None).result()  # whatever the idle engine queued has run
    finally:
        loop.close(10)
    assert freed.count(("caller", threading.get_ident())) == 2
    engine_side = [who for kind, who in freed if kind == "engine"]
    assert len(engine_side) == 2 and set(engine_side) == set(steps)


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one torch thread: no OpenMP workers to free")
def test_the_run_loops_worker_threads_free_their_openmp_pools_after_each_piece_of_work():
    """Torch work handed off with asyncio.to_thread (weight buckets, checksums) leaves no OpenMP pool
    behind on the run's event loop's threads."""
    from strop.rollout.event_loop import EventLoopThread

    def work():
        torch.ones(1 << 24).add_(1).sum()
        return _os_threads()

    async def hand_off():
        during = await asyncio.to_thread(work)
        await asyncio.sleep(0.05)
        return during, _os_threads()

    loop = EventLoopThread(timeout_s=60)
    try:
        during, after = loop.run(hand_off())
    finally:
        loop.close(10)
    assert after <= during - (torch.get_num_threads() - 1)
