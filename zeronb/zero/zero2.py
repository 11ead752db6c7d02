"""ZeRO stage 2: the gradients are sharded too.

In ZeRO-1 every rank holds all the gradients after backward, although its optimizer needs only
chunk r of them. ZeRO-2 never keeps the rest: parameters are grouped into buckets (as DDP does), and
as soon as backward has produced all of a bucket's gradients, a hook reduce-scatters that bucket -
rank r keeps the sum of its chunk of it - and frees the full gradients. Backward goes on with earlier
layers while the bucket is on its way. After backward a rank holds only its gradient shard; at most
a bucket or two of full gradients ever existed at once.

The optimizer step is ZeRO-1's: Adam on the owned shards, then an all-gather of the parameters.
Communication: the same reduce-scatter and all-gather volume as ZeRO-1 and DDP - a reduce-scatter,
not an all-reduce, after backward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..backend import all_gather_single, reduce_scatter_single
from .common import ShardAdam, average_, make_buckets
from .engine import Engine


class ZeRO2(Engine):
    stage = 2

    def __init__(self, model, precision="float32", lr=1e-3, bucket_bytes: int = 64 << 10,
                 grad_shard_dtype: torch.dtype | None = None, sync_each_micro_batch: bool = True):
        """`grad_shard_dtype`: keep the reduced gradient shard in another dtype than the
        parameters' (torch.float32 in bf16-mixed: the recipe behind "2N + 16N/M", chapter 6).
        `sync_each_micro_batch` (with accumulation): reduce-scatter every micro-batch into the
        shard, or keep the full gradients until the last one and reduce-scatter once."""
        super().__init__(model, precision, lr)
        self.sync_each_micro_batch = sync_each_micro_batch
        self.rank, n = dist.get_rank(), dist.get_world_size()
        self.buckets = make_buckets(list(model.parameters()), n, bucket_bytes)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        for b in self.buckets:
            b.shard = b.chunk(self.rank)              # this rank's parameters in the bucket
            b.grad_shard = torch.zeros_like(b.shard, dtype=grad_shard_dtype)  # their summed gradient: all we keep
            for p in b.params:
                p.register_post_accumulate_grad_hook(self._grad_ready)
        self._reset()
        self.adam = ShardAdam([b.shard for b in self.buckets], precision, lr)
        self.peak_grad_bytes = 0  # the most gradient memory alive at once during backward

    def _reset(self):
        for b in self.buckets:
            b.pending = set(b.params)

    def begin_micro_batch(self, index, count):
        super().begin_micro_batch(index, count)
        self._reset()

    def _grad_ready(self, p):
        b = self.bucket_of[p]
        b.pending.discard(p)
        self._note_grad_memory()
        if b.pending or not self.sync_now():  # (not now: the full gradients add up until the last micro-batch)
            return
        # the bucket is complete: reduce-scatter it now, add chunk r to the shard, free the full gradients
        full = b.flatten_grads()
        send = full if self.reduce_dtype is None else full.to(self.reduce_dtype)  # communicated in reduce_dtype
        reduced = send.new_empty(b.grad_shard.numel())
        reduce_scatter_single(reduced, send)
        b.grad_shard.add_(reduced)  # added: with accumulation, every micro-batch's sum lands here
        for q in b.params:
            q.grad = None
        self._note_grad_memory(extra=full)

    def _note_grad_memory(self, extra=None):
        from ..memory import tensor_bytes

        live = [p.grad for p in self.model.parameters()] + [b.grad_shard for b in self.buckets] + [extra]
        self.peak_grad_bytes = max(self.peak_grad_bytes, tensor_bytes(live))

    def step(self):
        grads = [average_(b.grad_shard) for b in self.buckets]
        self.adam.step(grads, self.clip_norm)
        for b in self.buckets:
            all_gather_single(b.data, b.shard.clone())
            b.grad_shard.zero_()
        self._reset()

    def flat_buckets(self):
        return self.buckets

    def after_load(self):
        for b in self.buckets:
            all_gather_single(b.data, b.shard.clone())  # every rank's loaded shard, everywhere

    def state_tensors(self):
        # the shards, and any full gradient still waiting for its bucket (or for the last micro-batch)
        return {"params": [b.data for b in self.buckets],
                "grads": [b.grad_shard for b in self.buckets] + [p.grad for p in self.model.parameters()],
                "optimizer": self.adam.state_tensors()}
