"""The sampler's first pass handed in (strop.serving.sampling ``block_lse``, what the compiled decode step computes
in its graph): its blocks' logsumexps are what the sampler draws from and normalises by, and only where every
temperature is 1; elsewhere the sampler computes its own from the scaled logits."""

import torch

from strop.serving.sampling import _CHUNK, block_logsumexp, sample

ROWS, VOCAB = 6, 2 * _CHUNK + 452  # (a vocabulary of two whole blocks and a padded tail)


def logits_mostly_in_the_first_block() -> torch.Tensor:
    logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[:, :_CHUNK] += 6.0  # (nearly all of each row's mass: a sample lands there unless its block is gone)
    return logits


def draw(logits, temperature: float, block_lse=None):
    gens = [torch.Generator().manual_seed(i) for i in range(ROWS)]
    t, p, k = torch.full((ROWS,), temperature), torch.ones(ROWS), torch.zeros(ROWS, dtype=torch.long)
    return sample(logits, t, p, k, gens, torch.Generator().manual_seed(99), block_lse=block_lse)


def test_block_logsumexp_is_each_blocks_logsumexp_with_the_tail_block_padded():
    logits = logits_mostly_in_the_first_block()
    lse = block_logsumexp(logits)
    assert lse.shape == (ROWS, 3)
    for b, (lo, hi) in enumerate([(0, _CHUNK), (_CHUNK, 2 * _CHUNK), (2 * _CHUNK, VOCAB)]):
        torch.testing.assert_close(lse[:, b], torch.logsumexp(logits[:, lo:hi], -1), rtol=0, atol=1e-6)


def test_the_sampler_draws_from_and_normalises_by_the_block_logsumexps_handed_in():
    logits = logits_mostly_in_the_first_block()
    lse = block_logsumexp(logits)
    tokens, logprobs = draw(logits, 1.0)
    assert (tokens < _CHUNK).all()  # (the fixture: every row's sample in the first block)
    same = draw(logits, 1.0, lse)
    assert torch.equal(same[0], tokens) and torch.equal(same[1], logprobs)
    # every block 0.5 up: each logprob normalised by a logsumexp 0.5 larger
    up = draw(logits, 1.0, lse + 0.5)
    exact = torch.log_softmax(logits, -1)
    torch.testing.assert_close(logprobs, exact.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), rtol=0, atol=1e-5)
    torch.testing.assert_close(up[1], exact.gather(-1, up[0].unsqueeze(-1)).squeeze(-1) - 0.5, rtol=0, atol=1e-5)
    # the first block without mass: no row draws from it any more
    gone = lse.clone()
    gone[:, 0] = float("-inf")
    assert (draw(logits, 1.0, gone)[0] >= _CHUNK).all()


def test_at_another_temperature_the_sampler_computes_its_own_from_the_scaled_logits():
    logits = logits_mostly_in_the_first_block()
    gone = block_logsumexp(logits)
    gone[:, 0] = float("-inf")
    for temperature in (0.7, 1.3):
        tokens, logprobs = draw(logits, temperature)
        handed = draw(logits, temperature, gone)
        assert torch.equal(handed[0], tokens) and torch.equal(handed[1], logprobs)
        want = torch.log_softmax(logits / temperature, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(logprobs, want, rtol=0, atol=1e-5)
