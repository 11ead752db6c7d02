"""The naive collectives, for comparison with the ring: everything goes through one rank, the root,
whose link carries (N-1) times the tensor each way while the others wait."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import ledger
from ..shards import bounds
from .checks import check_same, world


def _reduce_to_root(flat: torch.Tensor, root: int) -> None:
    """Every rank's tensor to the root, which adds them into its own `flat` (in place)."""
    rank, n = world()
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
    as much, while the others sit idle: its link is the bottleneck, and it gets worse with N.
    With N = 2 it sends the same bytes as a ring of two, but not the same way: S one way, then S
    back, each direction of the link idle half the time, where the ring sends S/2 both ways at
    once, twice."""
    rank, n = world()
    check_same(tensor.numel(), tensor.dtype, tensor.device, "naive_all_reduce")
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
    rank, n = world()
    check_same(tensor.numel(), tensor.dtype, tensor.device, "naive_reduce_scatter")
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
    rank, n = world()
    check_same(numel, shard.dtype, shard.device, "naive_all_gather")
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
