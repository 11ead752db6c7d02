"""ZeRO-3 (FSDP), the minimal version: the parameters sharded as well.

Between steps rank r holds only chunk r of everything: parameters, gradients, optimizer state. The
model is cut into *units* (`model.units()`: a layer, a transformer block), each laid out flat in
N equal chunks. A unit's full parameters exist only while it computes:

- before a unit's forward, all-gather its parameters ("unshard"); after it, free them ("reshard");
- before the unit's backward, all-gather them again; when backward has produced all its
  gradients, reduce-scatter them - rank r keeps chunk r of the sum - and free the full gradients
  and parameters;
- the optimizer steps on the shards; nothing is gathered after it: the next forward will.

The last unit's backward comes right after its forward, so it is kept, saving one all-gather.

How the parameters "disappear": each parameter is a view into its unit's flat buffer, and freeing
resizes the buffer's storage to 0 bytes; gathering resizes it back and fills it. The tensors that
autograd saved for backward are views of the same storage, so they see the gathered values again;
and since each parameter was made a view through `.data` (flatten_into), it keeps a version
counter of its own, so a gather between forward and backward is not an in-place change of a
weight autograd saved (chapter 10).

The full version (zeronb.zero.zero3.ZeRO3) adds prefetching the next unit's gather, keeping the
parameters from forward to backward, accumulation, replicas, ZeRO++'s gathers and observers
(chapters 10 and 11).
"""
import torch
import torch.distributed as dist

from ..runtime.compat import all_gather_single, reduce_scatter_single
from .zero1 import flatten_into, padded
from .zero2 import take_grads


class Unit:
    """One unit's parameters: a flat buffer of the full parameters that comes and goes, and this
    rank's shard of them, which stays."""

    def __init__(self, module: torch.nn.Module, rank: int, n: int):
        self.module, self.params = module, [p for p in module.parameters() if p.requires_grad]
        first = self.params[0]
        self.flat = torch.zeros(padded(sum(p.numel() for p in self.params), n), dtype=first.dtype,
                                device=first.device)
        flatten_into(self.params, self.flat)
        c = self.flat.numel() // n
        # this rank's chunk (its shard, and any padding): a copy, not a view, which would vanish with
        # the buffer's storage when it is freed
        self.chunk = self.flat[rank * c:(rank + 1) * c].clone()
        self.chunk.grad = torch.zeros_like(self.chunk)
        self.nbytes = self.flat.untyped_storage().nbytes()
        self.unsharded, self.landed = True, 0

    def unshard(self) -> None:
        """The full parameters, gathered from every rank's shard (nothing to do if they are here)."""
        if not self.unsharded:
            self.flat.untyped_storage().resize_(self.nbytes)
            all_gather_single(self.flat, self.chunk)
            self.unsharded = True

    def reshard(self) -> None:
        """Free the full parameters: only the shard remains."""
        self.flat.untyped_storage().resize_(0)
        self.unsharded = False

    def take_grads(self) -> torch.Tensor:
        return take_grads(self.params, self.flat.numel(), self.chunk)  # (self.flat may have 0 bytes: numel stays)


class ZeRO3:
    def __init__(self, model: torch.nn.Module, optimizer):
        rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.units = [Unit(m, rank, self.world_size) for m in model.units()]
        if sum(len(u.params) for u in self.units) != sum(p.requires_grad for p in model.parameters()):
            raise ValueError("every trainable parameter must be in exactly one unit: one in none would never train")
        for u in self.units:
            u.module.register_forward_pre_hook(lambda m, args, u=u: u.unshard())
            u.module.register_forward_hook(lambda m, args, out, u=u: self._post_forward(u, out))
            for p in u.params:
                p.register_post_accumulate_grad_hook(lambda p, u=u: self._gradient_landed(u))
            u.reshard()
        self.optimizer = optimizer([u.chunk for u in self.units])  # state for the shards only

    def _post_forward(self, u: Unit, out: torch.Tensor) -> None:
        if out.requires_grad:  # before the unit's backward: the gradient of its output has arrived
            out.register_hook(lambda grad: u.unshard())
        if u is not self.units[-1]:  # (the last unit's backward comes next: keep it)
            u.reshard()

    def _gradient_landed(self, u: Unit) -> None:
        u.landed += 1
        if u.landed == len(u.params):  # the unit's last gradient: keep this rank's chunk of the sum
            summed = torch.empty_like(u.chunk)
            reduce_scatter_single(summed, u.take_grads().div_(self.world_size))  # (g/N summed: the average)
            u.chunk.grad += summed
            u.landed = 0
            u.reshard()

    def step(self) -> None:
        """After backward: the optimizer on the shards (the next forward gathers what it needs)."""
        self.optimizer.step()
        for u in self.units:
            u.chunk.grad.zero_()
