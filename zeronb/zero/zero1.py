"""ZeRO stage 1: the optimizer states are sharded.

Every rank still holds all the parameters and, after backward, all the gradients. But rank r keeps
the optimizer state (Adam's momentum and variance, and in mixed precision the fp32 master weights)
only for its own shard, chunk r of the flat parameters. One step:

1. forward and backward, as in DDP: full gradients on every rank;
2. reduce-scatter the gradients: rank r receives the sum of everyone's chunk r - the only gradient
   its optimizer needs;
3. the optimizer on the owned shard only;
4. all-gather the updated shards, so that every rank has all the new parameters again.

Reduce-scatter + all-gather send exactly what one all-reduce sends (an all-reduce *is* the two of
them), so this saves optimizer memory for free in bandwidth.
"""
from __future__ import annotations


from .buckets import make_buckets
from .optim import ShardOptimizer
from .flat import FlatStage


class ZeRO1(FlatStage):
    stage = 1

    def __init__(self, model, config=None, observers=()):
        super().__init__(model, config, observers)
        self.buckets = make_buckets(list(model.parameters()), self.num_shards, None)  # one flat buffer, N chunks
        (self.bucket,) = self.buckets
        self.bucket.keep_grads_flat()                # 1. the full gradients, accumulated in place by autograd
        # the parameters this rank updates: its chunk, its shard and (on the last ranks) padding (zeronb.shards)
        self.own_chunk = self.bucket.chunk(self.shard_rank)
        self.optimizer = ShardOptimizer([self.own_chunk], self.config, group=self.shard_group)  # state for the shard only
        # self.bucket.grad_shard: the summed gradient of the shard, during a step only

    def end_micro_batch(self):
        if self.sync_now():
            self._reduce_scatter()

    def _reduce_scatter(self):
        """2. Rank r gets the sum of everyone's chunk r of the gradient buffer (added to what earlier
        micro-batches sent, in reduce_dtype if one is set: bf16 halves the bytes, and rounds the sums)."""
        if self.bucket.grad_shard is None:  # the shard's summed gradient, held during a step only
            self.bucket.new_grad_shard()
        self.bucket.reduce_scatter_grads(self.data_parallel, self.bucket.grad, dtype=self.config.reduce_dtype,
                                       group=self.shard_group, ring=self.config.reduce_scatter == "ring")
        self.bucket.grad.zero_()  # sent: the next micro-batch's gradients start from zero

    def step(self):
        if self.bucket.grad_shard is None:  # (driven by backward and step, not train_step: step 2 is still to do)
            self._reduce_scatter()
        # 3. the optimizer on the owned shard, with its average gradient
        self.update([self.bucket.grad_shard])
        self.bucket.free_grad_shard()
        # 4. all-gather the updated shards into the full parameters
        self.bucket.gather_chunks(self.shard_rank, group=self.shard_group)

    def after_load(self):
        self.gather_parameters()  # every rank's loaded shard

    def state_tensors(self):
        return {"params": [self.bucket.data], "grads": [self.bucket.grad, self.bucket.grad_shard],
                "optimizer": self.optimizer.state_tensors()}
