"""What zeronb's own stages share (DDP, ZeRO-1, -2, -3): parameters in flat buckets, gradient
hooks that fire when a bucket's last gradient has landed, the collectives on buckets, and the one
place they divide by N. The step's outline is zeronb.zero.stage.Stage's; what a flat stage saves
and loads is zeronb.zero.saving's."""
from __future__ import annotations

import torch

from .saving import FlatSaving
from .stage import Stage


class FlatStage(FlatSaving, Stage):
    """zeronb's stages: parameters in flat buckets (`self.buckets`), and one optimizer over
    `self.optimizer.shards`, shard i belonging to bucket i: the bucket itself when every rank
    updates everything (DDP, `sharded = False`), this rank's chunk of it otherwise."""

    sharded = True

    # -- what the stages share: gradient hooks, and the collectives on buckets ----------------

    def hook_gradients(self, buckets: list) -> None:
        """Call `bucket_complete(b)` as soon as backward has produced the last gradient of bucket b
        (autograd's post-accumulate-grad hook on every parameter tells which has landed)."""
        self.bucket_of = {p: b for b in buckets for p in b.params}
        self.hooks += [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.bucket_of]
        self.claim_model()

    def _grad_ready(self, p):
        b = self.bucket_of[p]
        self.tell("gradient ready", p)
        if b.mark_ready(p):
            self.bucket_complete(b)

    def bucket_complete(self, b) -> None:
        """Every gradient of bucket b has landed in this micro-batch's backward."""

    def begin_micro_batch(self):
        for b in self.buckets:
            b.reset()  # no gradient has landed yet

    def reduce_scatter_bucket(self, b, grads=None) -> None:
        """The bucket's gradients move into one flat tensor (or `grads`, a flat buffer of them), which
        is reduce-scattered into this rank's shard, `b.grad_shard` (added to what is there); then
        that tensor goes too. In reduce_dtype if one is set; through zeronb's ring if config says so."""
        b.comm = self.divided_(b.take_grads() if grads is None else grads)
        self.tell("reduce-scatter", b)
        b.reduce_scatter(dtype=self.config.reduce_dtype, group=self.shard_group, ring=self.config.reduce_scatter == "ring")
        self.tell("reduce-scatter done", b)

    def gather_parameters(self) -> None:
        """Every bucket's full parameters again, from every rank's (updated or loaded) shard."""
        for b in self.buckets:
            b.all_gather(b.chunk(self.shard_rank).clone(), group=self.shard_group)
            self.tell("gathered", b)

    def divided_(self, grads: torch.Tensor) -> torch.Tensor:
        """In place, just before gradients leave for their first collective: divided by the number
        of ranks whose gradients are averaged (shards x replicas), before the sum as PyTorch's
        DDP (which scales by 1/N as it copies each gradient into its bucket) and FSDP do.
        Every sum that comes back is then an average, and a sum of many low-precision gradients
        cannot overflow. The one place zeronb's stages divide: by hand, so that every torch version
        and backend the course supports behaves the same. gloo's all-reduce gained ReduceOp.AVG only
        in March 2025 (pytorch/pytorch#149781), and gloo's reduce-scatter, an all-reduce of a copy,
        did not hand it the op: it accepted AVG and silently summed (pytorch/pytorch#162338, which
        FSDP2 ran into) until a fix merged in December 2025 (pytorch/pytorch#171458)."""
        return grads.div_(self.data_parallel)

    def sum_over_replicas_(self, grads: list) -> list:
        """In place: the (already divided) gradients summed over the replicas, the ranks that hold
        the same shards (HSDP; nothing without replicas). Only shards travel; in reduce_dtype if
        one is set."""
        if self.replica_group is not None:  # (grads: one per bucket, in order)
            for b, g in zip(self.buckets, grads):
                b.start_all_reduce(g, dtype=self.config.reduce_dtype, group=self.replica_group)
            for b in self.buckets:
                b.finish()
        return grads

    def update(self, grads: list) -> None:
        """The optimizer step on this rank's shards, with their averaged gradients."""
        self.tell("optimizer step", grads)
        self.optimizer.step(grads)

    @property
    def last_grad_norm(self):
        return self.optimizer.last_grad_norm
