"""Prompts that start alike prefilled with their common prefix forwarded once (strop.serving.prefix): the same
logits, keys and values as the whole prompts' forward, the same tokens and logprobs from the engine, the tokens it
saved counted, and the decoders it must not touch left on the whole-prompt forward."""

import pytest
import torch

from strop.serving import prefix
from strop.serving.embedded import EmbeddedEngine
from strop.serving.batch import Batch, Row
from strop.serving.kvdecode import LlamaDecoder
from strop.serving.linear import PackedLinear
from strop.types import SamplingParams
from tests.test_kvdecode import full_forward_logprobs
from tests.tiny import make_tiny_qwen3, make_tiny_qwen3_moe

START = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # 10 tokens every prompt begins with
PROMPTS = [START + [40], START + [41, 42, 43], START + [44, 45, 46, 47, 48, 49], START + [41, 42, 43], START + [7, 7]]


@pytest.mark.parametrize(
    "prompts, shared",
    [
        ([[1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 2, 3]], 2),  # the shortest keeps one token of its own
        ([[1, 2, 3, 4, 5], [1, 2, 7, 4, 5]], 2),
        ([[1, 2, 3], [9, 2, 3]], 0),
        ([[1, 2, 3, 4]], 0),  # one prompt: nothing to share
        (PROMPTS, 10),
    ],
)
def test_the_common_prefix_is_the_shared_start_leaving_each_prompt_a_token(prompts, shared):
    assert prefix.common_prefix(*prefix.left_padded(prompts, 0)) == shared


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_the_shared_prefill_equals_the_whole_prompts_forward(tiny_model, kind):
    model = (tiny_model if kind == "llama" else make_tiny_qwen3()).eval()
    dec = LlamaDecoder(model)
    ids, lengths = prefix.left_padded(PROMPTS, 0)
    with torch.no_grad():
        dec._sync()
        logits, keys, values = prefix.forward_prompts(dec, ids, lengths, PackedLinear.batched)
        s_logits, s_keys, s_values = dec.prefill(ids, lengths)
    assert dec.shared_tokens == 4 * len(START)
    torch.testing.assert_close(s_logits, logits, rtol=0, atol=1e-5)
    P = ids.shape[1]
    for j, n in enumerate(lengths.tolist()):  # each prompt's own columns (the padding's are never attended)
        torch.testing.assert_close(s_keys[:, j, :, P - n :], keys[:, j, :, P - n :], rtol=0, atol=1e-5)
        torch.testing.assert_close(s_values[:, j, :, P - n :], values[:, j, :, P - n :], rtol=0, atol=1e-5)
        assert torch.isfinite(s_keys[:, j]).all() and torch.isfinite(s_values[:, j]).all()


def test_engine_tokens_and_logprobs_with_a_shared_prefix_equal_the_transformers_path(tiny_model):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=[-1])
    fast = EmbeddedEngine(tiny_model, pad_token_id=0, max_batch_size=2)  # rows join a running batch
    slow = EmbeddedEngine(tiny_model, pad_token_id=0, fast_decode=False)
    for a, b in zip(fast.generate_batch(PROMPTS, greedy), slow.generate_batch(PROMPTS, greedy)):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)
    sampled = [SamplingParams(temperature=1.0, max_new_tokens=8, seed=i, stop_token_ids=[-1]) for i in range(5)]
    for prompt, out in zip(PROMPTS, EmbeddedEngine(tiny_model, pad_token_id=0).generate_batch(PROMPTS, sampled)):
        lp = full_forward_logprobs(tiny_model, prompt, out, 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), lp, rtol=0, atol=1e-5)


def test_the_batch_counts_the_prompt_tokens_it_forwarded(tiny_model):
    dec = LlamaDecoder(tiny_model)
    batch = Batch(dec, lambda logits, rows: (logits.argmax(-1), logits[:, 0]), pad_token_id=0)
    rows = [Row(owner=i, sampling=None, budget=3, stops=set(), generator=None) for i in range(len(PROMPTS))]
    batch.admit(PROMPTS, rows)
    unique = {tuple(p) for p in PROMPTS}  # (the repeated prompt once, as before)
    assert batch.prompt_tokens == sum(map(len, PROMPTS))
    assert batch.prefilled_tokens == sum(map(len, unique)) - (len(unique) - 1) * len(START)


def test_routed_experts_batch_invariance_and_share_prefix_off_keep_the_whole_prompt_forward(tiny_model):
    moe = LlamaDecoder(make_tiny_qwen3_moe(seed=3))
    invariant = LlamaDecoder(tiny_model, batch_invariant=True)
    off = LlamaDecoder(tiny_model)
    off.share_prefix = False  # (what bench/compiled_step.py compares against)
    ids, lengths = prefix.left_padded(PROMPTS, 0)
    for dec in (moe, invariant, off):
        with torch.no_grad():
            dec.prefill(ids, lengths)
        assert dec.shared_tokens == 0
    assert len(moe.routes) == moe.routed and moe.routes[0].shape[:2] == ids.shape  # every prompt token's route
