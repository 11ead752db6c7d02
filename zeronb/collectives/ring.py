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

Each rank sends N-1 chunks per pass, (N-1)/N of the tensor: 2(N-1)/N*S for an all-reduce. When the
ranks do the adding they must together send at least 2(N-1)*S, so that is the least the busiest
rank of any algorithm sends (the bandwidth-optimal bound). It is why rings scale in bytes: the bytes
per rank grow with N but stay bounded, from S at N = 2 towards 2S (1.5 S at 4 ranks, 1.75 S at 8),
while the number of steps, 2(N-1), and so the latency, grows linearly (chapter 5).

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
  this one has finished - a pipeline, as NCCL does it. A chunk no longer than one segment
  (`segment_bytes`, SEGMENT_BYTES by default) is one message per step and pipelines nothing. The
  segment size is a knob: it never changes the bytes, only the messages, 2(N-1) * ceil(chunk /
  segment) per rank for an all-reduce; smaller segments overlap more and pay a fixed cost for each
  message. Chapter 5 measures both. NCCL's counterparts are the size of the buffers it stages
  chunks through (NCCL_BUFFSIZE) and its protocols (NCCL_PROTO: LL, LL128, Simple).

The pipeline sends and receives through a `Link`; when a ledger records, the ledger wraps that link
to trace what each step did (zeronb.ledger.traced_link, chapter 4's pictures), so the pipeline
holds no bookkeeping of its own. The ring as a learner would first write it, without segments or a
pipeline, is zeronb.minimal.ring.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from .. import ledger
from ..runtime.backend import backend_for
from ..shards import bounds, chunk_size, padded_numel, shard_numel
from .checks import check_float, check_same, peer, world

SEGMENT_BYTES = 2 << 20  # pipeline granularity: small enough to overlap, big enough to amortise a send
                         # (python -m zeronb.bench collectives --segment-bytes ... to try others)


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


class Link:
    """This rank's messages round the ring: segment k of a step's send to the next rank and of a
    step's receive from the previous one, posted together (`batch_isend_irecv`), and waited for.
    The pipeline talks to the ring only through these calls; a tracer wraps them from
    outside (zeronb.ledger.TracedLink)."""

    def __init__(self, steps, segments, group):
        rank, n = world(group)
        self.steps, self.segments, self.group = steps, segments, group
        self.nxt, self.prv = peer(group, (rank + 1) % n), peer(group, (rank - 1) % n)  # (global ranks)
        self.sends, self.recvs = {}, {}  # (step, segment) -> its work, until waited for

    def post(self, k, send_step=None, recv_step=None) -> None:
        """Post segment k of one step's send and/or one step's receive, together."""
        a, b = self.segments[k]
        ops = []
        if recv_step is not None:
            ops.append(dist.P2POp(dist.irecv, self.steps[recv_step].recv[a:b], self.prv, self.group))
        if send_step is not None:
            ops.append(dist.P2POp(dist.isend, self.steps[send_step].send[a:b], self.nxt, self.group))
        works = dist.batch_isend_irecv(ops)
        if recv_step is not None:
            self.recvs[recv_step, k] = works[0]
        if send_step is not None:
            self.sends[send_step, k] = works[-1]

    def received(self, i, k) -> None:
        """Wait until segment k of step i has arrived."""
        self.recvs.pop((i, k)).wait()

    def sent(self, i, k) -> None:
        """Wait until segment k of step i has left (its buffer may be written again)."""
        self.sends.pop((i, k)).wait()

    def all_sent(self) -> None:
        for work in self.sends.values():
            work.wait()


def _run_ring(steps, link: Link) -> None:
    """Run the steps as a pipeline: each chunk is cut into segments, and a segment is forwarded
    (step i+1's send) as soon as it has arrived and been added (step i), while later segments are
    still on the wire. Receives are posted `_receives_ahead(...)` steps early.

    Messages between two ranks match in the order they are posted, so sends and receives are both
    posted step by step, segment by segment. A buffer is written only once the send that read it
    has finished: step i's send is waited for before step i+2's receive is posted. (One case needs
    an argument rather than a wait: with 2 ranks, the first all-gather receive lands in the chunk
    the first reduce-scatter step sent. The neighbour fills it with a sum it can only finish after
    it has received every byte of that send.)"""
    segments = link.segments
    ahead = _receives_ahead(steps[0].recv)
    for k in range(len(segments)):
        link.post(k, send_step=0, recv_step=0)
    for j in range(1, min(ahead, len(steps))):
        for k in range(len(segments)):
            link.post(k, recv_step=j)
    for i, step in enumerate(steps):
        for k, (a, b) in enumerate(segments):
            link.received(i, k)
            if step.add_to is not None:  # the reduction, on this segment only
                torch.add(step.add_to[a:b], step.recv[a:b], out=step.out[a:b])
                if step.divide:
                    step.out[a:b].div_(step.divide)
            later = i + ahead if i + ahead < len(steps) else None
            if ahead == 1:  # NCCL: this step's send and receive are done, the next go out together
                link.sent(i, k)
                if later is not None:
                    link.post(k, send_step=later, recv_step=later)
                continue
            if i + 1 < len(steps):
                link.post(k, send_step=i + 1)  # forward the segment at once
            if later is not None:
                link.sent(i, k)  # its buffer may be the next receive's (a work is waited for once)
                link.post(k, recv_step=later)
    link.all_sent()


def _ring(op: str, steps, segment_bytes: int, group) -> None:
    """Run a ring collective's steps on this rank, through a link the ledger traces when it records
    (zeronb.ledger.traced_link: chapter 4's pictures)."""
    if not steps or steps[0].recv.numel() == 0:
        return
    segments = _segments(steps[0].recv.numel(), steps[0].recv.element_size(), segment_bytes)
    rank, _ = world(group)
    with ledger.scope(op):
        _run_ring(steps, ledger.traced_link(Link(steps, segments, group), op, peer(group, rank)))


def _flat_chunks(tensor: torch.Tensor, n: int, writable: bool) -> torch.Tensor:
    """The tensor as N equal chunks (an (N, chunk) view). A view of the tensor itself when its
    size divides evenly; otherwise a zero-padded copy (zeronb.shards' padding rule)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() % n == 0 and (flat.data_ptr() == tensor.data_ptr() or not writable):
        return flat.view(n, -1)
    buf = torch.zeros(padded_numel(flat.numel(), n), dtype=flat.dtype, device=flat.device)
    buf[:flat.numel()] = flat
    return buf.view(n, -1)


def ring_reduce_scatter(tensor: torch.Tensor, *, average: bool = False, group=None,
                        segment_bytes: int = SEGMENT_BYTES) -> torch.Tensor:
    """This rank's shard (zeronb.shards.bounds) of the element-wise sum over the ranks of `group`
    (None: all ranks) of `tensor` (of any shape, read flat). `average=True` divides by the number
    of ranks. `tensor` is not changed. `segment_bytes`: the largest message; a chunk is sent in
    pieces of at most this size (the bytes sent do not depend on it, the number of messages does)."""
    check_float(tensor, "ring_reduce_scatter", average)
    rank, n = world(group)
    check_same(tensor.numel(), tensor.dtype, tensor.device, "ring_reduce_scatter", group)
    src = _flat_chunks(tensor, n, writable=False)
    shard = src[rank].clone()  # world size 1: the sum of one tensor is itself
    if n > 1:
        scratch, acc = _scratch(4, src.shape[1], src).split(2)
        _ring("ring_reduce_scatter", _reduce_scatter_steps(rank, n, src, None, scratch, acc, shard, average),
              segment_bytes, group)
    start, stop = bounds(tensor.numel(), n, rank)
    return shard[:stop - start]


def ring_all_gather(shard: torch.Tensor, numel: int, *, group=None,
                    segment_bytes: int = SEGMENT_BYTES) -> torch.Tensor:
    """The full flat tensor of `numel` elements, from the shards (zeronb.shards.bounds) of every
    rank of `group` (None: all ranks). `segment_bytes`: as in ring_reduce_scatter."""
    rank, n = world(group)
    want = shard_numel(numel, n, rank)
    if shard.numel() != want:
        raise ValueError(f"ring_all_gather on rank {rank}: a tensor of {numel} elements over {n} ranks gives "
                         f"rank {rank} a shard of {want} elements (zeronb.shards.bounds), not {shard.numel()}")
    check_same(numel, shard.dtype, shard.device, "ring_all_gather", group)
    c = chunk_size(numel, n)
    chunks = torch.empty(n, c, dtype=shard.dtype, device=shard.device)  # every chunk gets written
    chunks[rank, :want] = shard.reshape(-1)
    chunks[rank, want:] = 0  # this rank's padding (the others' arrives with their chunks)
    _ring("ring_all_gather", _all_gather_steps(rank, n, chunks), segment_bytes, group)
    return chunks.view(-1)[:numel]


def ring_all_reduce(tensor: torch.Tensor, *, average: bool = False, group=None,
                    segment_bytes: int = SEGMENT_BYTES) -> torch.Tensor:
    """In place: `tensor` becomes the element-wise sum (or average) over the ranks of `group`
    (None: all ranks). Returns it.
    A reduce-scatter then an all-gather, run as one pipeline: a segment of this rank's chunk sets
    off on the all-gather as soon as its sum is complete. `segment_bytes`: as in
    ring_reduce_scatter; each rank sends 2(N-1) * ceil(chunk / segment_bytes) messages."""
    check_float(tensor, "ring_all_reduce", average)
    rank, n = world(group)
    check_same(tensor.numel(), tensor.dtype, tensor.device, "ring_all_reduce", group)
    if n == 1 or tensor.numel() == 0:
        return tensor
    chunks = _flat_chunks(tensor, n, writable=True)
    scratch = _scratch(2, chunks.shape[1], chunks)
    steps = (_reduce_scatter_steps(rank, n, chunks, chunks, scratch, None, None, average)
             + _all_gather_steps(rank, n, chunks))
    _ring("ring_all_reduce", steps, segment_bytes, group)
    if chunks.data_ptr() != tensor.data_ptr():  # worked on a padded copy
        tensor.copy_(chunks.view(-1)[:tensor.numel()].view_as(tensor))
    return tensor
