"""Bytes on the wire, from the operating system: the kernel's own count (TCP_INFO) of what each
rank's gloo connections sent, against what the algorithm must send. The ledger's logical count
is credited by formula; these numbers are observed."""
import sys

import pytest
import torch
import torch.distributed as dist

from zeronb.train import RunConfig, max_diff, run_many

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO is Linux's")

FRAMING = 0.005  # gloo's message headers: well under 0.5 % of a megabyte-sized collective


def _measure(op, numel):
    from zeronb.runtime.compat import reduce_scatter_single
    from zeronb.collectives import ring_all_reduce
    from zeronb.ledger import CommLedger

    n = dist.get_world_size()
    x = torch.ones(numel)
    calls = {"ring_all_reduce": lambda: ring_all_reduce(x),
             "all_reduce": lambda: dist.all_reduce(x),
             "reduce_scatter": lambda: reduce_scatter_single(x.new_empty(numel // n), x)}
    dist.barrier()
    with CommLedger(wire=True) as ledger:
        calls[op]()
    return ledger.bytes_sent, ledger.wire_bytes, len(ledger._wire.by_connection)


@pytest.fixture(scope="module", params=[2, 3, 4])
def pool(request):
    """A pool of its own: the shared ones may have made subgroups, each with connections of its own."""
    from zeronb import Cluster

    with Cluster(request.param, backend="gloo", verbose=False) as c:
        yield c


@pytest.mark.parametrize("op", ["ring_all_reduce", "all_reduce"])
def test_an_all_reduce_puts_2_n_minus_1_over_n_of_the_tensor_on_the_wire(pool, op):
    n, numel = pool.world_size, 3 * 4 * 5 * (1 << 14)  # divisible by 2, 3 and 4
    S = numel * 4
    for logical, wire, connections in pool.run(_measure, op, numel, echo=False):
        assert connections == n - 1  # a full mesh of gloo pairs: one connection per other rank
        assert logical == 2 * (n - 1) * S // n
        assert logical <= wire <= logical * (1 + FRAMING), (op, n, logical, wire)


def test_gloo_reduce_scatter_puts_an_all_reduce_on_the_wire(pool):
    n, numel = pool.world_size, 3 * 4 * 5 * (1 << 14)
    S = numel * 4
    for logical, wire, _ in pool.run(_measure, "reduce_scatter", numel, echo=False):
        assert logical == (n - 1) * S // n  # what a reduce-scatter needs to send
        # what gloo sent: an all-reduce's bytes, twice the logical count
        assert 2 * logical <= wire <= 2 * logical * (1 + FRAMING), (n, logical, wire)


def _nothing_sent():
    from zeronb.ledger import WireMeter

    with WireMeter() as wire:
        torch.ones(1000).sum()
    return wire.bytes


def test_no_traffic_no_bytes(pool):
    assert pool.run(_nothing_sent, echo=False) == [0] * pool.world_size


def test_each_stage_on_the_wire_with_gloo_and_with_a_ring_reduce_scatter(gloo_pool):
    n = 4
    runs = run_many([RunConfig(model="mlp", stage=stage, steps=2, precision="float64", reduce_scatter=rs)
                     for stage in range(4) for rs in ("torch", "ring")], gloo_pool(n))
    by = {(r.config.stage, r.config.reduce_scatter): r for r in runs}
    small = 0.06  # a small model's training step sends many small messages: headers weigh more
    for rank in range(n):
        ddp_wire = by[0, "torch"].ranks[rank].wire_bytes_per_step
        for stage in range(4):
            gloo, ring = by[stage, "torch"].ranks[rank], by[stage, "ring"].ranks[rank]
            logical, wire, wire_ring = sum(gloo.sent_bytes_per_step.values()), gloo.wire_bytes_per_step, ring.wire_bytes_per_step
            assert logical <= wire_ring <= logical * (1 + small), (stage, logical, wire_ring)
            if stage in (1, 2):  # gloo's reduce-scatter is an all-reduce: 2 + 1 shards' worth, not 1 + 1
                assert 1.45 < wire / logical < 1.6, (stage, wire, logical)
                assert abs(wire_ring / ddp_wire - 1) < 0.03  # with a real reduce-scatter: DDP's bytes
            if stage == 0:
                assert logical <= wire <= logical * (1 + small)
            # the same training (the ring adds in another order)
            assert max_diff(by[stage, "torch"].params, by[stage, "ring"].params) < 1e-12
