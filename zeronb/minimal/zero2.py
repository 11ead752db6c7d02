"""ZeRO-2, the minimal version: the gradients sharded too, bucket by bucket during backward.

In ZeRO-1 every rank holds all the gradients after backward, although its optimizer needs only
chunk r of them. ZeRO-2 never keeps the rest. The parameters are grouped into buckets (as DDP's
are), each laid out flat and padded to N equal chunks. The moment backward has produced a bucket's
last gradient, a hook reduce-scatters the bucket - rank r keeps the sum of its chunk - and drops its
full gradients; then backward goes on with earlier layers. After backward a rank holds only its
gradient shards. The step is ZeRO-1's: the optimizer on the shards, then an all-gather of each
bucket's parameters.

The reduce-scatter here is synchronous: backward waits for it. (An asynchronous one would hold
the bucket's full gradients until it has arrived.)

The full version (zeronb.zero.zero2.ZeRO2) adds gradient accumulation, a reduce dtype, a gradient
shard in another dtype, zeronb's own ring as the reduce-scatter, replicas and observers (chapter 9).
"""
import torch
import torch.distributed as dist

from ..runtime.compat import all_gather_single, reduce_scatter_single
from .ddp import backward_order_buckets
from .zero1 import flatten_into, padded


class Bucket:
    """Some parameters laid out in one flat tensor of N equal chunks, and this rank's shard of their
    summed gradients."""

    def __init__(self, params: list, rank: int, n: int):
        self.params = params
        first = params[0]
        self.flat = torch.zeros(padded(sum(p.numel() for p in params), n), dtype=first.dtype, device=first.device)
        flatten_into(params, self.flat)
        c = self.flat.numel() // n
        # the parameters this rank updates: its chunk (its shard, and any padding), a view into `flat`
        self.chunk = self.flat[rank * c:(rank + 1) * c]
        self.chunk.grad = torch.zeros_like(self.chunk)    # the only gradient memory that stays
        self.landed = 0

    def take_grads(self) -> torch.Tensor:
        return take_grads(self.params, self.flat.numel(), self.flat)


def take_grads(params: list, numel: int, like: torch.Tensor) -> torch.Tensor:
    """The parameters' gradients moved into one flat tensor of `numel` elements (the padding zeros),
    laid out as `flatten_into` laid out the parameters: each .grad is dropped, so they exist once."""
    flat = torch.zeros(numel, dtype=like.dtype, device=like.device)
    offset = 0
    for p in params:
        flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None
        offset += p.numel()
    return flat


class ZeRO2:
    def __init__(self, model: torch.nn.Module, optimizer, bucket_bytes: int = 64 << 10):
        rank, self.world_size = dist.get_rank(), dist.get_world_size()
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = [Bucket(group, rank, self.world_size) for group in backward_order_buckets(params, bucket_bytes)]
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(lambda p, b=b: self._gradient_landed(b))
        self.optimizer = optimizer([b.chunk for b in self.buckets])  # state for the shards only

    def _gradient_landed(self, b: Bucket) -> None:
        b.landed += 1
        if b.landed == len(b.params):  # the bucket's last gradient: keep only this rank's chunk of the sum
            summed = torch.empty_like(b.chunk)
            reduce_scatter_single(summed, b.take_grads().div_(self.world_size))  # (g/N summed: the average)
            b.chunk.grad += summed
            b.landed = 0

    def step(self) -> None:
        """After backward: the optimizer on the shards, then every bucket's parameters gathered."""
        self.optimizer.step()
        for b in self.buckets:
            b.chunk.grad.zero_()
            all_gather_single(b.flat, b.chunk.clone())  # (the input a copy, not a view of the output)
