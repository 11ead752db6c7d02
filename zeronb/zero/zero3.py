"""ZeRO stage 3 (and FSDP): the parameters are sharded as well.

Between steps rank r holds only chunk r of everything: parameters, gradients, optimizer state. The
model is cut into *units* (a layer, a transformer block), each laid out in its own flat bucket.
A unit's full parameters exist only while it computes:

- forward: just before a unit runs, all-gather its parameters; right after, free them
  (`reshard_after_forward=False` keeps them until backward instead: FSDP's SHARD_GRAD_OP, ZeRO-2's
  memory for parameters, one all-gather fewer);
- backward: just before the unit's backward, all-gather them again; when all its gradients exist,
  reduce-scatter them - rank r keeps chunk r - and free both the full gradients and parameters;
- optimizer: on the shards; no all-gather afterwards - the next forward gathers what it needs.

Per step that is two all-gathers and one reduce-scatter of the parameters: 3(N-1)/N * psi elements
sent per rank per micro-batch, 1.5 times DDP's all-reduce with one micro-batch (with several, ZeRO-3
gathers for every one, while DDP may reduce once: chapter 12). (The last unit is not freed between its forward and its
backward, which come right after each other: that saves one all-gather of it.)

`prefetch=True` issues the all-gather of the next unit (in forward order, and in backward order)
before the current one computes, without waiting for it, so that the transfer overlaps the
computation. (PyTorch's FSDP overlaps forward gathers without being asked: it issues them from a
stream of its own. zeronb issues them from the compute stream, so without prefetch nothing
overlaps.) No all-gather is waited for before its unit needs it: on a GPU it runs on NCCL's stream
while the unit's kernels run on the compute stream. (The reduce-scatter, as in
ZeRO-2, is synchronous.)

How the parameters "disappear": each parameter is a view into the unit's flat buffer, and freeing
resizes that buffer's storage to 0 bytes; gathering resizes it back and fills it. Autograd keeps
references to the same storage, so the tensors it saved for backward see the re-gathered values.
"""
from __future__ import annotations

import torch

from .buckets import Bucket, outputs_needing_grad
from .optim import ShardOptimizer
from .flat import FlatStage

class Unit(Bucket):
    """One unit's parameters: a flat buffer of the full parameters that comes and goes, and this
    rank's shard of them, which stays. `state` says where the full parameters are: "sharded" (not
    here: the buffer's storage is 0 bytes), "unsharding" (the all-gather is on its way, `work`),
    "unsharded" (here). Unsharding a unit that is not sharded, or resharding one that is, does
    nothing. (FSDP2's words: unshard, reshard.) Every change is told to the stage's observers."""

    def __init__(self, index: int, module: torch.nn.Module, rank: int, shards: int):
        super().__init__(list(module.parameters()), shards, f"unit{index}")
        self.index, self.module = index, module
        # the only copy of the parameters kept: this rank's chunk (its shard, and any padding), a copy,
        # not a view, which would vanish with the buffer's storage when `reshard` resizes it to 0 bytes
        self.own_chunk = self.chunk(rank).clone()
        self.new_grad_shard()
        self.nbytes = self.data.untyped_storage().nbytes()
        self.state, self._complete = "unsharded", None
        self.reshard()

    def reshard(self) -> None:
        """Drop the full parameters: only the shard remains."""
        if self.state == "sharded":
            return
        self.data.untyped_storage().resize_(0)
        self.state = "sharded"
        self.changed("freed")

    def unshard(self, group) -> None:
        """Issue the all-gather of the full parameters into the unit's buffer (Bucket.all_gather);
        `wait_for_unshard` waits for it."""
        self.unshard_with(lambda: self.all_gather(self.own_chunk, group, async_op=True))

    def unshard_with(self, start, complete=None) -> None:
        """Unshard some way (ZeRO++ has two more): give the buffer its storage back, and `start()`
        issues the collective and returns its work; `complete()`, if given, fills the buffer from what
        arrived, once the work is done."""
        if self.state != "sharded":
            return
        self.data.untyped_storage().resize_(self.nbytes)
        self.work, self._complete = start(), complete
        self.state = "unsharding"
        self.changed("all-gather")

    def wait_for_unshard(self) -> None:
        """Wait for the all-gather on its way, if one is: then the full parameters are here."""
        if self.state != "unsharding":
            return
        self.work.wait()
        if self._complete is not None:
            self._complete()
        self.work = self._complete = None
        self.state = "unsharded"
        self.changed("gathered")

    def mark_ready(self, p) -> bool:
        last = super().mark_ready(p)
        if last:
            self.changed("backward done")  # (to the unit's last gradient)
        return last


def check_units(model: torch.nn.Module, modules: list) -> None:
    """Every trainable parameter in exactly one unit: one in none would never be gathered nor
    trained, one in two would be handled twice."""
    owned = [p for m in modules for p in m.parameters()]
    if len(set(owned)) != len(owned):
        raise ValueError("a parameter is in two units (one unit module inside another?): choose modules that "
                         "share no parameters")
    names = [n for n, p in model.named_parameters() if p.requires_grad and p not in set(owned)]
    if names:
        raise ValueError(f"{len(names)} parameters are in no unit and would never train ({', '.join(names[:3])}"
                         f"{', ...' if len(names) > 3 else ''}): add the modules that own them to the units, or use "
                         "the whole model as one unit")


class ZeRO3(FlatStage):
    stage = 3

    def __init__(self, model, config=None, observers=(), reshard_after_forward: bool = True,
                 prefetch: bool = False, units: list | None = None):
        """`units`: the modules that are gathered together, in the order forward uses them
        (default: `model.units()`). Choosing them is FSDP's "wrapping"."""
        super().__init__(model, config, observers)
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        modules = model.units() if units is None else units
        check_units(model, modules)
        self.buckets = [Unit(i, m, self.shard_rank, self.num_shards) for i, m in enumerate(modules)]
        for u in self.units:
            self.hooks += [u.module.register_forward_pre_hook(lambda m, args, u=u: self.pre_forward(u)),
                           u.module.register_forward_hook(lambda m, args, out, u=u: self.post_forward(u, out))]
        self.hook_gradients(self.units)  # -> post_backward(u) when the unit's last gradient lands
        self.watch_units(self.units)
        self.optimizer = ShardOptimizer([u.own_chunk for u in self.units], self.config, group=self.shard_group)

    @property
    def units(self) -> list:
        """The stage's buckets, one per unit (ZeRO-3's word for them)."""
        return self.buckets

    # -- the hooks, in the order they fire ------------------------------------------------------

    def pre_forward(self, u):
        self.issue_unshard(u)
        u.wait_for_unshard()
        if self.prefetch and u.index + 1 < len(self.units):
            self.issue_unshard(self.units[u.index + 1])  # overlap: the next unit's all-gather starts now

    def post_forward(self, u, out):
        for t in outputs_needing_grad(out):  # just before the unit's backward, its output's gradient arrives
            t.register_hook(lambda grad, u=u: self.pre_backward(u))
        last = u.index == len(self.units) - 1  # its backward comes next: keep it
        if self.reshard_after_forward and not last:
            u.reshard()

    def pre_backward(self, u):
        self.issue_unshard(u)
        u.wait_for_unshard()
        if self.prefetch and u.index > 0:
            self.issue_unshard(self.units[u.index - 1])

    def post_backward(self, u):
        """The unit's last gradient has landed: reduce-scatter its gradients into the shard (ZeRO-2's
        way), and free its full parameters."""
        if self.sync_now():  # (else, accumulating: the full gradients stay until the last micro-batch)
            u.reduce_scatter_grads(self.data_parallel, dtype=self.config.reduce_dtype, group=self.shard_group,
                                   ring=self.config.reduce_scatter == "ring")
        u.reshard()

    def issue_unshard(self, u):
        """Issue the all-gather of unit u's full parameters (ZeRO++ gathers in other ways)."""
        u.unshard(self.shard_group)

    def detach(self):
        """Gather every unit's full parameters (they stay, the model whole again), then take the hooks off."""
        for u in self.units:
            self.issue_unshard(u)
            u.wait_for_unshard()
        super().detach()

    # -- the step ---------------------------------------------------------------------------------

    def step(self):
        # the optimizer updates the shards; nothing to gather: the next forward will
        self.update([u.grad_shard for u in self.units])
        for u in self.units:
            u.grad_shard.zero_()

    def state_tensors(self):
        full = [u.data for u in self.units]  # storage of 0 bytes unless gathered
        return {"params": [u.own_chunk for u in self.units] + full,
                "grads": [u.grad_shard for u in self.units] + [u.comm for u in self.units]
                         + [p.grad for p in self.model.parameters()],
                "optimizer": self.optimizer.state_tensors()}

    def full_parameters(self):
        out = {}
        for u in self.units:
            kept = u.state == "unsharded"
            u.unshard(self.shard_group)
            u.wait_for_unshard()
            for p in u.params:
                out[self.names[p]] = p.detach().clone()
            if not kept:
                u.reshard()
        return out
