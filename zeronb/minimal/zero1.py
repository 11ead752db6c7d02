"""ZeRO-1, the minimal version: the optimizer state sharded.

Every rank holds all the parameters and, after backward, all the gradients; but rank r keeps the
optimizer's state only for its shard, chunk r of the parameters laid out flat. One step:

1. forward and backward, as in DDP: full gradients on every rank (in one flat buffer);
2. reduce-scatter the gradients: rank r receives the sum of everyone's chunk r, the only gradient
   its optimizer needs;
3. the optimizer on this rank's shard only;
4. all-gather the updated shards, so that every rank has all the new parameters again.

A reduce-scatter and an all-gather send exactly the bytes of one all-reduce (an all-reduce is the
two of them): the optimizer memory is saved for free in bandwidth.

The full version (zeronb.zero.zero1.ZeRO1) adds gradient accumulation, a reduce dtype, replicas
(HSDP), mixed precision's master weights and observers (chapter 8).
"""
import torch
import torch.distributed as dist

from ..runtime.compat import all_gather_single, reduce_scatter_single


def flatten_into(params: list, flat: torch.Tensor) -> None:
    """Copy the parameters into `flat`, one after another, and make each a view into it: from
    now on the parameters live in `flat`. (Set through `.data`, each parameter keeps a version
    counter of its own: a collective that writes into `flat` between forward and backward does not
    count as an in-place change of the weights autograd saved, chapter 10.)"""
    offset = 0
    for p in params:
        flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()


def padded(numel: int, n: int) -> int:
    """`numel` rounded up to a multiple of n: N equal chunks (chapter 2)."""
    return -(-numel // n) * n


class ZeRO1:
    def __init__(self, model: torch.nn.Module, optimizer):
        rank, self.world_size = dist.get_rank(), dist.get_world_size()
        params = [p for p in model.parameters() if p.requires_grad]
        first = params[0]
        size = padded(sum(p.numel() for p in params), self.world_size)
        self.flat = torch.zeros(size, dtype=first.dtype, device=first.device)
        flatten_into(params, self.flat)
        # 1. the full gradients in one flat buffer too: each .grad a view, which autograd adds into
        self.grad = torch.zeros_like(self.flat)
        offset = 0
        for p in params:
            p.grad = self.grad[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        c = size // self.world_size
        # the parameters this rank updates: its chunk (its shard, and any padding), a view into `flat`
        self.chunk = self.flat[rank * c:(rank + 1) * c]
        self.optimizer = optimizer([self.chunk])          # and the only ones it keeps state for

    def step(self) -> None:
        # 2. rank r gets the sum of everyone's chunk r (each divided by N first: the average)
        self.chunk.grad = torch.empty_like(self.chunk)
        reduce_scatter_single(self.chunk.grad, self.grad.div_(self.world_size))
        self.grad.zero_()
        # 3. the optimizer on the shard
        self.optimizer.step()
        self.chunk.grad = None  # (between steps a rank holds no gradient shard)
        # 4. every rank's updated shard into the full parameters; the input is a copy, not a view of
        # the output the collective writes
        all_gather_single(self.flat, self.chunk.clone())
