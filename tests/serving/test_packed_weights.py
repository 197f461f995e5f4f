"""When the fast decoder's fused and packed weight copies live: an engine beside a trainer frees them whenever it
goes idle (the weights change before its next batch, and the trainer gets the memory); strop serve and the standalone
proxy keep them from batch to batch, packed once, until a weight load, which frees them at once; and the tokens are
the same either way, before and after an update."""

import asyncio
import copy
import time

import pytest
import torch

from strop.serving.cpu_kernels import unavailable
from strop.serving.embedded import EmbeddedEngine
from strop.types import SamplingParams
from tests.tiny import make_tiny_model

PROMPTS = [[5, 17, 230, 9], [44, 45, 46], [7, 8, 9, 10, 11]]


def sampling(n=6):
    return [SamplingParams(temperature=1.0, max_new_tokens=n, seed=10 + i, stop_token_ids=[-1]) for i in range(n)]


def tokens(engine):
    return [c.token_ids for c in engine.generate_batch(PROMPTS, sampling()[: len(PROMPTS)])]


def held(engine) -> list:
    """The decoder's fused weights and packed buffers (None where freed)."""
    return [(lin.weight, lin.packed) for lin in engine._fast.linears]


def freed(engine) -> bool:
    return all(w is None and p is None for w, p in held(engine))


@pytest.fixture
def tiny():
    return make_tiny_model(seed=3).eval()


def test_an_engine_beside_a_trainer_frees_its_packed_weights_whenever_it_goes_idle(tiny):
    engine = EmbeddedEngine(copy.deepcopy(tiny), pad_token_id=0)
    assert engine.release_idle and engine._fast is not None
    first = tokens(engine)
    assert freed(engine)
    assert tokens(engine) == first and freed(engine)

    async def served():  # through the scheduler (strop serve's and the rollout's path)
        out = await engine.generate(PROMPTS[0], sampling()[0])
        deadline = time.monotonic() + 10
        while not freed(engine) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return out

    assert asyncio.run(served()).token_ids == first[0] and freed(engine)


@pytest.mark.parametrize("kernel", ["onednn", "mkl"])
def test_a_serving_engine_keeps_its_packed_weights_until_a_weight_load_frees_them(tiny, kernel):
    if unavailable(kernel, torch.float32):
        pytest.skip(f"{kernel} is not built here")
    keep = EmbeddedEngine(copy.deepcopy(tiny), pad_token_id=0, release_idle=False, cpu_kernels=kernel)
    want = tokens(EmbeddedEngine(copy.deepcopy(tiny), pad_token_id=0, cpu_kernels=kernel))
    assert tokens(keep) == want
    packed, rows = held(keep), [lin.packed_rows for lin in keep._fast.linears]
    assert all(p is not None for _, p in packed) and all(w is not None for w, _ in packed)
    assert tokens(keep) == want
    assert all(a is b and c is d for (a, c), (b, d) in zip(packed, held(keep)))  # the same copies: none rebuilt

    async def through_scheduler():  # (one row, where the batches above had three)
        return await keep.generate(PROMPTS[1], sampling()[1])

    assert asyncio.run(through_scheduler()).token_ids == want[1]
    assert all(a is b for (a, _), (b, _) in zip(packed, held(keep)))  # the fused weights: never rebuilt
    if kernel == "onednn":  # one packing serves every row count: the same buffers
        assert all(c is d for (_, c), (_, d) in zip(packed, held(keep)))
    else:  # MKL's packing is for a row count: the one-row batch packed for one row, and three rows again
        assert all(lin.packed_rows == 1 for lin in keep._fast.linears)
        assert tokens(keep) == want and [lin.packed_rows for lin in keep._fast.linears] == rows

    changed = {name: p.detach() * 1.5 for name, p in tiny.named_parameters() if name.endswith("proj.weight")}
    assert asyncio.run(keep.update_weights(changed, strict=False)) == 1
    assert freed(keep)  # the stale copies are gone at the load, not at the next batch
    updated = copy.deepcopy(tiny)
    updated.load_state_dict(changed, strict=False)
    want_after = tokens(EmbeddedEngine(updated, pad_token_id=0))
    assert want_after != want  # (the update changed what is decoded)
    assert tokens(keep) == want_after and not freed(keep)


@pytest.mark.parametrize(
    "options",
    [dict(batch_invariant=True), dict(speculative=4), dict(cpu_kernels="mkl"), dict(cpu_kernels="plain")],
    ids=["batch_invariant", "speculative", "mkl", "plain"],
)
def test_kept_copies_decode_what_freed_ones_do_with_the_decoders_options(tiny, options):
    """Kept copies under the options that pack differently (per row count, two kernels alternating, none): the
    tokens equal those of an engine freeing them, twice in a row, and after a weight load."""
    if options.get("cpu_kernels") == "mkl" and unavailable("mkl", torch.float32):
        pytest.skip("MKL's packed sgemm is not built here")
    keep = EmbeddedEngine(copy.deepcopy(tiny), pad_token_id=0, release_idle=False, **options)
    free = EmbeddedEngine(copy.deepcopy(tiny), pad_token_id=0, **options)
    want = tokens(free)
    assert tokens(keep) == want and tokens(keep) == want and not freed(keep)
    changed = {name: p.detach() * 1.5 for name, p in tiny.named_parameters() if name.endswith("proj.weight")}
    for engine in (keep, free):
        asyncio.run(engine.update_weights(changed, strict=False))
    assert freed(keep)
    after = tokens(free)
    assert after != want and tokens(keep) == after


def test_strop_serve_builds_its_engine_keeping_the_packed_weights(tiny_model_dir, monkeypatch):
    import strop.serving.server as server

    built = []

    def create_app(engine, **kwargs):
        built.append(engine)
        raise KeyboardInterrupt  # (stop before serving)

    monkeypatch.setattr(server, "create_app", create_app)
    with pytest.raises(KeyboardInterrupt):
        server.serve(str(tiny_model_dir))
    assert [e.release_idle for e in built] == [False]


def test_the_standalone_proxys_engine_keeps_the_packed_weights(tiny_model_dir):
    from strop.agents.serve import build_engine

    engine, *_ = build_engine(
        str(tiny_model_dir), [], "strop", None, device="cpu", dtype="float32", max_batch_size=2, seed=0
    )
    assert engine.release_idle is False


def test_a_failed_weight_load_frees_the_copies_too(tiny):
    """A load that fails midway may have written some tensors: nothing built from the weights before it stays."""
    keep = EmbeddedEngine(copy.deepcopy(tiny), pad_token_id=0, release_idle=False)
    tokens(keep)
    assert not freed(keep)
    name = next(n for n, _ in tiny.named_parameters() if n.endswith("proj.weight"))
    with pytest.raises(Exception):
        asyncio.run(keep.update_weights({name: torch.zeros(3, 3)}, strict=False))
    assert freed(keep)
