"""What zeronb's own stages share (DDP, ZeRO-1, -2, -3): parameters in flat buckets
(zeronb.zero.buckets, which also runs the collectives on them), the gradient hooks, what observers
see, and the optimizer step. The step's outline is zeronb.zero.stage.Stage's; what a flat stage
saves and loads is zeronb.zero.saving's."""
from __future__ import annotations

import torch.distributed as dist

from .buckets import hook_gradients, outputs_needing_grad
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
        (zeronb.zero.buckets.hook_gradients)."""
        self.hooks += hook_gradients(buckets, self.post_backward)
        self.gradients_hooked = True
        self.claim_model()

    def post_backward(self, b) -> None:
        """Every gradient of bucket b has landed in this micro-batch's backward (what a stage does
        then is its own)."""

    def watch_units(self, units: list) -> None:
        """Hooks for the observers on each unit's module, after the stage's own (so that they fire
        after them): "forward" once the unit's parameters are here, and "backward" likewise (a hook
        on the gradient of the unit's output, as the stage's own); "forward done" goes first
        (prepend), before the stage frees them. (The rest of what observers see comes from the
        units themselves.)"""
        def backward_begins(u, out):
            for t in outputs_needing_grad(out):
                t.register_hook(lambda grad: self.tell("backward", u))

        for u in units:
            self.hooks += [
                u.module.register_forward_pre_hook(lambda m, args, u=u: self.tell("forward", u)),
                u.module.register_forward_hook(lambda m, args, out, u=u: self.tell("forward done", u), prepend=True),
                u.module.register_forward_hook(lambda m, args, out, u=u: backward_begins(u, out))]

    def check_backward(self):
        """A bucket whose parameters did not all get a gradient would never be sent, and the ranks
        would step apart (or the bucket never train): name them. (ZeRO-1 hooks no gradient: a parameter
        without one adds zeros to its flat gradient.)"""
        for b in self.buckets if getattr(self, "gradients_hooked", False) else ():
            if not b.complete:
                missing = [self.names[p] for p in b.params if p not in b.ready]
                raise RuntimeError(f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} got no gradient in this "
                                   "backward, so its bucket was never sent: use every parameter in forward, or freeze "
                                   "it (requires_grad=False) before building the stage")

    def begin_micro_batch(self):
        for b in self.buckets:
            b.reset()  # no gradient has landed yet

    def gather_parameters(self) -> None:
        """Every bucket's full parameters again, from every rank's (updated or loaded) chunk."""
        for b in self.buckets:
            b.gather_chunks(self.shard_rank, group=self.shard_group)

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
