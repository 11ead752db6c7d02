"""Ring and naive collectives against torch.distributed's own, on real gloo ranks."""
import pytest
import torch
import torch.distributed as dist


SIZES = (1, 5, 1024, 49152, 1_000_003)
DTYPES = (torch.float32, torch.float64)


def _parity(sizes, dtypes, segment_bytes):
    from zeronb import collectives as C
    from zeronb.runtime.compat import all_gather_single
    from zeronb.shards import bounds, chunk_size

    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for numel in sizes:
        for dtype in dtypes:
            g = torch.Generator().manual_seed(1000 * rank + numel)
            x = torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
            ref = x.clone()
            dist.all_reduce(ref)
            a, b = bounds(numel, n, rank)
            ring_ar = C.ring_all_reduce(x.clone(), segment_bytes=segment_bytes)
            ring_avg = C.ring_all_reduce(x.clone(), average=True, segment_bytes=segment_bytes)
            ring_rs = C.ring_reduce_scatter(x, segment_bytes=segment_bytes)
            naive_ar = C.naive_all_reduce(x.clone())
            naive_rs = C.naive_reduce_scatter(x)
            # all-gather: exact; reference from torch's all-gather on padded chunks
            c = chunk_size(numel, n)
            mine = torch.zeros(c, dtype=dtype)
            mine[:b - a] = x[a:b]
            gathered = torch.empty(c * n, dtype=dtype)
            all_gather_single(gathered, mine)
            ref_ag = torch.cat([gathered[r * c: r * c + (min((r + 1) * c, numel) - min(r * c, numel))]
                                for r in range(n)])
            ring_ag = C.ring_all_gather(x[a:b].clone(), numel, segment_bytes=segment_bytes)
            naive_ag = C.naive_all_gather(x[a:b].clone(), numel)
            scale = ref.abs().max().item() if numel else 1.0
            out.append({
                "numel": numel, "dtype": str(dtype),
                "ar": (ring_ar - ref).abs().max().item() / scale,
                "avg": (ring_avg - ref / n).abs().max().item() / scale,
                "rs": (ring_rs - ref[a:b]).abs().max().item() / scale if b > a else 0.0,
                "rs_len": ring_rs.numel() == b - a,
                "naive_ar": (naive_ar - ref).abs().max().item() / scale,
                "naive_rs": (naive_rs - ref[a:b]).abs().max().item() / scale if b > a else 0.0,
                "ag_exact": torch.equal(ring_ag, ref_ag) and torch.equal(naive_ag, ref_ag),
            })
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_parity_with_torch_distributed(gloo_pool, n):
    # small segments, so that the pipeline (several segments per chunk) is exercised too
    c = gloo_pool(n)
    res = c.run(_parity, SIZES, DTYPES, 64 << 10, echo=False, timeout=300)
    for rank_rows in res:
        for row in rank_rows:
            tol = 1e-6 if row["dtype"] == "torch.float32" else 1e-14  # summation order only
            for key in ("ar", "avg", "rs", "naive_ar", "naive_rs"):
                assert row[key] <= tol, row
            assert row["rs_len"] and row["ag_exact"], row



def _scratch_kept():
    from zeronb import collectives as C
    from zeronb.collectives import ring

    ring._kept.clear()  # (the shared pool ran larger collectives before: start from no scratch)
    rank, n = dist.get_rank(), dist.get_world_size()
    sums = []
    for numel in (4096, 4096, 1024, 40_000, 4096):  # the same size again, smaller, then larger
        x = torch.full((numel,), float(rank + 1))
        sums.append(C.ring_all_reduce(x, segment_bytes=4096).unique().tolist())
        shard = C.ring_reduce_scatter(torch.full((numel,), float(rank + 1)), segment_bytes=4096)
        sums.append(shard.unique().tolist())
        if numel == 4096 and len(sums) == 2:
            first = ring._kept[torch.float32].data_ptr()
        if len(sums) == 4:
            reused = ring._kept[torch.float32].data_ptr() == first
    return sums, reused, ring._kept[torch.float32].numel() == 4 * 40_000 // n


def test_ring_scratch_is_kept_between_calls_and_grows_when_needed(gloo_pool):
    # a fresh scratch buffer each call took about a thousand page faults per 16 MiB all-reduce
    c = gloo_pool(4)
    res = c.run(_scratch_kept, echo=False)
    for sums, reused, grown in res:
        assert sums == [[10.0]] * 10  # 1 + 2 + 3 + 4, whatever the buffer held before
        assert reused and grown


def _in_groups(numel):
    """Rings over the pairs {0, 1} and {2, 3} of 4 ranks, against torch's collectives over the same pairs."""
    from zeronb import collectives as C
    from zeronb.runtime.compat import reduce_scatter_single
    from zeronb.runtime.groups import sharding_groups

    pair, _ = sharding_groups(2)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()), dtype=torch.float64)
    ref = x.clone()
    dist.all_reduce(ref, group=pair)
    half = numel // 2
    ref_rs = x.new_empty(half)
    reduce_scatter_single(ref_rs, x, group=pair)
    mine = dist.get_rank(pair)
    return ((C.ring_all_reduce(x.clone(), group=pair) - ref).abs().max().item(),
            (C.ring_reduce_scatter(x, group=pair) - ref_rs).abs().max().item(),
            torch.equal(C.ring_all_gather(ref[mine * half:(mine + 1) * half].clone(), numel, group=pair), ref))


def test_rings_over_a_subgroup_equal_torch_distributed_over_it(gloo_pool):
    for ar, rs, ag in gloo_pool(4).run(_in_groups, 1 << 12, echo=False):
        assert ar <= 1e-14 and rs <= 1e-14 and ag


def _bfloat16():
    from zeronb.collectives import ring_all_reduce

    x = torch.full((1000,), float(dist.get_rank() + 1), dtype=torch.bfloat16)
    return ring_all_reduce(x).unique().tolist()


def test_bfloat16(gloo_pool):
    c = gloo_pool(4)
    assert c.run(_bfloat16, echo=False) == [[10.0]] * 4  # small integers: exact in bfloat16


def _ledger_bytes(numel, dtype):
    from zeronb import collectives as C
    from zeronb.runtime.compat import all_gather_single, reduce_scatter_single
    from zeronb.ledger import CommLedger
    from zeronb.shards import bounds

    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.ones(numel, dtype=dtype)
    a, b = bounds(numel, n, rank)
    out = {}
    for name, call in {
        "ring_all_reduce": lambda: C.ring_all_reduce(x),
        "ring_reduce_scatter": lambda: C.ring_reduce_scatter(x),
        "ring_all_gather": lambda: C.ring_all_gather(x[a:b].clone(), numel),
        "all_reduce": lambda: dist.all_reduce(x),
        "reduce_scatter": lambda: reduce_scatter_single(torch.empty(numel // n, dtype=dtype), x),
        "all_gather": lambda: all_gather_single(torch.empty(numel, dtype=dtype), x[a:b].clone()),
        "broadcast": lambda: dist.broadcast(x, 0),
        "naive_all_reduce": lambda: C.naive_all_reduce(x),
    }.items():
        with CommLedger() as ledger:
            call()
        out[name] = dict(ledger.by_op)
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ledger_bytes_are_exact(gloo_pool, n):
    numel, elem = 12 * 1024, 4  # divisible by 2, 3 and 4
    S = numel * elem
    c = gloo_pool(n)
    res = c.run(_ledger_bytes, numel, torch.float32, echo=False)
    for rank, got in enumerate(res):
        assert got["ring_all_reduce"] == {"ring_all_reduce": 2 * (n - 1) * S // n}
        assert got["ring_reduce_scatter"] == {"ring_reduce_scatter": (n - 1) * S // n}
        assert got["ring_all_gather"] == {"ring_all_gather": (n - 1) * S // n}
        assert got["all_reduce"] == {"all_reduce": 2 * (n - 1) * S // n}
        assert got["reduce_scatter"] == {"reduce_scatter": (n - 1) * S // n}
        assert got["all_gather"] == {"all_gather": (n - 1) * S // n}
        assert got["broadcast"] == {"broadcast": S}
        # the root sends the sum to each other rank; the others send their tensor once
        assert got["naive_all_reduce"] == {"naive_all_reduce": (n - 1) * S if rank == 0 else S}



def _ledger_elements():
    from zeronb.runtime.compat import all_gather_single, reduce_scatter_single
    from zeronb.ledger import CommLedger

    n = dist.get_world_size()
    with CommLedger() as ledger:
        dist.all_reduce(torch.ones(1, dtype=torch.float64))  # one number, as a gradient norm
        all_gather_single(torch.empty(6 * n), torch.ones(6))
        reduce_scatter_single(torch.empty(5), torch.ones(5 * n))
    return dict(ledger.by_op), dict(ledger.elements)


def test_ledger_counts_the_elements_a_credit_cannot_tell_apart(gloo_pool):
    # A ring pads one element to N chunks: its credit is the same for 1 to N elements, its element count is not
    n = 4
    for credited, elements in gloo_pool(n).run(_ledger_elements, echo=False):
        assert credited["all_reduce"] == 2 * (n - 1) * 8 and elements["all_reduce"] == 1
        assert elements == {"all_reduce": 1, "all_gather": 6 * n, "reduce_scatter": 5 * n}, elements


def _bad_inputs():
    from zeronb import collectives as C

    errors = []
    for call in (lambda: C.ring_all_gather(torch.ones(3), 10),            # wrong shard size
                 lambda: C.ring_all_reduce(torch.ones(4, dtype=torch.int64), average=True)):
        try:
            call()
        except (ValueError, TypeError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    return errors


def test_bad_input_gets_a_clear_error(gloo_pool):
    c = gloo_pool(2)
    res = c.run(_bad_inputs, echo=False)
    assert "shard of 5 elements" in res[0][0] and "not 3" in res[0][0]
    assert res[0][1].startswith("TypeError") and "floating-point" in res[0][1]


def test_outside_a_rank():
    from zeronb.collectives import ring_all_reduce

    with pytest.raises(RuntimeError, match="inside a rank"):
        ring_all_reduce(torch.ones(3))
