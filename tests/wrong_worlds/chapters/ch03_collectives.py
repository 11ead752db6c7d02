"""Chapter 3, collectives: its check cells and their wrong worlds."""
from __future__ import annotations

from ..planting import replace, when_imported
from . import chapter, world


# --- chapter 3: collectives ----------------------------------------------------------------------------

chapter("03_collectives", {
    "results": "each collective's result on every rank equals the notebook's own sum of the inputs; ReduceOp.AVG "
               "does what this torch and backend should (compat.expected_avg_outcomes)",
    "identity": "gloo's built-in reduce-scatter + all-gather equals its all-reduce bit for bit; the ring's halves equal "
                "its all-reduce and the forward ring order; gloo's all-reduce is the mirrored ring, bit for bit",
    "bytes": "the ring's sends add up to the formulas; on the wire the ring's halves equal its all-reduce, gloo's "
             "reduce-scatter is an all-reduce, the naive root sends (N-1)S; a size mismatch raises on every rank",
})


def _reduce_scatter_rotated():
    """The built-in reduce-scatter hands rank r the shard of rank r+1 (its input taken one chunk on)."""
    def patch(dist):
        original = dist.reduce_scatter_single

        def rotated(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            import torch
            return original(output, torch.roll(input.reshape(-1), -output.numel()), op=op, group=group,
                            async_op=async_op)
        dist.reduce_scatter_single = rotated
    when_imported("torch.distributed", patch)


world("03_collectives", "a reduce-scatter that hands each rank the next rank's shard",
      "reduce-scatter gives rank r shard r of the sum: here rank r gets shard r+1", "results", _reduce_scatter_rotated)


def _gloo_reduce_scatter_ignores_avg():
    """gloo's reduce-scatter as it was before pytorch#171458: it all-reduces a copy of its input and never
    hands that all-reduce the op, so AVG is accepted and a sum comes back."""
    def patch(dist):
        original = dist.reduce_scatter_single

        def sums(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            return original(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        dist.reduce_scatter_single = sums
    when_imported("torch.distributed", patch)


world("03_collectives", "gloo's reduce-scatter ignores AVG (before pytorch#171458)",
      "torch 2.13's gloo reduce-scatter honours ReduceOp.AVG: here it sums, as torch did before the fix",
      "results", _gloo_reduce_scatter_ignores_avg)


def _ring_runs_backwards():
    """zeronb's ring runs the other way round: every rank sends to rank-1 and receives from rank+1 (its
    ranks numbered backwards round the circle). The all-reduce still sums right; the order of the
    additions is another."""
    def patch(ring):
        world_, peer_ = ring.world, ring.peer

        def backwards_world(group=None):
            rank, n = world_(group)
            return (-rank) % n, n

        def backwards_peer(group, group_rank):
            n = world_(group)[1]
            return peer_(group, (-group_rank) % n)
        ring.world, ring.peer = backwards_world, backwards_peer
    when_imported("zeronb.collectives.ring", patch)


world("03_collectives", "zeronb's ring runs the other way round",
      "the ring adds chunk k in the order k+1, k+2, ..., k (ring_order_sum): here its ranks send to rank-1",
      "identity", _ring_runs_backwards)


def _builtin_all_reduce_is_zeronbs_ring():
    """The backend's all-reduce is a ring in zeronb's direction (rank r sends to r+1), not gloo's mirrored one."""
    def patch(dist):
        original = dist.all_reduce

        def forward_ring(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if op == dist.ReduceOp.SUM and group is None and not async_op and tensor.is_floating_point():
                from zeronb.collectives import ring_all_reduce
                ring_all_reduce(tensor)
                return None
            return original(tensor, op=op, group=group, async_op=async_op)
        dist.all_reduce = forward_ring
    when_imported("torch.distributed", patch)


world("03_collectives", "a built-in all-reduce that runs the ring forwards",
      "gloo's all-reduce is the mirrored ring (ring_order_sum(xs, -1)): here it adds in zeronb's ring order",
      "identity", _builtin_all_reduce_is_zeronbs_ring)


def _ring_reduce_scatter_is_an_all_reduce():
    """zeronb's ring reduce-scatter all-reduces a copy of its input and keeps its shard, as PyTorch's gloo
    process group does: the right values, twice the bytes."""
    def patch(ring):
        def reduce_scatter(tensor, *, average=False, group=None, segment_bytes=ring.SEGMENT_BYTES):
            rank, n = ring.world(group)
            whole = ring.ring_all_reduce(tensor.detach().clone(), average=average, group=group,
                                         segment_bytes=segment_bytes)
            start, stop = ring.bounds(tensor.numel(), n, rank)
            return whole.reshape(-1)[start:stop].clone()
        ring.ring_reduce_scatter = reduce_scatter
    when_imported("zeronb.collectives.ring", patch)


world("03_collectives", "a ring reduce-scatter that runs a whole all-reduce",
      "the ring reduce-scatter sends (N-1)/N S per rank: here it all-reduces and keeps its shard (2(N-1)/N S)",
      "bytes", _ring_reduce_scatter_is_an_all_reduce)


def _naive_all_reduce_broadcasts_back():
    """The naive all-reduce returns the sum with dist.broadcast (gloo's tree) instead of one send per rank."""
    def patch(naive):
        def naive_all_reduce(tensor, *, root=0):
            import torch.distributed as dist
            naive.check_same(tensor.numel(), tensor.dtype, tensor.device, "naive_all_reduce")
            flat = tensor.detach().view(-1)
            with naive.ledger.scope("naive_all_reduce"):
                naive._reduce_to_root(flat, root)
                dist.broadcast(flat, root)
            return tensor
        naive.naive_all_reduce = naive_all_reduce
    when_imported("zeronb.collectives.naive", patch)


world("03_collectives", "a naive all-reduce that broadcasts the sum back",
      "the naive all-reduce's root sends (N-1) S, every other rank S: here the root broadcasts the sum",
      "bytes", _naive_all_reduce_broadcasts_back)


def _builtin_reduce_scatter_is_a_ring():
    """The backend's reduce-scatter is a real one, a ring that sends (N-1)/N S (as NCCL's is, or gloo's
    library algorithm): not the whole all-reduce PyTorch's gloo process group runs."""
    def patch(dist):
        original = dist.reduce_scatter_single

        def real_reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if group is None and not async_op and op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                from zeronb.collectives import ring_reduce_scatter
                output.copy_(ring_reduce_scatter(input, average=op == dist.ReduceOp.AVG).view_as(output))
                return None
            return original(output, input, op=op, group=group, async_op=async_op)
        dist.reduce_scatter_single = real_reduce_scatter
    when_imported("torch.distributed", patch)


world("03_collectives", "a built-in reduce-scatter that sends only what it needs",
      "gloo's reduce-scatter is an all-reduce (same bits, same bytes on the wire): here it is a ring "
      "reduce-scatter", ("identity", "bytes"), _builtin_reduce_scatter_is_a_ring)


def _size_check_against_rank_0_only():
    """The size check compares each rank with rank 0 only (a broadcast of rank 0's size): rank 0 never sees
    the mismatch and goes on into the ring, where it waits for the others."""
    def patch(checks):
        def check_same(numel, dtype, device, what, group=None):
            import torch
            import torch.distributed as dist
            rank, n = checks.world(group)
            code = checks.DTYPES.index(dtype) if dtype in checks.DTYPES else -1
            mine = torch.tensor([numel, code], dtype=torch.int64, device=device)
            theirs = mine.clone()
            with checks.ledger.muted():
                dist.broadcast(theirs, checks.peer(group, 0), group=group)
            if not torch.equal(mine, theirs):
                raise ValueError(f"{what}: rank {rank} has {numel} x {dtype}, rank 0 has {theirs[0].item()}")
        checks.check_same = check_same
    when_imported("zeronb.collectives.checks", patch)


world("03_collectives", "a size check that only compares with rank 0",
      "a size mismatch raises on every rank, naming every rank's size: here rank 0 goes on and waits in the ring",
      "bytes", _size_check_against_rank_0_only)
