"""ZeRO stage 3 (and FSDP): the parameters are sharded as well.

Between steps rank r holds only chunk r of everything: parameters, gradients, optimizer state. The
model is cut into *units* (a layer, a transformer block), each laid out in its own flat bucket.
A unit's full parameters exist only while it computes:

- forward: just before a unit runs, all-gather its parameters; right after, free them
  (`reshard_after_forward=False` keeps them until backward instead: FSDP's SHARD_GRAD_OP, ZeRO-2's
  memory for parameters, one all-gather fewer);
- backward: just before the unit's backward, all-gather them again; when all its gradients exist,
  reduce-scatter them - rank r keeps chunk r - and free both the full gradients and parameters;
- optimizer: Adam on the shards; no all-gather afterwards - the next forward gathers what it needs.

Per step that is two all-gathers and one reduce-scatter of the parameters: 3(N-1)/N * psi elements
sent per rank, 1.5 times DDP's all-reduce. (The last unit is not freed between its forward and its
backward, which come right after each other: that saves one all-gather of it.)

`prefetch=True` starts the all-gather of the next unit (in forward order, and in backward order)
while the current one computes, so that communication overlaps computation - as FSDP does.

How the parameters "disappear": each parameter is a view into the unit's flat buffer, and freeing
resizes that buffer's storage to 0 bytes; gathering resizes it back and fills it. Autograd keeps
references to the same storage, so the tensors it saved for backward see the re-gathered values.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from .. import ledger
from ..backend import all_gather_single, reduce_scatter_single
from .common import Bucket, ShardAdam, average_
from .engine import Engine

# The first unit's inputs (token ids, or a batch that needs no gradient) have no gradient, and
# PyTorch warns that the unit's full backward hook then fires on its outputs' gradients: which is
# exactly when ZeRO-3 wants it (before the unit's backward), so the warning is noise here.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect to module outputs")


class Unit:
    """One unit's flat parameters: the persistent shard, and the full buffer that comes and goes."""

    def __init__(self, index, module, rank, world_size):
        self.index, self.module = index, module
        self.flat = Bucket(list(module.parameters()), world_size, f"unit{index}")
        self.shard = self.flat.chunk(rank).clone()          # the only copy of the parameters kept
        self.grad_shard = torch.zeros_like(self.shard)
        self.nbytes = self.flat.data.untyped_storage().nbytes()
        self.gathered = True
        self.work = None       # an all-gather in flight (prefetch)
        self.issued = self.t_compute = 0.0
        self.pending = set()

    def free(self):
        """Drop the full parameters: only the shard remains."""
        self.flat.data.untyped_storage().resize_(0)
        self.gathered = False

    def gather(self, async_op=False):
        """All-gather the full parameters into the unit's buffer (the parameters' views see them)."""
        if self.gathered or self.work is not None:
            return
        self.flat.data.untyped_storage().resize_(self.nbytes)
        # write through .data: autograd must not see this as an in-place change of a saved tensor
        self.issued = ledger.now(self.shard.device)
        self.work = all_gather_single(self.flat.data.data, self.shard, async_op=True)
        if not async_op:
            self.wait()

    def wait(self):
        if self.work is not None:
            self.work.wait()
            self.work = None
            self.gathered = True


class ZeRO3(Engine):
    stage = 3

    def __init__(self, model, precision="float32", lr=1e-3, reshard_after_forward: bool = True,
                 prefetch: bool = False, sync_each_micro_batch: bool = True):
        super().__init__(model, precision, lr)
        self.sync_each_micro_batch = sync_each_micro_batch
        self.rank, n = dist.get_rank(), dist.get_world_size()
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.units = [Unit(i, m, self.rank, n) for i, m in enumerate(model.units())]
        self.unit_of = {p: u for u in self.units for p in u.flat.params}
        for u in self.units:
            u.module.register_forward_pre_hook(lambda m, args, u=u: self._before_forward(u))
            u.module.register_forward_hook(lambda m, args, out, u=u: self._after_forward(u))
            u.module.register_full_backward_pre_hook(lambda m, grad_out, u=u: self._before_backward(u))
            for p in u.flat.params:
                p.register_post_accumulate_grad_hook(self._grad_ready)
            u.free()
        self.adam = ShardAdam([u.shard for u in self.units], precision, lr)
        self.events = []       # (what, unit, start, end): the timeline of one step
        self.memory = []       # (time, label, bytes of full parameters alive): the memory timeline

    # -- the hooks, in the order they fire ------------------------------------------------------

    def _before_forward(self, u):
        if u.index == 0:  # a new step: the timelines describe the latest step only
            self.events, self.memory = [], []
        self._gather(u, "forward")
        if self.prefetch and u.index + 1 < len(self.units):
            self.units[u.index + 1].gather(async_op=True)       # overlap: next unit's all-gather
        u.pending = set(u.flat.params)
        self._note(f"forward {u.index}")

    def _after_forward(self, u):
        self.events.append(("forward", u.index, u.t_compute, self._now()))
        last = u.index == len(self.units) - 1   # its backward comes next: keep it
        if self.reshard_after_forward and not last:
            u.free()
        self._note(f"after forward {u.index}")

    def _before_backward(self, u):
        self._gather(u, "backward")
        if self.prefetch and u.index > 0:
            self.units[u.index - 1].gather(async_op=True)
        self._note(f"backward {u.index}")

    def _grad_ready(self, p):
        u = self.unit_of[p]
        u.pending.discard(p)
        if u.pending:
            return
        # the unit's gradients are complete: reduce-scatter them, add chunk r, free everything full
        t0 = self._now()
        self.events.append(("backward", u.index, u.t_compute, t0))
        if not self.sync_now():  # accumulating: keep the full gradients until the last micro-batch
            u.free()
            self._note(f"after backward {u.index}")
            return
        full = u.flat.flatten_grads()
        for q in u.flat.params:
            q.grad = None
        send = full if self.reduce_dtype is None else full.to(self.reduce_dtype)  # communicated in reduce_dtype
        reduced = send.new_empty(u.grad_shard.numel())
        reduce_scatter_single(reduced, send)
        u.grad_shard.add_(reduced)  # added: with accumulation, every micro-batch's sum lands here
        self.events.append(("reduce-scatter", u.index, t0, self._now()))
        del full
        u.free()
        self._note(f"after backward {u.index}")

    def _gather(self, u, phase):
        """Make sure the unit's full parameters are here (waiting for a prefetch if one is on its way)."""
        needed = not u.gathered
        u.gather()
        u.wait()
        if needed:
            self.events.append((f"all-gather ({phase})", u.index, u.issued, self._now()))
        u.t_compute = self._now()

    def _now(self) -> float:
        """The timelines' clock; on a GPU it is read once the queued work has run (ledger.now)."""
        return ledger.now(self.units[0].shard.device)

    def _note(self, label):
        live = sum(u.nbytes for u in self.units if u.gathered or u.work is not None)
        self.memory.append((self._now(), label, live))

    # -- the step ---------------------------------------------------------------------------------

    def step(self):
        grads = [average_(u.grad_shard) for u in self.units]
        self.adam.step(grads, self.clip_norm)   # updates the shards; nothing to gather: the next forward will
        for u in self.units:
            u.grad_shard.zero_()

    def flat_buckets(self):
        return [u.flat for u in self.units]  # (the next forward gathers what was loaded into the shards)

    def state_tensors(self):
        full = [u.flat.data for u in self.units]  # storage of 0 bytes unless gathered
        return {"params": [u.shard for u in self.units] + full,
                "grads": [u.grad_shard for u in self.units] + [p.grad for p in self.model.parameters()],
                "optimizer": self.adam.state_tensors()}

    def full_parameters(self):
        out = {}
        for u in self.units:
            u.gather()
            for p in u.flat.params:
                out[self.names[p]] = p.detach().clone()
            u.free()
        return out
