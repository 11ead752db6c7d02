"""Buckets: parameters in one flat tensor, and the state of their gradients during a step.

A *bucket* lays a group of parameters out one after another in one flat tensor, padded with zeros
to a multiple of the number of shards N (zeronb.shards' rule); each parameter becomes a view into
it. A flat tensor is what collectives want - one all-reduce, reduce-scatter or all-gather per
bucket instead of one per parameter - and chunk r of it is rank r's shard.

During backward a bucket also keeps track of its gradients: which have landed (`ready`), the
collective in flight (`work`, carrying the flat tensor `comm`), and where the result goes (`grad`,
a flat buffer of the full gradients, for DDP and ZeRO-1; `grad_shard`, this rank's chunk of the
summed gradients, for ZeRO-1 during a step and for ZeRO-2 and ZeRO-3). It runs the collectives on
them itself (`start_all_reduce` / `finish`, `reduce_scatter_grads`, `gather_chunks`), dividing the
gradients by N as they leave (`divided_`); the stage decides when (`hook_gradients` tells it when a
bucket's last gradient has landed).

Observers see a bucket from outside: every change of its state (a gradient landed, a collective
started or done) is told to `watcher`, the stage's observers (zeronb.zero.observe), if it has any.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..collectives import ring_reduce_scatter
from ..runtime.compat import all_gather_single, reduce_scatter_single
from ..shards import padded_numel


class Bucket:
    """Parameters in one flat tensor, padded to a multiple of `shards`.

    `data` is the flat tensor; each parameter's `.data` becomes a view into it. `chunk(r)` is
    rank r's chunk of it; `numel` counts real elements, `padded` includes the padding."""

    def __init__(self, params: list, shards: int, name: str = ""):
        self.params = list(params)
        self.name = name
        self.numel = sum(p.numel() for p in self.params)
        self.padded = padded_numel(self.numel, shards)
        self.chunk_numel = self.padded // shards
        first = self.params[0]
        self.data = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
        self.offsets = []
        offset = 0
        for p in self.params:
            self.offsets.append(offset)
            self.data[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.data[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        # the gradients, during a step
        self.ready = set()       # parameters whose gradient has landed in this backward
        self.complete = False    # whether all of them have, in this backward
        self.grad = None         # the full gradients, flat (DDP, ZeRO-1): `keep_grads_flat`
        self.grad_shard = None   # this rank's chunk of the summed gradients (ZeRO-1, -2, -3)
        self.comm = None         # the flat tensor a collective is carrying
        self.work = None         # that collective, while it is in flight
        self._into = None        # where an all-reduce in flight lands (a reduce_dtype copy is copied back)
        self.watcher = None      # called as watcher(event, what) at each change below (a stage sets it)

    def changed(self, event: str, what=None) -> None:
        """Tell the watcher, if any, that `event` happened to this bucket (or to `what` in it)."""
        if self.watcher is not None:
            self.watcher(event, self if what is None else what)

    def chunk(self, rank: int, flat: torch.Tensor = None) -> torch.Tensor:
        """Rank `rank`'s chunk of `flat` (default: of the parameters)."""
        flat = self.data if flat is None else flat
        return flat[rank * self.chunk_numel:(rank + 1) * self.chunk_numel]

    def piece(self, i: int, parts: int) -> torch.Tensor:
        """Piece i of the parameters cut into `parts` equal pieces (parts must divide the number of
        shards the bucket was padded for: ZeRO++'s secondary shards, a node's share of a unit)."""
        if self.padded % parts:
            raise ValueError(f"a bucket padded to {self.padded} elements does not cut into {parts} equal pieces")
        n = self.padded // parts
        return self.data[i * n:(i + 1) * n]

    def views(self, flat: torch.Tensor) -> list:
        """Each parameter's slice of another flat tensor laid out like this bucket (e.g. gradients)."""
        return [flat[o:o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]

    def keep_grads_flat(self) -> None:
        """Give the bucket one flat gradient buffer, `grad`, and make each parameter's `.grad` a
        view into it: autograd then accumulates straight into the buffer, and a collective can
        take it as it is."""
        self.grad = torch.zeros_like(self.data)
        for p, g in zip(self.params, self.views(self.grad)):
            p.grad = g

    def mark_ready(self, p) -> bool:
        """Note that `p`'s gradient has landed; True when it was the bucket's last."""
        self.changed("gradient ready", p)
        self.ready.add(p)
        if len(self.ready) < len(self.params):
            return False
        self.ready.clear()  # complete: the next backward starts counting again
        self.complete = True
        return True

    def reset(self) -> None:
        """A new backward: no gradient has landed yet."""
        self.ready.clear()
        self.complete = False

    def flatten_grads(self) -> torch.Tensor:
        """The parameters' gradients copied into one padded flat tensor (a missing gradient is zeros)."""
        flat = torch.zeros(self.padded, dtype=self.data.dtype, device=self.data.device)
        for p, o in zip(self.params, self.offsets):
            if p.grad is not None:
                flat[o:o + p.numel()].copy_(p.grad.reshape(-1))
        return flat

    def take_grads(self) -> torch.Tensor:
        """The gradients moved into one flat tensor: `flatten_grads`, and each parameter's `.grad`
        dropped, so that they exist once."""
        flat = self.flatten_grads()
        for p in self.params:
            p.grad = None
        return flat

    def all_gather(self, shard: torch.Tensor, group=None, async_op: bool = False):
        """The full parameters from every rank's `shard` over `group`, into `data` (the parameters'
        views see them). Into the flat buffer, which autograd never saw: each parameter is a view with a
        version counter of its own (`p.data = ...`), so backward reads the gathered values without
        calling them an in-place change (ZeRO-3 gathers between forward and backward). With
        `async_op`, its work (and whoever waits for it says when the parameters are here)."""
        work = all_gather_single(self.data, shard, group=group, async_op=async_op)
        if not async_op:
            self.changed("gathered")
        return work

    def fill_chunk(self, rank: int, values: torch.Tensor) -> None:
        """Write rank `rank`'s chunk of the parameters (through .data, as `all_gather`)."""
        with torch.no_grad():
            self.chunk(rank).copy_(values)

    def new_grad_shard(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A zero `grad_shard` (in `dtype`, default the parameters'): where reduce-scatters add."""
        self.grad_shard = torch.zeros(self.chunk_numel, dtype=dtype or self.data.dtype, device=self.data.device)
        return self.grad_shard

    def free_grad_shard(self) -> None:
        """Drop `grad_shard` (ZeRO-1 holds none between steps)."""
        self.grad_shard = None

    def reduce_scatter_grads(self, ranks: int, grads: torch.Tensor | None = None, *, dtype: torch.dtype | None = None,
                             group=None, ring: bool = False) -> None:
        """The bucket's gradients, moved into one flat tensor (or `grads`, a flat buffer of them), divided
        by the `ranks` whose gradients are averaged, and reduce-scattered over `group`: this rank's chunk
        of the sum - the average - is added into `grad_shard` (`new_grad_shard`), and the flat tensor
        goes. Only the shard remains. In `dtype` if given (None: the gradients' own); through zeronb's
        ring with `ring`. While in flight the flat tensor is `comm` (what observers weigh)."""
        self.comm = divided_(self.take_grads() if grads is None else grads, ranks)
        self.changed("reduce-scatter")
        reduce_scatter_into(self.grad_shard, self.comm, dtype=dtype, group=group, ring=ring)
        self.comm = None
        self.changed("reduce-scatter done")

    def start_all_reduce(self, ranks: int, *, dtype: torch.dtype | None = None, group=None) -> None:
        """Start the all-reduce of the flat gradients `grad`, divided by the `ranks` whose gradients
        are averaged first, so that the sum that comes back is the average (with accumulation, the next
        micro-batch's backward adds into that average, and dividing and summing again adds its own).
        In `dtype` if given (None: their own); returns at once: `finish` waits for it."""
        grads = divided_(self.grad, ranks)
        self.comm = grads if dtype in (None, grads.dtype) else grads.to(dtype)
        self.work, self._into = dist.all_reduce(self.comm, group=group, async_op=True), grads
        self.changed("all-reduce")

    def finish(self) -> None:
        """Wait for the all-reduce in flight, if one is, and copy a reduce_dtype result back."""
        if self.work is None:
            return
        self.work.wait()
        if self.comm is not self._into:
            self._into.copy_(self.comm)
        self.comm = self.work = self._into = None
        self.changed("all-reduce done")

    def gather_chunks(self, rank: int, group=None) -> None:
        """The full parameters again, from every rank's chunk of them over `group` (this rank's, `rank`,
        updated by its optimizer or loaded from a checkpoint)."""
        self.all_gather(self.chunk(rank).clone(), group=group)  # a copy: the collective writes what it views

    def pieces(self, flat: torch.Tensor, names: dict, rank: int | None = None) -> dict:
        """What `flat` - chunk `rank` of a tensor laid out like this bucket, or (rank None) all of
        it - holds, parameter by parameter: {name: (start, stop, values)}, start and stop counted
        in the flattened parameter. (A parameter may be cut between two ranks' chunks.)"""
        lo, hi = (0, self.padded) if rank is None else (rank * self.chunk_numel, (rank + 1) * self.chunk_numel)
        out = {}
        for p, o in zip(self.params, self.offsets):
            a, b = max(lo, o), min(hi, o + p.numel())
            if a < b:
                out[names[p]] = (a - o, b - o, flat[a - lo:b - lo])
        return out


def divided_(grads: torch.Tensor, ranks: int) -> torch.Tensor:
    """In place, just before gradients leave for their first collective: divided by the number of
    ranks whose gradients are averaged (shards x replicas), before the sum, as PyTorch's DDP and FSDP
    do. Every sum that comes back is then an average, and a sum of many low-precision gradients
    cannot overflow. The one place zeronb's stages divide; by hand rather than with ReduceOp.AVG,
    which not every torch version and backend the course supports has or honours (chapter 3)."""
    return grads.div_(ranks)


def hook_gradients(buckets: list, post_backward) -> list:
    """Autograd's post-accumulate-grad hook on every parameter of `buckets`, so that
    `post_backward(b)` runs as soon as backward has produced the last gradient of bucket b.
    Returns the hooks' handles (`handle.remove()` takes one off)."""
    def hook(p, b):
        if b.mark_ready(p):
            post_backward(b)
    return [p.register_post_accumulate_grad_hook(lambda p, b=b: hook(p, b)) for b in buckets for p in b.params]


def outputs_needing_grad(out) -> list:
    """The tensors among a module's outputs (a tensor, or a tuple or list of them) that backward
    will reach: a hook on their gradients fires just before the module's backward, as FSDP2 hooks
    it."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in outs if isinstance(t, torch.Tensor) and t.requires_grad]


def make_buckets(params: list, shards: int, bucket_bytes: int | None) -> list[Bucket]:
    """Group parameters into buckets of about `bucket_bytes`, in *backward* order (the last layer's
    parameters get their gradients first, so their bucket is ready first). None: one bucket."""
    params = [p for p in params if p.requires_grad]
    if bucket_bytes is None:
        return [Bucket(params, shards, "all")]
    groups, current, size = [], [], 0
    for p in reversed(params):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    # inside a bucket keep forward order, so that its flat layout reads like the model
    return [Bucket(list(reversed(group)), shards, f"bucket{i}") for i, group in enumerate(groups)]


def reduce_scatter_into(shard: torch.Tensor, full: torch.Tensor, *, dtype: torch.dtype | None = None,
                        group=None, ring: bool = False) -> None:
    """Add this rank's chunk of the sum over `group` of `full` (a padded flat tensor) into `shard`.
    The bytes travel in `dtype` (None: `full`'s own), through the backend's reduce-scatter or, with
    `ring`, zeronb's. Added, not copied: with gradient accumulation each micro-batch's sum lands
    on top of the earlier ones."""
    send = full if dtype in (None, full.dtype) else full.to(dtype)
    if ring:
        received = ring_reduce_scatter(send, group=group)
    else:
        received = send.new_empty(shard.numel())
        reduce_scatter_single(received, send, group=group)
    shard.add_(received)
