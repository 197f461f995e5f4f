"""The chunked coalesced all-reduce on 2 gloo processes: bitwise equal to one flat buffer,
and its peak extra memory within the contract."""

import pytest
import torch

from strop.parallel.collectives import MIN_BUCKET_BYTES, all_reduce_coalesced, resolve_bucket_bytes, split_into_buckets
from strop.parallel.launch import run_on_ranks

MiB = 1 << 20
# sizes in float32 elements: 3 MiB, 1 MiB, 6 MiB (above a 4 MiB budget), 0.25 MiB, 2 MiB, 40 KiB, 2 MiB
SIZES = [(768, 1024), (256, 1024), (1536, 1024), (64, 1024), (512, 1024), (10, 1024), (2, 256, 1024)]


def make_tensors(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(*shape, generator=g) for shape in SIZES]


def _bitwise(rank, world, budgets):
    import torch.distributed as dist

    out = {}
    for op in ("sum", "avg"):
        reference = make_tensors(rank)
        flat = torch.cat([t.reshape(-1) for t in reference])  # one flat buffer: the baseline
        dist.all_reduce(flat)
        if op == "avg":
            flat.div_(world)
        for budget in budgets:
            tensors = make_tensors(rank)
            all_reduce_coalesced(tensors, op=op, bucket_bytes=budget)
            got = torch.cat([t.reshape(-1) for t in tensors])
            out[(op, budget)] = bool(torch.equal(got, flat))
    return out


def test_chunked_reduction_is_bitwise_equal_to_one_flat_buffer():
    # 100 KiB is smaller than every tensor but one; 1 GiB holds them all in one bucket
    budgets = [100 * 1024, MIN_BUCKET_BYTES, 4 * MiB, 16 * MiB, 1 << 30]
    results = run_on_ranks(_bitwise, 2, budgets, timeout=120)
    for rank_result in results:
        assert all(rank_result.values()), rank_result


def _peak_extra_rss(rank, world, budget):
    import resource

    tensors = make_tensors(rank)
    for t in tensors:
        t.add_(0)  # touch every page before the baseline
    all_reduce_coalesced([torch.ones(8)], bucket_bytes=budget)  # warm the gloo path with a tiny call
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    all_reduce_coalesced(tensors, op="avg", bucket_bytes=budget)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return after - before


@pytest.mark.parametrize("budget", [MIN_BUCKET_BYTES, 4 * MiB, 1 << 30])
def test_peak_extra_memory_stays_within_the_budget(budget):
    """Measured, not self-reported: the rise of each process's peak RSS during the reduction."""
    total = sum(torch.Size(s).numel() * 4 for s in SIZES)
    largest = max(torch.Size(s).numel() * 4 for s in SIZES)
    # a fixed mmap threshold makes every large buffer a fresh mapping, returned when freed
    env = {"MALLOC_MMAP_THRESHOLD_": "131072"}
    extras = run_on_ranks(_peak_extra_rss, 2, budget, timeout=120, env=env)
    bound = min(budget, total) + largest + MiB  # + 1 MiB for allocator and gloo bookkeeping
    for extra in extras:
        assert extra <= bound, (extra / MiB, bound / MiB)
    if budget == MIN_BUCKET_BYTES:
        assert max(extras) < total / 2  # far below what one flat buffer costs


def test_buckets_are_greedy_in_order_and_oversize_tensors_travel_alone():
    tensors = [torch.empty(n) for n in (100, 100, 300, 50, 50, 50)]  # float32: 400, 400, 1200, 200... bytes
    assert split_into_buckets(tensors, 800) == [[0, 1], [2], [3, 4, 5]]
    assert split_into_buckets(tensors, 10**9) == [[0, 1, 2, 3, 4, 5]]
    mixed = [torch.empty(10), torch.empty(10, dtype=torch.float64), torch.empty(10, dtype=torch.float64)]
    assert split_into_buckets(mixed, 10**9) == [[0], [1, 2]]  # dtypes never share a flat buffer


def test_budget_from_config_environment_and_minimum(monkeypatch):
    monkeypatch.delenv("STROP_GRAD_REDUCE_BUCKET_BYTES", raising=False)
    assert resolve_bucket_bytes() == 1 << 30
    assert resolve_bucket_bytes(8 * MiB) == 8 * MiB
    monkeypatch.setenv("STROP_GRAD_REDUCE_BUCKET_BYTES", str(2 * MiB))
    assert resolve_bucket_bytes(8 * MiB) == 2 * MiB  # the environment wins
    monkeypatch.setenv("STROP_GRAD_REDUCE_BUCKET_BYTES", "1000")
    with pytest.raises(ValueError, match="STROP_GRAD_REDUCE_BUCKET_BYTES=1000 is below the 1 MiB minimum"):
        resolve_bucket_bytes()
    monkeypatch.setenv("STROP_GRAD_REDUCE_BUCKET_BYTES", "lots")
    with pytest.raises(ValueError, match="not an integer"):
        resolve_bucket_bytes()
    monkeypatch.delenv("STROP_GRAD_REDUCE_BUCKET_BYTES")
    with pytest.raises(ValueError, match="parallel.grad_reduce_bucket_bytes=4096 is below"):
        resolve_bucket_bytes(4096)


def _hang(rank, world):
    import torch.distributed as dist

    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins


def test_a_hung_rank_fails_fast_instead_of_stalling():
    with pytest.raises((TimeoutError, RuntimeError)):
        run_on_ranks(_hang, 2, timeout=15)
