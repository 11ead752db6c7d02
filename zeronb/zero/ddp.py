"""Stage 0, data parallelism (DDP): every rank holds everything; gradients are all-reduced.

Each rank runs forward and backward on its own slice of the batch, so its gradients differ from
the other ranks'. All-reducing them and dividing by N gives every rank the gradient of the whole
batch; then every rank takes the same optimizer step on the same full state, and the replicas stay
identical.

`NaiveDDP` does exactly that after backward, one all-reduce per parameter. `DDP` follows PyTorch's
DistributedDataParallel (Li et al. 2020): parameters are grouped into buckets, and a bucket is
all-reduced - asynchronously - as soon as backward has produced all of its gradients, while
backward goes on with earlier layers. Here the gradients are views into one flat buffer per bucket,
as in PyTorch's DDP with `gradient_as_bucket_view=True`; by default PyTorch's DDP keeps each `.grad`
apart and copies it into its bucket, a second copy of the gradients (chapter 12 measures both).
Two more differences: `DDP` launches whichever bucket completes, where PyTorch's reducer launches
them in index order, and it pads each bucket to a multiple of N (chapter 2's rule), which PyTorch's
DDP does not.
"""
from __future__ import annotations

import torch.distributed as dist

from .buckets import Bucket, divided_, make_buckets
from .optim import ShardOptimizer
from .flat import FlatStage


class NaiveDDP(FlatStage):
    """All-reduce every gradient after backward, one parameter at a time."""

    stage = 0
    sharded = False

    def __init__(self, model, config=None, observers=()):
        super().__init__(model, config, observers)
        if self.config.reduce_dtype is not None:
            raise ValueError("NaiveDDP all-reduces in the parameters' dtype; for reduce_dtype use DDP")
        self.params = [p for p in model.parameters() if p.requires_grad]
        # one "bucket" per parameter, unpadded: only checkpoints and parity checks look at them
        self.buckets = [Bucket([p], 1, self.names[p]) for p in self.params]
        self.optimizer = ShardOptimizer(self.params, self.config, sharded=False)

    def end_micro_batch(self):
        if not self.last_micro_batch and self.config.sync_each_micro_batch:
            raise ValueError("NaiveDDP all-reduces once, after the last micro-batch: accumulate with "
                             "sync_each_micro_batch=False (--accum-sync last), or use DDP")

    def step(self):
        for p in self.params:
            dist.all_reduce(divided_(p.grad, self.data_parallel), group=self.shard_group)  # the sum of g/N: the average
        self.update([p.grad for p in self.params])
        for p in self.params:
            p.grad = None

    def state_tensors(self):
        return {"params": self.params, "grads": [p.grad for p in self.params],
                "optimizer": self.optimizer.state_tensors()}


class DDP(FlatStage):
    """Bucketed gradient all-reduce, overlapped with backward (PyTorch DDP's design)."""

    stage = 0
    sharded = False

    def __init__(self, model, config=None, observers=(), bucket_bytes: int | None = 64 << 10):
        super().__init__(model, config, observers)
        self.buckets = make_buckets(list(model.parameters()), self.num_shards, bucket_bytes)
        for b in self.buckets:
            b.keep_grads_flat()  # autograd accumulates each gradient into the bucket's flat buffer
        self.hook_gradients(self.buckets)
        # every rank updates the whole (replicated) model
        self.optimizer = ShardOptimizer([b.data for b in self.buckets], self.config, sharded=False)

    def post_backward(self, b):
        if self.sync_now():  # send it while backward goes on (accumulating: after the last micro-batch)
            self.all_reduce_bucket(b)

    def all_reduce_bucket(self, b):
        """Start the bucket's all-reduce, of its gradients divided by N first: the sum that comes back
        is the average. In reduce_dtype if one is set."""
        b.start_all_reduce(self.data_parallel, dtype=self.config.reduce_dtype, group=self.shard_group)

    def wait_for_all_reduces(self):
        """Wait for every bucket's all-reduce (and copy a reduce_dtype result back)."""
        for b in self.buckets:
            b.finish()

    def end_micro_batch(self):
        if not self.last_micro_batch and self.config.sync_each_micro_batch:
            self.wait_for_all_reduces()  # the next backward adds into these averages: they must have arrived

    def step(self):
        self.wait_for_all_reduces()
        self.update([b.grad for b in self.buckets])
        for b in self.buckets:
            b.grad.zero_()

    def state_tensors(self):
        return {"params": [b.data for b in self.buckets],
                "grads": [b.grad for b in self.buckets] + [b.comm for b in self.buckets if b.comm is not b.grad],
                "optimizer": self.optimizer.state_tensors()}
