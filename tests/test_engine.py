import asyncio

import pytest
import torch

from strop.serving.embedded import EmbeddedEngine
from strop.serving.request import PromptTooLongError
from strop.train.logprob import response_logprobs
from strop.types import SamplingParams

PROMPTS = [[5, 17, 230, 9], [44, 3], [8, 8, 8, 8, 8, 8, 1]]


def make_engine(model, **kw):
    return EmbeddedEngine(model, pad_token_id=0, default_stop_token_ids=[2], **kw)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_equal_a_full_forward(tiny_model, temperature):
    engine = make_engine(tiny_model, seed=1)
    outs = engine.generate_batch(PROMPTS, SamplingParams(temperature=temperature, max_new_tokens=12, top_k=50))
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([prompt + out.token_ids])
        positions = torch.arange(len(prompt), ids.shape[1]).unsqueeze(0)
        with torch.no_grad():
            lp, _ = response_logprobs(tiny_model, ids, torch.ones_like(ids), positions, temperature=temperature)
        assert len(out.logprobs) == len(out.token_ids) > 0
        torch.testing.assert_close(torch.tensor([out.logprobs]), lp, rtol=0, atol=1e-4)


def test_length_stop_and_seeded_sampling(tiny_model):
    engine = make_engine(tiny_model)
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, seed=123)
    a = engine.generate_batch(PROMPTS, sp)
    b = engine.generate_batch(PROMPTS[:1], sp)  # same seed, different batch: same tokens
    assert a[0].token_ids == b[0].token_ids
    for out in a:
        assert out.finish_reason in ("stop", "length")
        assert len(out.token_ids) <= 6
        if out.finish_reason == "length":
            assert len(out.token_ids) == 6
    # make the first greedy token a stop token: generation ends after one token with "stop"
    greedy = engine.generate_batch(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=5))[0]
    stopped = engine.generate_batch(
        PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=5, stop_token_ids=[greedy.token_ids[0]])
    )[0]
    assert stopped.token_ids == greedy.token_ids[:1] and stopped.finish_reason == "stop"


def test_top_k_one_is_greedy(tiny_model):
    engine = make_engine(tiny_model)
    greedy = engine.generate_batch(PROMPTS, SamplingParams(temperature=0, max_new_tokens=5))
    topk1 = engine.generate_batch(PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=5))
    tiny_p = engine.generate_batch(PROMPTS, SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=5))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in topk1] == [o.token_ids for o in tiny_p]


def test_async_generate_batches_and_updates_weights(tiny_model):
    from tests.tiny import make_tiny_model

    engine = make_engine(tiny_model)
    sp = SamplingParams(temperature=0, max_new_tokens=4)

    async def run():
        return await asyncio.gather(*(engine.generate(p, sp) for p in PROMPTS))

    before = asyncio.run(run())
    assert [o.token_ids for o in before] == [o.token_ids for o in engine.generate_batch(PROMPTS, sp)]
    assert all(o.weight_version == 0 for o in before)
    other = make_tiny_model(seed=99).state_dict()
    assert asyncio.run(engine.update_weights(other, version=5)) == 5
    after = asyncio.run(run())
    assert all(o.weight_version == 5 for o in after)
    # new weights give a different distribution (the tiny model's greedy tokens may coincide)
    assert [o.logprobs for o in after] != [o.logprobs for o in before]


def test_abort_all_ends_running_and_queued_requests(tiny_model):
    engine = make_engine(tiny_model, context_window=100_000, max_batch_size=1)
    long = SamplingParams(max_new_tokens=20_000, stop_token_ids=[-1])  # would run for minutes

    async def run():
        running = asyncio.ensure_future(engine.generate(PROMPTS[0], long))
        queued = asyncio.ensure_future(engine.generate(PROMPTS[1], long))  # waits: batch size 1
        while not engine._lock.locked():  # the first batch is decoding
            await asyncio.sleep(0.01)
        await engine.abort_all()
        return await asyncio.wait_for(asyncio.gather(running, queued), timeout=60)

    running, queued = asyncio.run(run())
    assert running.finish_reason == "abort" and 0 < len(running.token_ids) < 20_000
    assert len(running.logprobs) == len(running.token_ids)
    assert queued.finish_reason == "abort" and queued.token_ids == []
    # the engine still serves after an abort
    again = engine.generate_batch(PROMPTS[:1], SamplingParams(max_new_tokens=3, stop_token_ids=[-1]))[0]
    assert again.finish_reason == "length" and len(again.token_ids) == 3


def test_prompt_longer_than_context_is_rejected(tiny_model):
    engine = make_engine(tiny_model, context_window=8)
    with pytest.raises(PromptTooLongError, match="9 tokens; the context window is 8"):
        engine.generate_batch([list(range(1, 10))], SamplingParams())


def test_sampling_frequencies_follow_the_filtered_distribution(tiny_model):
    engine = make_engine(tiny_model, seed=0)
    n = 20_000
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(n, 1)
    ones, no_k = torch.ones(n), torch.zeros(n, dtype=torch.long)
    tokens, logprobs = engine._sample(logits, ones * 0.5, ones, no_k, [None] * n)
    expected = torch.softmax(logits[0] / 0.5, -1)
    torch.testing.assert_close(torch.bincount(tokens, minlength=4) / n, expected, rtol=0, atol=0.015)
    # logprobs are those of the temperature-scaled distribution, whatever was drawn
    torch.testing.assert_close(logprobs, expected.log()[tokens])
    # top-k 2 keeps tokens 2 and 1 only, renormalised
    tokens, _ = engine._sample(logits, ones, ones, no_k + 2, [None] * n)
    freq = torch.bincount(tokens, minlength=4) / n
    p = torch.softmax(torch.tensor([1.0, 2.0]), -1)
    torch.testing.assert_close(freq, torch.tensor([0.0, p[0], p[1], 0.0]), rtol=0, atol=0.015)
    # top-p 0.7: token 2 (0.665) alone does not reach 0.7, so token 1 joins; 0 and 3 are cut
    tokens, _ = engine._sample(logits, ones, ones * 0.7, no_k, [None] * n)
    assert set(tokens.tolist()) == {1, 2}


def test_cancelling_a_request_cancels_and_the_engine_still_works(tiny_model):
    """Cancellation propagates (it is not turned into an engine error), and nothing stays locked."""
    engine = make_engine(tiny_model)

    async def main():
        long = SamplingParams(temperature=1.0, max_new_tokens=200, stop_token_ids=[-1])
        task = asyncio.ensure_future(engine.generate(PROMPTS[0], long))
        await asyncio.sleep(0.05)
        engine._flush_task.cancel()  # e.g. the run is shutting down
        with pytest.raises(asyncio.CancelledError):
            await task
        # a new request runs: no lock was left held, no abort flag left set
        out = await asyncio.wait_for(
            engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=3, stop_token_ids=[-1])), 30
        )
        assert out.finish_reason == "length" and len(out.token_ids) == 3
        await asyncio.wait_for(engine.update_weights(tiny_model.state_dict(), version=5), 30)
        return engine.weight_version

    assert asyncio.run(main()) == 5


def test_a_cancelled_abort_all_leaves_nothing_held(tiny_model):
    engine = make_engine(tiny_model)

    async def main():
        long = SamplingParams(temperature=1.0, max_new_tokens=120, stop_token_ids=[-1])
        running = asyncio.ensure_future(engine.generate(PROMPTS[0], long))
        await asyncio.sleep(0.05)
        aborting = asyncio.ensure_future(engine.abort_all())
        await asyncio.sleep(0)
        aborting.cancel()  # the caller gave up waiting for the running batch
        out = await asyncio.wait_for(running, 30)
        assert out.finish_reason == "abort"
        # later requests are not aborted and not blocked
        nxt = await asyncio.wait_for(
            engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=4, stop_token_ids=[-1])), 30
        )
        assert nxt.finish_reason == "length" and len(nxt.token_ids) == 4

    asyncio.run(main())


def test_engine_generates_on_the_fixture_device(tiny_model, device):
    engine = make_engine(tiny_model.to(device), seed=1)
    outs = engine.generate_batch(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=5))
    assert engine.device.type == torch.device(device).type and all(len(o.token_ids) > 0 for o in outs)


@pytest.mark.parametrize("wait,batches", [(0.0, 8), (0.02, 1)])
def test_batch_wait_gathers_requests_that_arrive_one_by_one(tiny_model, wait, batches):
    """Over a network requests arrive a little apart: with batch_wait_s they still form one batch
    (one admission); without it each joins the running batch when it arrives."""
    engine = make_engine(tiny_model, batch_wait_s=wait)
    sizes = []
    real = engine._advance

    def recording(batch, prompts, rows):
        if rows:
            sizes.append(len(rows))
        return real(batch, prompts, rows)

    engine._advance = recording

    async def main():
        sp = SamplingParams(max_new_tokens=2, stop_token_ids=[-1])
        tasks = []
        for i in range(8):
            tasks.append(asyncio.ensure_future(engine.generate([5, 6, i + 7], sp)))
            await asyncio.sleep(0.002)  # the next request arrives 2 ms later
        return await asyncio.gather(*tasks)

    outs = asyncio.run(main())
    assert len(outs) == 8 and sum(sizes) == 8
    assert len(sizes) == batches if wait else len(sizes) > 1


def test_a_run_leaves_no_thread_of_its_own_behind(tiny_model_dir, tmp_path):
    """Each thread that ran torch holds an OpenMP team for its life; a process that runs strop again (a
    notebook, this suite) must not collect one per run (strop.openmp: more teams than CPUs stop spinning)."""
    import threading

    from strop.config import build_config
    from strop.loop import train
    from tests.test_e2e import tiny_overrides

    before = set(threading.enumerate())
    train(build_config(overrides=tiny_overrides(tiny_model_dir, tmp_path / "run", train={"steps": 1})))
    left = [t.name for t in threading.enumerate() if t not in before and t.name.startswith("strop")]
    assert not left, left
