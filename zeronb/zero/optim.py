"""The optimizer every stage runs on what it owns: Adam or SGD over flat shards, with an fp32 master
copy in mixed precision, and gradient clipping by the norm of the whole model."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..memory import optimizer_tensors
from ..precision import optimizer_class
from .config import StageConfig


class ShardOptimizer:
    """Adam (or SGD) over some flat shards of parameters: whole buckets for DDP, this rank's
    chunks for ZeRO. In float32/float64 it updates them in place; in bf16-mixed it updates fp32
    master copies and copies them back into the bf16 shards.

    `sharded`: the shards together with the other ranks' make up the model (ZeRO), so the
    gradient norm is summed over `group`; False: this rank holds the whole model (DDP)."""

    def __init__(self, shards: list, config: StageConfig, sharded: bool = True, group=None):
        self.shards, self.config, self.sharded, self.group = shards, config, sharded, group
        self.mixed = config.precision_spec.master
        self.master = [s.detach().float().clone() for s in shards] if self.mixed else shards
        # foreach=False: the same per-tensor arithmetic as the single-process reference
        self.optimizer = optimizer_class(config.optimizer)(self.master, lr=config.lr, foreach=False)
        self._norm = None  # the whole model's gradient norm in the last step, before clipping

    def step(self, grads: list) -> None:
        """One step with these averaged gradients (one per shard); with clip_norm set, after scaling
        them so that the whole model's gradient has at most that 2-norm."""
        if any(g is None for g in grads):
            raise RuntimeError("the optimizer was handed no gradient for a shard: backward did not run, or ran "
                               "outside the stage's train_step (which reduces the gradients: use it)")
        for master, grad in zip(self.master, grads):
            master.grad = grad.float() if self.mixed else grad
        if self.config.clip_norm is not None:
            self._norm = clip_by_global_norm_([m.grad for m in self.master], self.config.clip_norm,
                                              sharded=self.sharded, group=self.group)
        self.optimizer.step()
        for master in self.master:
            master.grad = None
        if self.mixed:
            with torch.no_grad():
                for shard, master in zip(self.shards, self.master):
                    shard.copy_(master)

    @property
    def last_grad_norm(self) -> float | None:
        """The whole model's gradient 2-norm in the last step, before clipping (with clip_norm)."""
        return None if self._norm is None else self._norm.item()  # (read after the step: .item() waits for a GPU)

    def init_state(self) -> None:
        """Create the state the first step would (Adam: step 0, zero moments), so that a checkpoint
        can be loaded into it before any step."""
        init_state(self.optimizer)

    def state_of(self, i: int) -> dict:
        """The optimizer's state for shard i (Adam: step, exp_avg, exp_avg_sq; SGD: none)."""
        return self.optimizer.state[self.master[i]]

    def states(self) -> list:
        """The state of every shard, in order."""
        return [self.state_of(i) for i in range(len(self.master))]

    def state_tensors(self) -> list:
        """What the optimizer holds: its states, and the master copy in mixed precision."""
        return optimizer_tensors(self.optimizer) + (self.master if self.mixed else [])


def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of an Adam without state the state its first step creates (step 0,
    zero moments). Plain SGD keeps no state: nothing to create."""
    if not isinstance(optimizer, torch.optim.Adam):
        return
    step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # as Adam does
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state.update(step=torch.tensor(0.0, dtype=step_dtype), exp_avg=torch.zeros_like(p),
                             exp_avg_sq=torch.zeros_like(p))


def clip_by_global_norm_(grads: list, max_norm: float, sharded: bool = True, group=None) -> torch.Tensor:
    """Scale `grads` in place, as torch.nn.utils.clip_grad_norm_ would on one process holding the
    whole model: by max_norm / (norm + 1e-6), capped at 1, where norm is the 2-norm of the whole
    model's gradient. `sharded`: each rank of `group` holds a piece of it; each adds up the squares
    of its own piece, and one all-reduce of that single number gives every rank the same total, so
    every rank scales by the same factor. Not sharded: this rank holds the whole gradient.
    Returns the norm before clipping, as a tensor (reading it with .item() would make the CPU wait
    for a GPU's queued work)."""
    acc = torch.promote_types(grads[0].dtype, torch.float32)  # bf16 squares are summed in fp32
    squares = torch.zeros(1, dtype=acc, device=grads[0].device)
    for g in grads:
        squares += g.to(acc).pow(2).sum()
    if sharded:
        dist.all_reduce(squares, group=group)
    norm = squares.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return norm.squeeze()
