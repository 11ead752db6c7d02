"""Ring reduce-scatter, all-gather and all-reduce, built from torch.distributed send and receive.

The ring (Patarasuk & Yuan 2009; the "Baidu ring" of deep learning): the N ranks stand in a
circle, each sends only to the next rank and receives only from the previous one, and the tensor
is cut into N equal chunks (zeronb.shards). One step moves one chunk along every link at once.

reduce-scatter, N-1 steps: at step s rank r sends chunk (r-s-1) mod N and receives chunk
    (r-s-2) mod N, which it adds to its own copy. Each chunk travels round the circle collecting
    one term per rank; the last addition, at step N-2, lands chunk r on rank r, complete.
all-gather, N-1 steps: at step s rank r sends chunk (r-s) mod N - its own at step 0, then the one
    it just received - and stores chunk (r-s-1) mod N. After N-1 steps every rank has every chunk.
all-reduce = reduce-scatter + all-gather.

Each rank sends N-1 chunks per pass, (N-1)/N of the tensor, whatever N is: 2(N-1)/N*S for an
all-reduce. The ranks together must send at least 2(N-1)*S, so that is the least the busiest rank
of any algorithm sends (the bandwidth-optimal bound), and it is why rings scale: the bytes per rank
do not grow with N (the number of steps, and so the latency, does).

Across nodes, `hierarchical_all_reduce` runs three rings: within each node, across the nodes on a
shard, within each node again; most bytes stay on the fast links inside the nodes.

Three details that matter in practice:
- A step's send and receive are issued together (`batch_isend_irecv`). A rank that first
  *sends* and only then receives waits for its neighbour to receive, who waits for its neighbour,
  all round the circle: a deadlock. On gloo it happens at any size (a send writes nothing until
  the receiver has posted its receive); libraries that buffer small messages hang only above some
  size. Chapter 4 shows it.
- For the same reason, on gloo a receive is posted two steps ahead: the neighbour's next send
  starts the moment it is issued, instead of waiting for this rank to get round to it.
- Chunks are cut into segments, and a segment is forwarded as soon as it has arrived (and been
  added): the addition overlaps the transfer of the next segment, and the next step starts before
  this one has finished - a pipeline, as NCCL does it.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from . import ledger
from .backend import backend_for
from .compat import all_gather_single
from .shards import bounds, chunk_size, padded_numel, shard_numel

SEGMENT_BYTES = 2 << 20  # pipeline granularity: small enough to overlap, big enough to amortise a send
                         # (python -m zeronb.bench collectives --segment-bytes ... to try others)


def _world(group=None) -> tuple[int, int]:
    """(this rank's place, the number of ranks) in `group` (None: every rank)."""
    if not dist.is_initialized():
        raise RuntimeError("no process group: call this inside a rank (zeronb.run, %%ranks, or torchrun)")
    return dist.get_rank(group), dist.get_world_size(group)


def _peer(group, group_rank: int) -> int:
    """The global rank of the rank at `group_rank` in `group`: what send and receive address."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _check_same(numel: int, dtype: torch.dtype, device, what: str, group=None) -> None:
    """Every rank must pass the same size and dtype, or a ring would hang waiting for bytes that
    never come. Every rank learns the smallest and largest (numel, dtype) over all ranks, so that
    *every* rank sees a mismatch and raises (and the group stays usable)."""
    rank, n = _world(group)
    code = list(_DTYPES).index(dtype) if dtype in _DTYPES else -1
    mine = torch.tensor([numel, code], dtype=torch.int64, device=device)
    with ledger.muted():  # bookkeeping, not part of the algorithm's traffic
        top = _max_over_ranks(torch.cat([mine, -mine]), group)  # the largest values, and minus the smallest
        if torch.equal(top[:2], -top[2:]):
            return
        everyone = torch.empty(2 * n, dtype=torch.int64, device=device)  # a mismatch: say who differs
        all_gather_single(everyone, mine, group=group)
    listing = ", ".join(f"rank {r}: {p[0]} x {_DTYPES[p[1]] if p[1] >= 0 else '?'}"
                        for r, p in enumerate(everyone.view(n, 2).tolist()))
    raise ValueError(f"{what}: every rank must pass the same number of elements and dtype; got {listing}")


def _max_over_ranks(values: torch.Tensor, group=None) -> torch.Tensor:
    """Element-wise max over all ranks of a few numbers, by recursive doubling: in round j every rank
    sends what it knows to rank r + 2^j and keeps the max with what rank r - 2^j sent, so after
    ceil(log2 N) rounds each has heard from all. A check on every call must be cheap: this is
    ~1 ms on 4 ranks here, against ~3.5 ms for a tiny all_gather (gloo)."""
    rank, n = _world(group)
    hop = 1
    while hop < n:
        heard = torch.empty_like(values)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, values, _peer(group, (rank + hop) % n), group),
                                            dist.P2POp(dist.irecv, heard, _peer(group, (rank - hop) % n), group)]):
            work.wait()
        values = torch.maximum(values, heard)
        hop *= 2
    return values


_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32,
           torch.int8, torch.uint8]


_kept: dict = {}  # dtype -> this rank's scratch memory (CPU), kept from call to call


def _scratch(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    """A (rows, cols) buffer for partial sums in transit, kept from call to call, as NCCL keeps its
    buffers. A fresh one each call costs more than it seems: the allocator hands a block this large
    back to the OS when it is freed, and the next call takes a page fault on every 4 KiB it touches
    (about a thousand per 16 MiB all-reduce on 4 ranks; python -m zeronb.bench collectives)."""
    if like.device.type != "cpu":  # a GPU's caching allocator already keeps freed blocks for reuse
        return torch.empty(rows, cols, dtype=like.dtype, device=like.device)
    key, need = like.dtype, rows * cols
    if key not in _kept or _kept[key].numel() < need:
        _kept[key] = torch.empty(need, dtype=like.dtype, device=like.device)
    return _kept[key][:need].view(rows, cols)


def _segments(chunk_numel: int, element_size: int, segment_bytes: int) -> list[tuple[int, int]]:
    per = max(1, segment_bytes // element_size)
    return [(a, min(a + per, chunk_numel)) for a in range(0, chunk_numel, per)]


class _Step(NamedTuple):
    """One step of a ring, for this rank: send `send` to the next rank, receive into `recv` from the
    previous one; then, in a reduce step, `out = add_to + recv` (divided by `divide` if set)."""
    phase: str
    send: torch.Tensor
    recv: torch.Tensor
    send_chunk: int
    recv_chunk: int
    add_to: Optional[torch.Tensor] = None
    out: Optional[torch.Tensor] = None
    divide: int = 0


def _reduce_scatter_steps(rank, n, src, dst, scratch, acc, out_shard, average):
    """The N-1 steps of a ring reduce-scatter: rank r sends chunk (r-s-1) and receives chunk (r-s-2)
    at step s, adding its own copy of that chunk to what arrived, and ends with chunk r complete.

    src: the N input chunks (read); scratch: two chunk-sized buffers that incoming partial sums land
    in, used in turn (so step s+1's receive can be posted while step s's is still being added).
    In place (dst is src): the sums overwrite the input. Out of place: they go to the two `acc`
    buffers in turn, and the last one to `out_shard` - no copy of the whole input is ever made."""
    steps = []
    for s in range(n - 1):
        send_c, recv_c = (rank - s - 1) % n, (rank - s - 2) % n
        last = s == n - 2
        if dst is not None:
            out = dst[recv_c]
        else:
            out = out_shard if last else acc[s % 2]
        send = src[send_c] if s == 0 else steps[-1].out  # forward what was just summed
        steps.append(_Step("reduce-scatter", send, scratch[s % 2], send_c, recv_c, add_to=src[recv_c], out=out,
                           divide=n if (last and average) else 0))
    return steps


def _all_gather_steps(rank, n, chunks):
    """The N-1 steps of a ring all-gather: rank r sends chunk (r-s) - its own first, then each one it
    has just received - and stores chunk (r-s-1) at step s."""
    return [_Step("all-gather", chunks[(rank - s) % n], chunks[(rank - s - 1) % n], (rank - s) % n,
                  (rank - s - 1) % n) for s in range(n - 1)]


def _receives_ahead(tensor: torch.Tensor) -> int:
    """How many steps ahead a receive is posted. gloo moves no byte of a send until the receiver has
    posted the receive, so a receive posted late stalls the sender, and the stall travels round the
    ring: post it two steps ahead, as soon as its buffer is free. NCCL runs a rank's sends and
    receives to one peer in order on one stream, so a receive posted ahead of the send it must
    follow would wait for itself (with 2 ranks the next and previous rank are the same peer): there
    each step's send and receive go out together, one group, and the GPU queues them anyway.
    (In an NCCL pool, CPU tensors still go over gloo: what counts is the tensor's backend.)"""
    return 2 if backend_for(tensor) == "gloo" else 1


def _run_ring(steps, op: str, segment_bytes: int, group=None) -> None:
    """Run the steps as a pipeline: each chunk is cut into segments, and a segment is forwarded
    (step i+1's send) as soon as it has arrived and been added (step i), while later segments are
    still on the wire. Receives are posted `_receives_ahead(...)` steps early.

    Messages between two ranks match in the order they are posted, so sends and receives are both
    posted step by step, segment by segment. A buffer is written only once the send that read it
    has finished: step i's send is waited for before step i+2's receive is posted. (One case needs
    an argument rather than a wait: with 2 ranks, the first all-gather receive lands in the chunk
    the first reduce-scatter step sent. The neighbour fills it with a sum it can only finish after
    it has received every byte of that send.)"""
    if not steps or steps[0].recv.numel() == 0:
        return
    rank, n = _world(group)
    nxt, prv = _peer(group, (rank + 1) % n), _peer(group, (rank - 1) % n)  # (global ranks)
    me = _peer(group, rank)
    segments = _segments(steps[0].recv.numel(), steps[0].recv.element_size(), segment_bytes)
    ahead = _receives_ahead(steps[0].recv)
    trace = ledger.recording()
    started, sends, recvs = {}, {}, {}

    def post(k, send_step=None, recv_step=None):
        """Post segment k of one step's send and/or one step's receive, together."""
        a, b = segments[k]
        ops = []
        if recv_step is not None:
            ops.append(dist.P2POp(dist.irecv, steps[recv_step].recv[a:b], prv, group))
        if send_step is not None:
            if trace and send_step not in started:
                started[send_step] = ledger.now(steps[send_step].send.device)
            ops.append(dist.P2POp(dist.isend, steps[send_step].send[a:b], nxt, group))
        works = dist.batch_isend_irecv(ops)
        if recv_step is not None:
            recvs[recv_step, k] = works[0]
        if send_step is not None:
            sends[send_step, k] = works[-1]

    for k in range(len(segments)):
        post(k, send_step=0, recv_step=0)
    for j in range(1, min(ahead, len(steps))):
        for k in range(len(segments)):
            post(k, recv_step=j)
    for i, step in enumerate(steps):
        for k, (a, b) in enumerate(segments):
            recvs.pop((i, k)).wait()
            if step.add_to is not None:  # the reduction, on this segment only
                torch.add(step.add_to[a:b], step.recv[a:b], out=step.out[a:b])
                if step.divide:
                    step.out[a:b].div_(step.divide)
            later = i + ahead if i + ahead < len(steps) else None
            if ahead == 1:  # NCCL: this step's send and receive are done, the next go out together
                sends.pop((i, k)).wait()
                if later is not None:
                    post(k, send_step=later, recv_step=later)
                continue
            if i + 1 < len(steps):
                post(k, send_step=i + 1)  # forward the segment at once
            if later is not None:
                sends.pop((i, k)).wait()  # its buffer may be the next receive's (a work is waited for once)
                post(k, recv_step=later)
        if trace:
            in_phase = sum(1 for earlier in steps[:i] if earlier.phase == step.phase)  # steps restart per phase
            nbytes, end = step.recv.numel() * step.recv.element_size(), ledger.now(step.recv.device)
            common = dict(op=op, phase=step.phase, step=in_phase, bytes=nbytes, start=started[i], end=end)
            ledger.record(kind="send", src=me, dst=nxt, chunk=step.send_chunk, **common)
            ledger.record(kind="recv", src=prv, dst=me, chunk=step.recv_chunk, **common)
    for work in sends.values():
        work.wait()


def _flat_chunks(tensor: torch.Tensor, n: int, writable: bool) -> torch.Tensor:
    """The tensor as N equal chunks (an (N, chunk) view). A view of the tensor itself when its
    size divides evenly; otherwise a zero-padded copy (zeronb.shards' padding rule)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() % n == 0 and (flat.data_ptr() == tensor.data_ptr() or not writable):
        return flat.view(n, -1)
    buf = torch.zeros(padded_numel(flat.numel(), n), dtype=flat.dtype, device=flat.device)
    buf[:flat.numel()] = flat
    return buf.view(n, -1)


def _check_float(tensor: torch.Tensor, what: str, average: bool) -> None:
    if average and not tensor.is_floating_point():
        raise TypeError(f"{what}(average=True) needs a floating-point tensor, not {tensor.dtype}")


def ring_reduce_scatter(tensor: torch.Tensor, *, average: bool = False, group=None,
                        segment_bytes: int = SEGMENT_BYTES) -> torch.Tensor:
    """This rank's shard (zeronb.shards.bounds) of the element-wise sum over the ranks of `group`
    (None: all ranks) of `tensor` (of any shape, read flat). `average=True` divides by the number
    of ranks. `tensor` is not changed."""
    _check_float(tensor, "ring_reduce_scatter", average)
    rank, n = _world(group)
    _check_same(tensor.numel(), tensor.dtype, tensor.device, "ring_reduce_scatter", group)
    src = _flat_chunks(tensor, n, writable=False)
    shard = src[rank].clone()  # world size 1: the sum of one tensor is itself
    if n > 1:
        scratch, acc = _scratch(4, src.shape[1], src).split(2)
        with ledger.scope("ring_reduce_scatter"):
            _run_ring(_reduce_scatter_steps(rank, n, src, None, scratch, acc, shard, average),
                      "ring_reduce_scatter", segment_bytes, group)
    start, stop = bounds(tensor.numel(), n, rank)
    return shard[:stop - start]


def ring_all_gather(shard: torch.Tensor, numel: int, *, group=None,
                    segment_bytes: int = SEGMENT_BYTES) -> torch.Tensor:
    """The full flat tensor of `numel` elements, from the shards (zeronb.shards.bounds) of every
    rank of `group` (None: all ranks)."""
    rank, n = _world(group)
    want = shard_numel(numel, n, rank)
    if shard.numel() != want:
        raise ValueError(f"ring_all_gather on rank {rank}: a tensor of {numel} elements over {n} ranks gives "
                         f"rank {rank} a shard of {want} elements (zeronb.shards.bounds), not {shard.numel()}")
    _check_same(numel, shard.dtype, shard.device, "ring_all_gather", group)
    c = chunk_size(numel, n)
    chunks = torch.empty(n, c, dtype=shard.dtype, device=shard.device)  # every chunk gets written
    chunks[rank, :want] = shard.reshape(-1)
    chunks[rank, want:] = 0  # this rank's padding (the others' arrives with their chunks)
    with ledger.scope("ring_all_gather"):
        _run_ring(_all_gather_steps(rank, n, chunks), "ring_all_gather", segment_bytes, group)
    return chunks.view(-1)[:numel]


def ring_all_reduce(tensor: torch.Tensor, *, average: bool = False, group=None,
                    segment_bytes: int = SEGMENT_BYTES) -> torch.Tensor:
    """In place: `tensor` becomes the element-wise sum (or average) over the ranks of `group`
    (None: all ranks). Returns it.
    A reduce-scatter then an all-gather, run as one pipeline: a segment of this rank's chunk sets
    off on the all-gather as soon as its sum is complete."""
    _check_float(tensor, "ring_all_reduce", average)
    rank, n = _world(group)
    _check_same(tensor.numel(), tensor.dtype, tensor.device, "ring_all_reduce", group)
    if n == 1 or tensor.numel() == 0:
        return tensor
    chunks = _flat_chunks(tensor, n, writable=True)
    scratch = _scratch(2, chunks.shape[1], chunks)
    with ledger.scope("ring_all_reduce"):
        steps = (_reduce_scatter_steps(rank, n, chunks, chunks, scratch, None, None, average)
                 + _all_gather_steps(rank, n, chunks))
        _run_ring(steps, "ring_all_reduce", segment_bytes, group)
    if chunks.data_ptr() != tensor.data_ptr():  # worked on a padded copy
        tensor.copy_(chunks.view(-1)[:tensor.numel()].view_as(tensor))
    return tensor


def hierarchical_all_reduce(tensor: torch.Tensor, *, average: bool = False, groups=None) -> torch.Tensor:
    """In place: `tensor` becomes the element-wise sum (or average) over all ranks, in three hops
    that keep most of the bytes inside the nodes (zeronb.nodes; Horovod's hierarchical all-reduce,
    after Thakur et al.): a ring reduce-scatter within this rank's node leaves it 1/g of the node's
    sum (g ranks per node); a ring all-reduce of that shard across the k nodes, among the ranks with
    the same local rank, makes it the shard of the total; a ring all-gather within the node hands
    every rank all of it. Each rank sends 2(g-1)/g * S within its node and 2(k-1)/k * S/g across,
    where a flat ring sends 2(N-1)/N * S, and on some links all of it, across. Returns `tensor`.

    `groups`: (within, across) process groups to use in place of the pool's nodes (zeronb.nodes.
    node_groups()), for instance groups that assume another placement of the ranks on the nodes."""
    from .nodes import Topology, node_groups

    _check_float(tensor, "hierarchical_all_reduce", average)
    topology = Topology.from_env()
    if groups is None and (topology.nodes == 1 or topology.per_node == 1):  # one level only: one ring
        return ring_all_reduce(tensor, average=average)
    within, across = groups or node_groups()
    flat = tensor.detach().reshape(-1)
    shard = ring_reduce_scatter(flat, group=within)   # 1. this rank's shard of its node's sum
    ring_all_reduce(shard, group=across)              # 2. + the same shard of every other node's
    full = ring_all_gather(shard, flat.numel(), group=within)  # 3. every shard, within the node
    if average:
        full.div_(dist.get_world_size())
    tensor.copy_(full.view_as(tensor))
    return tensor


# --- the naive versions, for comparison: everything goes through one rank ----------------------

def _reduce_to_root(flat: torch.Tensor, root: int) -> None:
    """Every rank's tensor to the root, which adds them into its own `flat` (in place)."""
    rank, n = _world()
    if rank == root:
        others = [r for r in range(n) if r != root]
        inbox = [torch.empty_like(flat) for _ in others]
        for w in [dist.irecv(buf, src) for buf, src in zip(inbox, others)]:
            w.wait()
        for buf in inbox:
            flat += buf
    elif n > 1:
        dist.send(flat, root)


def naive_all_reduce(tensor: torch.Tensor, *, root: int = 0) -> torch.Tensor:
    """In place, through one root: every rank sends its whole tensor to the root, which adds them
    up and sends the sum back to every rank. Correct, but the root sends (N-1)*S bytes and receives
    as much, while the others sit idle: its link is the bottleneck, and it gets worse with N."""
    rank, n = _world()
    _check_same(tensor.numel(), tensor.dtype, tensor.device, "naive_all_reduce")
    flat = tensor.detach().view(-1) if tensor.is_contiguous() else tensor.detach().reshape(-1).clone()
    with ledger.scope("naive_all_reduce"):
        _reduce_to_root(flat, root)
        if rank == root:
            for w in [dist.isend(flat, dst) for dst in range(n) if dst != root]:
                w.wait()
        elif n > 1:
            dist.recv(flat, root)
    if not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def naive_reduce_scatter(tensor: torch.Tensor, *, root: int = 0) -> torch.Tensor:
    """Through one root: all tensors to the root, which adds them and sends each rank its shard."""
    rank, n = _world()
    _check_same(tensor.numel(), tensor.dtype, tensor.device, "naive_reduce_scatter")
    total = tensor.detach().reshape(-1).clone()
    a, b = bounds(total.numel(), n, rank)
    with ledger.scope("naive_reduce_scatter"):
        _reduce_to_root(total, root)
        if rank == root:
            sends = []
            for dst in range(n):
                da, db = bounds(total.numel(), n, dst)
                if dst != root and db > da:  # a rank that owns nothing gets nothing
                    sends.append(dist.isend(total[da:db].clone(), dst))
            for w in sends:
                w.wait()
            return total[a:b].clone()
        shard = torch.empty(b - a, dtype=total.dtype, device=total.device)
        if b > a:
            dist.recv(shard, root)
        return shard


def naive_all_gather(shard: torch.Tensor, numel: int, *, root: int = 0) -> torch.Tensor:
    """Through one root: every shard to the root, which assembles the tensor and sends it to all."""
    rank, n = _world()
    _check_same(numel, shard.dtype, shard.device, "naive_all_gather")
    full = torch.empty(numel, dtype=shard.dtype, device=shard.device)
    a, b = bounds(numel, n, rank)
    full[a:b] = shard.reshape(-1)
    with ledger.scope("naive_all_gather"):
        if rank == root:
            recvs = []
            for src in range(n):
                if src != root:
                    sa, sb = bounds(numel, n, src)
                    if sb > sa:
                        recvs.append(dist.irecv(full[sa:sb], src))
            for w in recvs:
                w.wait()
            for w in [dist.isend(full, dst) for dst in range(n) if dst != root]:
                w.wait()
        elif n > 1:
            if b > a:
                dist.send(shard.reshape(-1).contiguous(), root)
            dist.recv(full, root)
    return full
