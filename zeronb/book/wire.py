"""What a call puts on the wire beyond what the ledger credits it, measured, and the bytes a run's calls
should then put there: the one place the chapters (6, 9, 12) predict the operating system's count
from the ledger's, byte for byte, instead of judging it by "more than the credit".

    cost = zeronb.run(cost_per_call)[0]       # on the ranks: {"all_reduce", "all_gather", "send", "size check"}
    predicted(report.sent_bytes_per_step, report.calls_per_step, cost, N)

gloo frames each message it sends (the OS counts those headers), runs a reduce-scatter as a whole
all-reduce (twice a real reduce-scatter's bytes; zeronb.ledger's docstring), and zeronb's ring runs a
size check before it moves anything (collectives.checks.check_same, muted in the ledger). For small
tensors the framing is a fixed number of bytes per call; it grows with the number of messages, so
measure it at the size of the run's calls. Under NCCL the OS counts nothing: `cost_per_call` gives None.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..collectives.checks import check_same
from ..ledger import WireMeter, ring_bytes
from ..runtime.backend import backend_for
from ..runtime.compat import all_gather_single


def cost_per_call(numel_per_rank: int = 1024, dtype=torch.float64) -> dict | None:
    """Inside a rank: the bytes one call of each kind, alone on the ranks, puts on the wire beyond its
    payload - gloo's all-reduce and all-gather of a tensor of `numel_per_rank` x N elements (beyond a
    ring's bytes for them), one send of `numel_per_rank` to the next rank as a ring step does, and
    zeronb's size check. None where the wire is not counted (NCCL)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    t = torch.zeros(numel_per_rank * n, dtype=dtype)
    if backend_for(t) != "gloo":
        return None
    size = t.element_size()

    def on_the_wire(call):
        dist.barrier()
        with WireMeter() as meter:
            call()
        return meter.bytes

    def one_send():  # to the next rank, from the previous one, as a ring step does
        payload, arriving = t[:numel_per_rank].clone(), torch.empty(numel_per_rank, dtype=dtype)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, payload, (rank + 1) % n),
                                            dist.P2POp(dist.irecv, arriving, (rank - 1) % n)]):
            work.wait()

    return {"all_reduce": on_the_wire(lambda: dist.all_reduce(t.clone())) - ring_bytes("all_reduce", t.numel() * size, n, size),
            "all_gather": on_the_wire(lambda: all_gather_single(torch.empty_like(t), t[:numel_per_rank].clone()))
                          - ring_bytes("all_gather", t.numel() * size, n, size),
            "send": on_the_wire(one_send) - numel_per_rank * size,
            "size check": on_the_wire(lambda: check_same(t.numel(), t.dtype, t.device, "a check"))}


def predicted(sent: dict, calls: dict, cost: dict, world_size: int) -> int:
    """The bytes a rank's calls put on the gloo wire: the ledger's credit (`sent`: bytes by op, `calls`:
    calls by op, as a RankReport's *_per_step), a gloo reduce-scatter at an all-reduce's bytes (twice its
    credit) and framing, plus each call's cost beyond its payload (`cost_per_call`); zeronb's ring
    reduce-scatter as its sends (N - 1 a call) and one size check a call."""
    ring_sends = calls.get("ring_reduce_scatter", 0)
    return (sent.get("all_reduce", 0) + sent.get("all_gather", 0) + 2 * sent.get("reduce_scatter", 0)
            + sent.get("ring_reduce_scatter", 0)
            + (calls.get("all_reduce", 0) + calls.get("reduce_scatter", 0)) * cost["all_reduce"]
            + calls.get("all_gather", 0) * cost["all_gather"] + ring_sends * cost["send"]
            + ring_sends // (world_size - 1) * cost["size check"])
