"""What zeronb's own stages share (DDP, ZeRO-1, -2, -3): parameters in flat buckets, gradient
hooks that fire when a bucket's last gradient has landed, the collectives on buckets, and the one
place they divide by N. The step's outline is zeronb.zero.stage.Stage's; what a flat stage saves
and loads is zeronb.zero.saving's."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .saving import FlatSaving
from .stage import Stage


class FlatStage(FlatSaving, Stage):
    """zeronb's stages: parameters in flat buckets (`self.buckets`), and one optimizer over
    `self.optimizer.shards`, shard i belonging to bucket i: the bucket itself when every rank
    updates everything (DDP, `sharded = False`), this rank's chunk of it otherwise."""

    sharded = True

    # -- the buckets, and what observers see of them -------------------------------------------

    @property
    def buckets(self) -> list:
        """The stage's flat buckets (ZeRO-3's units). Setting them hands each one the stage's
        observers, so that what happens to a bucket is seen from outside the stage's own code."""
        return self._buckets

    @buckets.setter
    def buckets(self, buckets: list) -> None:
        self._buckets = buckets
        for b in buckets:
            b.watcher = self.tell

    # -- what the stages share: gradient hooks, and the collectives on buckets ----------------

    def hook_gradients(self, buckets: list) -> None:
        """Call `post_backward(b)` as soon as backward has produced the last gradient of bucket b
        (autograd's post-accumulate-grad hook on every parameter tells which has landed)."""
        self.bucket_of = {p: b for b in buckets for p in b.params}
        self.hooks += [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.bucket_of]
        self.claim_model()

    def _grad_ready(self, p):
        b = self.bucket_of[p]
        if b.mark_ready(p):
            self.post_backward(b)

    def post_backward(self, b) -> None:
        """Every gradient of bucket b has landed in this micro-batch's backward (what a stage does
        then is its own)."""

    def watch_units(self, units: list) -> None:
        """Hooks for the observers on each unit's module, after the stage's own (so that they fire
        after them): "forward" once the unit's parameters are here, "backward" likewise; "forward
        done" goes first (prepend), before the stage frees them. (The rest of what observers see
        comes from the units themselves.)"""
        for u in units:
            self.hooks += [
                u.module.register_forward_pre_hook(lambda m, args, u=u: self.tell("forward", u)),
                u.module.register_forward_hook(lambda m, args, out, u=u: self.tell("forward done", u), prepend=True),
                u.module.register_full_backward_pre_hook(lambda m, grad_out, u=u: self.tell("backward", u))]

    def begin_micro_batch(self):
        for b in self.buckets:
            b.reset()  # no gradient has landed yet

    def reduce_scatter_bucket(self, b, grads=None) -> None:
        """The bucket's gradients move into one flat tensor (or `grads`, a flat buffer of them), which
        is reduce-scattered into this rank's shard, `b.grad_shard` (added to what is there); then
        that tensor goes too. In reduce_dtype if one is set; through zeronb's ring if config says so."""
        full = self.divided_(b.take_grads() if grads is None else grads)
        b.reduce_scatter(full, dtype=self.config.reduce_dtype, group=self.shard_group, ring=self.config.reduce_scatter == "ring")

    def gather_parameters(self) -> None:
        """Every bucket's full parameters again, from every rank's (updated or loaded) shard."""
        for b in self.buckets:
            # the input a copy: the collective writes the buffer this chunk is a view of
            b.all_gather(b.chunk(self.shard_rank).clone(), group=self.shard_group)

    def divided_(self, grads: torch.Tensor) -> torch.Tensor:
        """In place, just before gradients leave for their first collective: divided by the number
        of ranks whose gradients are averaged (shards x replicas), before the sum, as PyTorch's DDP
        and FSDP do. Every sum that comes back is then an average, and a sum of many low-precision
        gradients cannot overflow. By hand rather than with ReduceOp.AVG, which not every torch
        version and backend the course supports has or honours (chapter 3 tells the story)."""
        return grads.div_(self.data_parallel)

    def update(self, grads: list) -> None:
        """The optimizer step on this rank's shards, with their averaged gradients (one per shard;
        with replicas, summed over them first)."""
        self.sum_over_replicas_(grads)
        self.tell("optimizer step", grads)
        self.optimizer.step(grads)

    def sum_over_replicas_(self, grads: list) -> None:
        """In place: the (already divided) gradients summed over the replicas, the ranks that hold
        the same shards (HSDP, chapter 13; nothing without replicas). Only shards travel; in
        reduce_dtype if one is set."""
        if self.replica_group is None:
            return
        for g in grads:
            sent = g if self.config.reduce_dtype in (None, g.dtype) else g.to(self.config.reduce_dtype)
            dist.all_reduce(sent, group=self.replica_group)
            if sent is not g:
                g.copy_(sent)

    @property
    def last_grad_norm(self):
        return self.optimizer.last_grad_norm
