"""Batch invariance of the embedded engine (``batch_invariant=True``, what ``rollout.exact_logprobs``
turns on): a request's tokens, logprobs and the logits it samples from are bitwise the same alone and
in batches of 4, 16 and 44, at any slot, joining a running batch, beside other prompt lengths and
other sampling settings."""

import asyncio
import random

import pytest
import torch

from strop.serving.embedded import EmbeddedEngine
from strop.serving.invariant import packed_rows, rows_linear
from strop.serving.batch import Batch
from strop.serving.cpu_kernels import unavailable
from strop.serving.linear import PackedLinear
from strop.serving.sampling import sample
from strop.types import SamplingParams
from tests.tiny import make_tiny_model, make_tiny_qwen3

SEEDED = SamplingParams(temperature=1.0, max_new_tokens=16, seed=1234, stop_token_ids=[-1])
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=[-1])
FILTERED = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_new_tokens=16, seed=77, stop_token_ids=[-1])
PROMPT = [412, 9031, 77, 15, 2204, 388, 6001, 45, 902, 13, 31]


@pytest.fixture(scope="module")
def llama():
    return make_tiny_model()


def engine(model, **kw):
    return EmbeddedEngine(model, pad_token_id=0, default_stop_token_ids=[2], **kw)


def watch(e):
    """Record, per SamplingParams object, each logits row the engine samples it from."""
    seen, real = {}, e._sample_rows

    def spy(logits, rows):
        for j, r in enumerate(rows):
            seen.setdefault(id(r.sampling), []).append(logits[j].clone())
        return real(logits, rows)

    e._sample_rows = spy
    return seen


def decode(e, prompts, samplings, join_at=None):
    """One continuous batch on ``e``'s fast decoder: request i is admitted at step ``join_at[i]``
    (default 0). Returns the rows."""
    join_at = join_at or {}
    batch = Batch(e._fast, e._sample_rows, pad_token_id=0)
    rows = [e._row(p, s) for p, s in zip(prompts, samplings)]
    step, last = 0, max(join_at.values(), default=0)
    while True:
        take = [i for i in range(len(rows)) if join_at.get(i, 0) == step]
        if not take and not batch.live and step > last:
            return rows
        e._advance(batch, [prompts[i] for i in take], [rows[i] for i in take])
        step += 1


def others(n, seed):
    """``n`` other requests: prompts of 1-40 tokens, greedy and seeded rows (one in eight with top-p
    or top-k), 1-24 tokens each."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randrange(1, 41))] for _ in range(n)]
    samplings = [
        SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.0]),
            top_p=0.9 if i % 8 == 3 else 1.0,
            top_k=50 if i % 8 == 7 else 0,
            max_new_tokens=rng.randrange(1, 25),
            seed=rng.randrange(1 << 30),
            stop_token_ids=[-1],
        )
        for i in range(n)
    ]
    return prompts, samplings


def assert_same(seen, row, sampling, alone):
    """``row`` decoded what ``alone`` (token ids, logprobs, logits rows) holds, bitwise."""
    assert row.token_ids == alone[0]
    assert torch.equal(torch.tensor(row.logprobs), alone[1])
    logits = seen[id(sampling)]
    assert len(logits) == len(alone[2]) and all(torch.equal(a, b) for a, b in zip(logits, alone[2]))


def alone(e, seen, prompt, sampling):
    row = decode(e, [prompt], [sampling])[0]
    return row.token_ids, torch.tensor(row.logprobs), seen.pop(id(sampling))


@pytest.mark.parametrize("n", [4, 16, 44])
def test_a_request_is_bitwise_the_same_alone_and_in_a_batch_at_any_slot(llama, n):
    """Seeded, greedy and top-p/top-k requests at the first, a middle and the last slot of n requests
    admitted together (each kind at another slot for each n): other prompt lengths (a padded prefill
    otherwise), other settings, rows finishing and slots compacting."""
    e = engine(llama, batch_invariant=True)
    seen = watch(e)
    kinds = [SEEDED, GREEDY, FILTERED][n % 3 :] + [SEEDED, GREEDY, FILTERED][: n % 3]
    wants = [alone(e, seen, PROMPT[: 5 + 3 * i], s) for i, s in enumerate(kinds)]
    prompts, samplings = others(n, seed=n)
    slots = (0, n // 2, n - 1)
    for i, (slot, s) in enumerate(zip(slots, kinds)):
        prompts[slot], samplings[slot] = PROMPT[: 5 + 3 * i], s
    rows = decode(e, prompts, samplings)
    for slot, s, want in zip(slots, kinds, wants):
        assert_same(seen, rows[slot], s, want)


@pytest.mark.parametrize("n", [4, 16, 44])
def test_a_request_joining_a_running_batch_is_the_same_as_alone(llama, n):
    """It joins at step 6 with another new request of another length, into a batch whose rows
    started earlier (its keys sit at other cache columns) and some of which finished (free slots)."""
    e = engine(llama, batch_invariant=True)
    seen = watch(e)
    want = alone(e, seen, PROMPT, SEEDED)
    prompts, samplings = others(n, seed=n)
    prompts[-1], samplings[-1] = PROMPT, SEEDED
    samplings[0] = SamplingParams(temperature=1.0, max_new_tokens=30, seed=8, stop_token_ids=[-1])  # still running
    rows = decode(e, prompts, samplings, join_at={n - 2: 6, n - 1: 6})
    assert_same(seen, rows[-1], SEEDED, want)


def test_a_groups_shared_prompt_is_prefilled_once_and_each_sample_is_as_alone(llama):
    e = engine(llama, batch_invariant=True)
    seen = watch(e)
    group = [SamplingParams(temperature=1.0, max_new_tokens=12, seed=500 + i, stop_token_ids=[-1]) for i in range(8)]
    wants = [alone(e, seen, PROMPT, s) for s in group]
    prompts, samplings = others(8, seed=5)
    batch = Batch(e._fast, e._sample_rows, pad_token_id=0)
    rows = [e._row(p, s) for p, s in zip(prompts + [PROMPT] * 8, samplings + group)]
    e._advance(batch, prompts + [PROMPT] * 8, rows)
    while batch.live:
        batch.step()
    assert batch.prefilled_tokens == sum(map(len, prompts)) + len(PROMPT)  # the group's prompt once
    for row, s, want in zip(rows[8:], group, wants):
        assert_same(seen, row, s, want)


def test_concurrent_generate_calls_get_what_they_get_alone(llama):
    """44 requests through the async API, the watched ones at the first, middle and last place and
    four more arriving while the batch decodes."""
    e = engine(llama, batch_invariant=True)
    seen = watch(e)
    watched = [SamplingParams(temperature=0.9, max_new_tokens=10, seed=40 + i, stop_token_ids=[-1]) for i in range(7)]
    wants = [alone(e, seen, PROMPT[: 4 + i], s) for i, s in enumerate(watched)]
    prompts, samplings = others(40, seed=9)
    at = {0: 0, 20: 1, 39: 2}  # list index -> watched request

    async def ask(prompt, sampling, delay=0.0):
        await asyncio.sleep(delay)
        return await e.generate(prompt, sampling)

    async def main():
        first = [
            ask(*(PROMPT[: 4 + at[i]], watched[at[i]]) if i in at else (p, s))
            for i, (p, s) in enumerate(zip(prompts, samplings))
        ]
        late = [ask(PROMPT[: 4 + i], watched[i], 0.01 * (i - 2)) for i in range(3, 7)]
        return await asyncio.gather(*first, *late)

    outs = asyncio.run(main())
    got = {at[i]: outs[i] for i in at} | {i: outs[40 + i - 3] for i in range(3, 7)}
    for i, s in enumerate(watched):
        assert got[i].token_ids == wants[i][0] and torch.equal(torch.tensor(got[i].logprobs), wants[i][1])
        assert all(torch.equal(a, b) for a, b in zip(seen[id(s)], wants[i][2]))


def test_qwen3_with_its_query_key_norms_is_batch_invariant_too():
    e = engine(make_tiny_qwen3(), batch_invariant=True)
    seen = watch(e)
    want = alone(e, seen, PROMPT, SEEDED)
    prompts, samplings = others(15, seed=3)
    prompts.insert(7, PROMPT)
    samplings.insert(7, SEEDED)
    assert_same(seen, decode(e, prompts, samplings)[7], SEEDED, want)


@pytest.mark.parametrize("kernels", ["unpacked fp32", "bf16"])
def test_without_packed_fp32_weights_each_row_is_its_own_matmul_and_each_prompt_its_own_prefill(kernels):
    """What runs where the packed sgemm does not (bf16 through oneDNN, no MKL, a GPU): the same
    guarantee, from one ``F.linear`` call per row and one prefill per prompt."""
    model = make_tiny_model() if kernels == "unpacked fp32" else make_tiny_model().to(torch.bfloat16)
    e = engine(model, batch_invariant=True)
    e._fast.prepack = e._fast.prepack and kernels != "unpacked fp32"
    seen = watch(e)
    want = alone(e, seen, PROMPT, SEEDED)
    prompts, samplings = others(15, seed=4)
    prompts[9], samplings[9] = PROMPT, SEEDED
    rows = decode(e, prompts, samplings, join_at={i: 3 for i in range(8, 15)})
    assert_same(seen, rows[9], SEEDED, want)


def test_the_fallback_path_decodes_each_request_as_alone(llama):
    e = engine(llama, fast_decode=False, batch_invariant=True)
    want = e.generate_batch([PROMPT], SEEDED)[0]
    prompts, samplings = others(3, seed=1)
    for pos in (0, 3):
        got = e.generate_batch(prompts[:pos] + [PROMPT] + prompts[pos:], samplings[:pos] + [SEEDED] + samplings[pos:])
        assert got[pos].token_ids == want.token_ids and torch.equal(
            torch.tensor(got[pos].logprobs), torch.tensor(want.logprobs)
        )


def test_without_batch_invariance_a_requests_numbers_change_with_its_batch(llama):
    """The default engine batches for speed: the same request's logits differ between alone and a batch of 16 (a
    padded prefill, batched attention, another matmul kernel for one row where the kernel is MKL). Its logprobs may
    still round alike: on an AMD EPYC, where the default kernel is oneDNN, they did."""
    e = engine(llama)
    seen = watch(e)
    want = alone(e, seen, PROMPT, SEEDED)
    prompts, samplings = others(15, seed=1600)
    decode(e, [PROMPT] + prompts, [SEEDED] + samplings)
    assert not all(torch.equal(a, b) for a, b in zip(seen[id(SEEDED)], want[2]))


def test_the_sampler_draws_a_row_as_alone_whatever_its_neighbours_filters():
    """A row without top-k / top-p gets the token and logprob it gets alone when a neighbour filters
    (the filtered rows' probabilities round differently from the unfiltered blocks' CDF)."""
    torch.manual_seed(0)
    n, V = 64, 49152
    logits = torch.randn(n, V) * 3
    t, p, k = torch.ones(n), torch.ones(n), torch.zeros(n, dtype=torch.long)
    p[0], k[1] = 0.9, 50

    def gens():
        return [torch.Generator().manual_seed(100 + i) for i in range(n)]

    tokens, logprobs = sample(logits, t, p, k, gens(), torch.Generator())
    for i, g in enumerate(gens()):
        tok, lp = sample(logits[i : i + 1], t[i : i + 1], p[i : i + 1], k[i : i + 1], [g], torch.Generator())
        assert tok[0] == tokens[i] and torch.equal(lp[0], logprobs[i]), i


@pytest.mark.parametrize("shape", [(64, 32), (49152, 32), (32, 64), (1536, 576)])
def test_a_decode_steps_linear_gives_a_row_the_same_numbers_at_every_row_count(shape):
    """The kernel property the batch-invariant step rests on: a row's result from 1 to 64 rows, at
    the first and last place, is the one it gets among 2."""
    torch.manual_seed(0)
    lin = PackedLinear([torch.nn.Linear(shape[1], shape[0])])
    lin.refresh()
    x = torch.randn(64, shape[1])

    def run(rows):
        if not unavailable("mkl", lin.weight.dtype):  # packed as the decoder packs a batch-invariant step
            lin.pack(packed_rows(len(rows)))
        return rows_linear(lin, rows)

    pair = torch.stack([x[0], x[1]])
    want = run(pair)
    for m in range(1, 65):
        rows = torch.randn(m, shape[1])
        rows[0], rows[-1] = x[0], x[1] if m > 1 else x[0]
        got = run(rows)
        assert torch.equal(got[0], want[0]), m
        if m > 1:
            assert torch.equal(got[-1], want[1]), m
