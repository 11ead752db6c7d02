"""ZeRO stage 1: the optimizer states are sharded.

Every rank still holds all the parameters and, after backward, all the gradients. But rank r keeps
the optimizer state (Adam's momentum and variance, and in mixed precision the fp32 master weights)
only for its own shard, chunk r of the flat parameters. One step:

1. forward and backward, as in DDP: full gradients on every rank;
2. reduce-scatter the gradients: rank r receives the sum of everyone's chunk r - the only gradient
   its optimizer needs;
3. Adam on the owned shard only;
4. all-gather the updated shards, so that every rank has all the new parameters again.

Reduce-scatter + all-gather send exactly what one all-reduce sends (an all-reduce *is* the two of
them), so this saves optimizer memory for free in bandwidth.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..backend import all_gather_single, reduce_scatter_single
from .common import ShardAdam, average_, make_buckets
from .engine import Engine


class ZeRO1(Engine):
    stage = 1

    def __init__(self, model, precision="float32", lr=1e-3):
        super().__init__(model, precision, lr)
        self.rank, n = dist.get_rank(), dist.get_world_size()
        (self.flat,) = make_buckets(list(model.parameters()), n, None)  # one flat buffer, N chunks
        self.flat.grad = torch.zeros_like(self.flat.data)
        for p, g in zip(self.flat.params, self.flat.views(self.flat.grad)):
            p.grad = g  # full gradients, accumulated in place by autograd
        self.shard = self.flat.chunk(self.rank)               # the parameters this rank updates
        self.adam = ShardAdam([self.shard], precision, lr)    # state for the shard only

    def step(self):
        # 2. reduce-scatter: rank r gets the summed gradient of chunk r
        # (in reduce_dtype if one is set: bf16 halves the bytes, and rounds the sums)
        grads = self.flat.grad if self.reduce_dtype is None else self.flat.grad.to(self.reduce_dtype)
        grad_shard = grads.new_empty(self.shard.numel())
        reduce_scatter_single(grad_shard, grads)
        grad_shard = grad_shard.to(self.shard.dtype)
        average_(grad_shard)
        # 3. Adam on the owned shard
        self.adam.step([grad_shard], self.clip_norm)
        # 4. all-gather the updated shards into the full parameters
        all_gather_single(self.flat.data, self.shard.clone())
        self.flat.grad.zero_()

    def flat_buckets(self):
        return [self.flat]

    def after_load(self):
        all_gather_single(self.flat.data, self.shard.clone())  # every rank's loaded shard, everywhere

    def state_tensors(self):
        return {"params": [self.flat.data], "grads": [self.flat.grad],
                "optimizer": self.adam.state_tensors()}
