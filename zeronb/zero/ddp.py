"""Stage 0, data parallelism (DDP): every rank holds everything; gradients are all-reduced.

Each rank runs forward and backward on its own slice of the batch, so its gradients differ from
the other ranks'. All-reducing them (and dividing by N) gives every rank the gradient of the whole
batch; then every rank takes the same optimizer step on the same full state, and the replicas stay
identical.

`NaiveDDP` does exactly that after backward, one all-reduce per parameter. `DDP` is what PyTorch's
DistributedDataParallel does (Li et al. 2020): parameters are grouped into buckets, gradients are
views into one flat buffer per bucket, and a bucket is all-reduced - asynchronously - as soon as
backward has produced all of its gradients, while backward goes on with earlier layers.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .common import ShardAdam, average_, make_buckets
from .engine import Engine


class NaiveDDP(Engine):
    """All-reduce every gradient after backward, one parameter at a time."""

    stage = 0

    def __init__(self, model, precision="float32", lr=1e-3):
        super().__init__(model, precision, lr)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.adam = ShardAdam(self.params, precision, lr, sharded=False)

    def step(self):
        for p in self.params:
            dist.all_reduce(p.grad)
            average_(p.grad)
        self.adam.step([p.grad for p in self.params], self.clip_norm)
        for p in self.params:
            p.grad = None

    def state_tensors(self):
        return {"params": self.params, "grads": [p.grad for p in self.params],
                "optimizer": self.adam.state_tensors()}


class DDP(Engine):
    """Bucketed, overlapped gradient all-reduce (PyTorch DDP's design)."""

    stage = 0

    def __init__(self, model, precision="float32", lr=1e-3, bucket_bytes: int | None = 64 << 10,
                 sync_each_micro_batch: bool = True):
        super().__init__(model, precision, lr)
        self.sync_each_micro_batch = sync_each_micro_batch
        n = dist.get_world_size()
        self.buckets = make_buckets(list(model.parameters()), n, bucket_bytes)
        for b in self.buckets:
            b.grad = torch.zeros_like(b.data)           # the bucket's gradients, flat
            for p, g in zip(b.params, b.views(b.grad)):
                p.grad = g                              # autograd accumulates into this view
                p.register_post_accumulate_grad_hook(self._grad_ready)
            b.pending = set()
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.works = []
        self._reset()
        # every rank updates the whole (replicated) model
        self.adam = ShardAdam([b.data for b in self.buckets], precision, lr, sharded=False)

    def _reset(self):
        for b in self.buckets:
            b.pending = set(b.params)

    def begin_micro_batch(self, index, count):
        super().begin_micro_batch(index, count)
        self._reset()

    def _grad_ready(self, p):
        b = self.bucket_of[p]
        b.pending.discard(p)
        if not b.pending and self.sync_now():  # the bucket's gradients exist: send it while backward goes on
            self.works.append((b, self._all_reduce(b)))

    def _all_reduce(self, b):
        """Start the bucket's all-reduce of gradients divided by N first, as PyTorch's DDP does: the
        sum that comes back is the average. (So a micro-batch's backward can add its gradients
        into the average of the micro-batches synced before it: one buffer, whatever the choice.)
        In reduce_dtype if one is set; the result is copied back when the work is waited for."""
        average_(b.grad)
        b.comm = b.grad if self.reduce_dtype in (None, b.grad.dtype) else b.grad.to(self.reduce_dtype)
        return dist.all_reduce(b.comm, async_op=True)

    def _wait_all(self):
        for b, work in self.works:
            work.wait()
            if b.comm is not b.grad:
                b.grad.copy_(b.comm)
            b.comm = None
        self.works = []

    def end_micro_batch(self):
        if not self.last_micro_batch and self.sync_each_micro_batch:
            self._wait_all()  # the next backward adds into these averages: they must have arrived

    def step(self):
        self._wait_all()
        self.adam.step([b.grad for b in self.buckets], self.clip_norm)
        for b in self.buckets:
            b.grad.zero_()
        self._reset()

    def flat_buckets(self):
        return self.buckets

    def state_tensors(self):
        return {"params": [b.data for b in self.buckets],
                "grads": [b.grad for b in self.buckets],
                "optimizer": self.adam.state_tensors()}
