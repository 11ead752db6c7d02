"""Chapter 4, the ring: its check cells and their wrong worlds."""
from __future__ import annotations

from ..planting import replace, when_imported
from . import chapter, world


# --- chapter 4: the ring ---------------------------------------------------------------------------------

chapter("04_ring", {
    "by-hand-ring": "the trace replayed predicts every number the by-hand ring printed; both rings sum right",
    "traces": "every send has its receive, N-1 steps per phase, each send carries the chunk and sum the rule says",
    "bytes": "the ring sends exactly 2(N-1)/N S per rank, in 2(N-1) sends; the built-in is credited the same",
    "correctness": "the ring all-reduce and reduce-scatter equal the built-in; gloo's is the mirrored ring",
    "timeline": "the 16 MiB run sums right, and a step starts while the one before is still arriving",
    "deadlock": "on gloo a ring that sends first deadlocks (a send waits for its receive); both fixes deliver",
})


def _forwards_the_wrong_chunk():
    """At each all-gather step after the first, the ring sends the chunk it sent the step before, while
    its trace names the chunk the rule says (as the issue's reader planted it)."""
    def all_gather_steps(original):
        def wrong(rank, n, chunks):
            return [st._replace(send=chunks[(rank - s + 1) % n]) if s else st
                    for s, st in enumerate(original(rank, n, chunks))]
        return wrong
    replace("zeronb.collectives.ring", "_all_gather_steps", all_gather_steps)


world("04_ring", "a ring that forwards the wrong chunk", "each send carries the chunk its trace names: here the "
      "all-gather forwards the chunk it sent the step before", ("by-hand-ring", "traces", "correctness"),
      _forwards_the_wrong_chunk)


def _one_segment_per_chunk():
    replace("zeronb.collectives.ring", "_segments",
            lambda original: lambda chunk_numel, element_size, segment_bytes: [(0, chunk_numel)])


world("04_ring", "a ring that does not pipeline", "a step starts while the one before is still arriving: here "
      "each chunk travels as one message, forwarded once all of it has arrived", "timeline", _one_segment_per_chunk)


def _ring_sends_twice():
    """Every segment of the ring goes out twice, as two messages (the second adds its data again where the
    reduce-scatter works in place): twice the bytes."""
    replace("zeronb.collectives.ring", "_segments",
            lambda original: lambda *args: [seg for seg in original(*args) for _ in range(2)])


world("04_ring", "a ring that sends every message twice", "each rank sends 2(N-1)/N S: here every segment of the "
      "ring goes out twice", "bytes", _ring_sends_twice)


def _send_returns_at_once():
    """dist.send returns as soon as it is posted, as a library that buffers messages does."""
    def patch(dist):
        isend, posted = dist.isend, []

        def send(tensor, dst=None, group=None, tag=0, **kw):
            posted.append(isend(tensor, dst, group=group, tag=tag))
        dist.send = send
    when_imported("torch.distributed", patch)


world("04_ring", "a send that returns before its receive is posted", "on gloo a send waits for the receiver: here "
      "it returns at once, as a buffering library's does", "deadlock", _send_returns_at_once)
