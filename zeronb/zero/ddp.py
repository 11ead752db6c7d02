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
            b.synced = None  # with accumulation, synced every micro-batch: the sums so far
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
        """Start the bucket's all-reduce, in reduce_dtype if one is set (the sum is copied back
        into the gradients when the work is waited for)."""
        b.comm = b.grad if self.reduce_dtype in (None, b.grad.dtype) else b.grad.to(self.reduce_dtype)
        return dist.all_reduce(b.comm, async_op=True)

    def _wait(self, b, work):
        work.wait()
        if b.comm is not b.grad:
            b.grad.copy_(b.comm)
        b.comm = None

    def end_micro_batch(self):
        if self.last_micro_batch or not self.sync_each_micro_batch:
            return  # (no_sync: the gradients keep adding up in place until the last micro-batch)
        # synced after this micro-batch: move the sums aside, so the next backward starts from zero
        for b, work in self.works:
            self._wait(b, work)
            b.synced = b.grad.clone() if b.synced is None else b.synced.add_(b.grad)
            b.grad.zero_()
        self.works = []

    def step(self):
        for b, work in self.works:
            self._wait(b, work)
            if b.synced is not None:
                b.grad.add_(b.synced)
                b.synced.zero_()
            average_(b.grad)
        self.works = []
        self.adam.step([b.grad for b in self.buckets], self.clip_norm)
        for b in self.buckets:
            b.grad.zero_()
        self._reset()

    def flat_buckets(self):
        return self.buckets

    def state_tensors(self):
        return {"params": [b.data for b in self.buckets],
                "grads": [b.grad for b in self.buckets] + [b.synced for b in self.buckets],
                "optimizer": self.adam.state_tensors()}
