"""ZeRO stage 2: the gradients are sharded too.

In ZeRO-1 every rank holds all the gradients after backward, although its optimizer needs only
chunk r of them. ZeRO-2 never keeps the rest: parameters are grouped into buckets (as DDP does), and
as soon as backward has produced all of a bucket's gradients, a hook reduce-scatters that bucket -
rank r keeps the sum of its chunk of it - and the bucket's full gradients are dropped. Then
backward goes on with earlier layers: this reduce-scatter is synchronous, so backward waits for
it (DDP's all-reduces, chapter 7, are not; an asynchronous one would hold each bucket until it
has arrived). After backward a rank holds only its gradient shard; at most one bucket of full
gradients, and the one being filled, ever existed at once - besides the reduce-scatter's own
buffers (its receive buffer and, on gloo, a copy of its input: 1.25 buckets from PyTorch's
allocator, and gloo's ring scratch besides, 1/N of a bucket: chapter 9).

The optimizer step is ZeRO-1's: the optimizer on the owned shards, then an all-gather of the
parameters. Communication: the same reduce-scatter and all-gather volume as ZeRO-1 and DDP - a
reduce-scatter, not an all-reduce, after backward.
"""
from __future__ import annotations

import torch

from .buckets import make_buckets
from .optim import ShardOptimizer
from .flat import FlatStage


class ZeRO2(FlatStage):
    stage = 2

    def __init__(self, model, config=None, observers=(), bucket_bytes: int = 64 << 10,
                 grad_shard_dtype: torch.dtype | None = None):
        """`grad_shard_dtype`: keep the reduced gradient shard in another dtype than the
        parameters' (torch.float32 in bf16-mixed: the recipe behind a note's "2N + 16N/M" for N parameters on M
        ranks, written 2psi + 16psi/N in this course; chapter 6)."""
        super().__init__(model, config, observers)
        self.buckets = make_buckets(list(model.parameters()), self.num_shards, bucket_bytes)
        for b in self.buckets:
            # the summed gradient of this rank's chunk: the only gradient memory that stays
            b.new_grad_shard(grad_shard_dtype)
        self.hook_gradients(self.buckets)
        self.optimizer = ShardOptimizer([b.chunk(self.shard_rank) for b in self.buckets], self.config,
                                        group=self.shard_group)

    def post_backward(self, b):
        if self.sync_now():  # (accumulating: the full gradients add up until the last micro-batch)
            # only this rank's shard of the sum stays
            b.reduce_scatter_grads(self.data_parallel, dtype=self.config.reduce_dtype, group=self.shard_group,
                                   ring=self.config.reduce_scatter == "ring")

    def step(self):
        self.update([b.grad_shard for b in self.buckets])
        for b in self.buckets:
            b.grad_shard.zero_()
            b.gather_chunks(self.shard_rank, group=self.shard_group)

    def after_load(self):
        self.gather_parameters()  # every rank's loaded shard

    def state_tensors(self):
        # the shards, and any full gradient still waiting for its bucket (or for the last micro-batch)
        return {"params": [b.data for b in self.buckets],
                "grads": [b.grad_shard for b in self.buckets] + [b.comm for b in self.buckets]
                         + [p.grad for p in self.model.parameters()],
                "optimizer": self.optimizer.state_tensors()}
