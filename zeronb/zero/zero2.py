"""ZeRO stage 2: the gradients are sharded too.

In ZeRO-1 every rank holds all the gradients after backward, although its optimizer needs only
chunk r of them. ZeRO-2 never keeps the rest: parameters are grouped into buckets (as DDP does), and
as soon as backward has produced all of a bucket's gradients, a hook reduce-scatters that bucket -
rank r keeps the sum of its chunk of it - and the bucket's full gradients are dropped. Then
backward goes on with earlier layers: this reduce-scatter is synchronous, so backward waits for
it (DDP's all-reduces, chapter 7, are not; an asynchronous one would hold each bucket until it
has arrived). After backward a rank holds only its gradient shard; at most one bucket of full
gradients, and the one being filled, ever existed at once.

The optimizer step is ZeRO-1's: the optimizer on the owned shards, then an all-gather of the
parameters. Communication: the same reduce-scatter and all-gather volume as ZeRO-1 and DDP - a
reduce-scatter, not an all-reduce, after backward.
"""
from __future__ import annotations

import torch

from ..compat import all_gather_single
from .buckets import make_buckets, reduce_scatter_into
from .optim import ShardOptimizer
from .stage import FlatStage


class ZeRO2(FlatStage):
    stage = 2

    def __init__(self, model, config=None, observers=(), bucket_bytes: int = 64 << 10,
                 grad_shard_dtype: torch.dtype | None = None):
        """`grad_shard_dtype`: keep the reduced gradient shard in another dtype than the
        parameters' (torch.float32 in bf16-mixed: the recipe behind "2N + 16N/M", chapter 6)."""
        super().__init__(model, config, observers)
        self.buckets = make_buckets(list(model.parameters()), self.shards, bucket_bytes)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        for b in self.buckets:
            # the summed gradient of this rank's chunk: the only gradient memory that stays
            b.grad_shard = torch.zeros_like(b.chunk(self.rank), dtype=grad_shard_dtype)
            for p in b.params:
                p.register_post_accumulate_grad_hook(self._grad_ready)
        self.optimizer = ShardOptimizer([b.chunk(self.rank) for b in self.buckets], self.config,
                                        group=self.shard_group)

    def begin_micro_batch(self):
        for b in self.buckets:
            b.reset()

    def _grad_ready(self, p):
        b = self.bucket_of[p]
        self.tell("gradient ready", p)
        if b.mark_ready(p) and self.sync_now():  # (accumulating: the full gradients add up until the last micro-batch)
            self.reduce_bucket(b)

    def reduce_bucket(self, b):
        """The bucket is complete: its gradients move into one flat tensor, which is reduce-scattered
        into this rank's shard; then that tensor goes too. Only the shard remains."""
        b.comm = b.take_grads()
        self.tell("reduce-scatter", b)
        reduce_scatter_into(b.grad_shard, b.comm, dtype=self.config.reduce_dtype, group=self.shard_group,
                            ring=self.config.reduce_scatter == "ring")
        b.comm = None
        self.tell("reduce-scatter done", b)

    def step(self):
        self.update(self.average_([b.grad_shard for b in self.buckets]))
        for b in self.buckets:
            all_gather_single(b.data, b.chunk(self.rank).clone(), group=self.shard_group)
            b.grad_shard.zero_()

    def after_load(self):
        for b in self.buckets:
            all_gather_single(b.data, b.chunk(self.rank).clone(), group=self.shard_group)  # every rank's loaded shard

    def state_tensors(self):
        # the shards, and any full gradient still waiting for its bucket (or for the last micro-batch)
        return {"params": [b.data for b in self.buckets],
                "grads": [b.grad_shard for b in self.buckets] + [b.comm for b in self.buckets]
                         + [p.grad for p in self.model.parameters()],
                "optimizer": self.optimizer.state_tensors()}
