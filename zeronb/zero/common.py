"""What the ZeRO stages share: parameters in flat, padded buckets, and Adam on a shard.

A *bucket* is a group of parameters laid out one after another in one flat tensor, padded with zeros
to a multiple of the world size N (zeronb.shards' rule), each parameter becoming a view into it.
A flat tensor is what the collectives want - one all-reduce, reduce-scatter or all-gather per
bucket instead of one per parameter - and chunk r of it is rank r's shard.

The precision of a run decides what the optimizer keeps (see zeronb.memory.PRECISIONS):
- "float32" / "float64": Adam updates the parameters themselves; it keeps momentum and variance.
- "bf16-mixed": parameters and gradients are bf16; Adam keeps an fp32 *master* copy of the
  parameters plus fp32 momentum and variance - the ZeRO paper's 2 + 2 + 12 bytes per parameter.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..shards import padded_numel

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bf16-mixed": torch.bfloat16}


def model_dtype(precision: str) -> torch.dtype:
    if precision not in DTYPES:
        raise ValueError(f"precision must be one of {', '.join(DTYPES)}, not {precision!r}")
    return DTYPES[precision]


class Bucket:
    """Parameters in one flat tensor, padded to a multiple of `world_size`.

    `data` is the flat tensor; each parameter's `.data` becomes a view into it. Chunk r of `data`
    (`chunk(r)`) is rank r's shard; `numel` counts real elements, `padded` includes the padding."""

    def __init__(self, params: list, world_size: int, name: str = ""):
        self.params = list(params)
        self.name = name
        self.world_size = world_size
        self.numel = sum(p.numel() for p in self.params)
        self.padded = padded_numel(self.numel, world_size)
        self.chunk_numel = self.padded // world_size
        first = self.params[0]
        self.data = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
        self.offsets = []
        offset = 0
        for p in self.params:
            self.offsets.append(offset)
            self.data[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.data[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def chunk(self, rank: int, flat: torch.Tensor = None) -> torch.Tensor:
        """Rank `rank`'s chunk of `flat` (default: of the parameters)."""
        flat = self.data if flat is None else flat
        return flat[rank * self.chunk_numel:(rank + 1) * self.chunk_numel]

    def views(self, flat: torch.Tensor) -> list:
        """Each parameter's slice of another flat tensor laid out like this bucket (e.g. gradients)."""
        return [flat[o:o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]

    def flatten_grads(self) -> torch.Tensor:
        """The parameters' .grad copied into one padded flat tensor (missing gradients are zeros)."""
        flat = torch.zeros(self.padded, dtype=self.data.dtype, device=self.data.device)
        for p, o in zip(self.params, self.offsets):
            if p.grad is not None:
                flat[o:o + p.numel()].copy_(p.grad.reshape(-1))
        return flat


def make_buckets(params: list, world_size: int, bucket_bytes: int | None) -> list[Bucket]:
    """Group parameters into buckets of about `bucket_bytes`, in *backward* order (the last layer's
    parameters get their gradients first, so their bucket is ready first). None: one bucket."""
    params = [p for p in params if p.requires_grad]
    if bucket_bytes is None:
        return [Bucket(params, world_size, "all")]
    buckets, current, size = [], [], 0
    for p in reversed(params):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    # inside a bucket keep forward order, so that its flat layout reads like the model
    return [Bucket(list(reversed(group)), world_size, f"bucket{i}") for i, group in enumerate(buckets)]


class ShardAdam:
    """Adam over some flat shards of parameters, with an fp32 master copy in mixed precision.

    `shards` are views of the parameters that this rank updates (whole buckets for DDP, its chunks
    for ZeRO). In float32/float64 Adam updates them in place; in bf16-mixed it updates fp32 masters
    and copies them back into the bf16 shards."""

    def __init__(self, shards: list, precision: str, lr: float = 1e-3, sharded: bool = True, **adam_kw):
        self.shards = shards
        self.sharded = sharded  # False: every rank holds (and updates) the whole model, as in DDP
        self.last_grad_norm = None
        self.mixed = precision == "bf16-mixed"
        self.master = [s.detach().float().clone() for s in shards] if self.mixed else shards
        # foreach=False: the same per-tensor arithmetic as the single-process reference
        self.optimizer = torch.optim.Adam(self.master, lr=lr, foreach=False, **adam_kw)

    def step(self, grads: list, clip_norm: float | None = None) -> None:
        """One Adam step with these (averaged) gradients; with `clip_norm`, after scaling them so
        that the whole model's gradient has at most that 2-norm (clip_by_global_norm_)."""
        for master, grad in zip(self.master, grads):
            master.grad = grad.float() if self.mixed else grad
        if clip_norm is not None:
            self.last_grad_norm = clip_by_global_norm_([m.grad for m in self.master], clip_norm, self.sharded)
        self.optimizer.step()
        for master in self.master:
            master.grad = None
        if self.mixed:
            with torch.no_grad():
                for shard, master in zip(self.shards, self.master):
                    shard.copy_(master)

    def init_state(self) -> None:
        """Create Adam's state as its first step would: what a checkpoint is loaded into."""
        init_adam_state(self.optimizer)

    def state_tensors(self) -> list:
        """What the optimizer holds: Adam's states, and the master copy in mixed precision."""
        from ..memory import optimizer_tensors

        return optimizer_tensors(self.optimizer) + (self.master if self.mixed else [])


def init_adam_state(optimizer: torch.optim.Adam) -> None:
    """Give every parameter of `optimizer` without state the state Adam's first step creates
    (step 0, zero moments), so that a checkpoint can be loaded into it before any step."""
    step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # as Adam does
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state.update(step=torch.tensor(0.0, dtype=step_dtype), exp_avg=torch.zeros_like(p),
                             exp_avg_sq=torch.zeros_like(p))


def clip_by_global_norm_(grads: list, max_norm: float, sharded: bool) -> float:
    """Scale `grads` in place, as torch.nn.utils.clip_grad_norm_ would on one process holding the
    whole model: by max_norm / (norm + 1e-6), capped at 1, where norm is the 2-norm of the whole
    model's gradient. Sharded, each rank holds a piece of it: each adds up the squares of its own
    piece, and one all-reduce of that single number gives every rank the same total, so every rank
    scales by the same factor. Returns the norm before clipping."""
    acc = torch.promote_types(grads[0].dtype, torch.float32)  # bf16 squares are summed in fp32
    squares = torch.zeros(1, dtype=acc, device=grads[0].device)
    for g in grads:
        squares += g.to(acc).pow(2).sum()
    if sharded:
        dist.all_reduce(squares)
    norm = squares.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return norm.item()


def average_(tensor: torch.Tensor) -> torch.Tensor:
    """Divide by the world size (gloo has no AVG reduction; a SUM then this is the same)."""
    return tensor.div_(dist.get_world_size())
