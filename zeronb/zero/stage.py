"""What every stage is: one interface for zeronb's DDP, ZeRO-1, -2, -3 and PyTorch's counterparts,
so that a training loop, the train CLI, checkpoints and the chapters can swap one for another.

    stage = ZeRO2(model, StageConfig(precision="float32", lr=1e-3))
    loss = stage.train_step(x, y, micro_batches=1)  # forward, backward, communication, optimizer step
    stage.state_tensors()        # {"params": [...], "grads": [...], "optimizer": [...]}: what it holds
    stage.full_parameters()      # {name: full tensor}, gathered if sharded
    stage.checkpoint_state()     # {key: tensor or DTensor}: what torch.distributed.checkpoint saves
    stage.load_checkpoint_state(state)   # after DCP has loaded into those tensors
    stage.shard_pieces(tensors)  # {name: (start, stop, values)}: which part of each parameter
                                 # tensors laid out like this rank's optimizer shards hold

Observers watch a stage from outside: each is called as `observer(stage, event, where)` at the
points listed in zeronb.zero.observe, and nothing is recorded, timed or walked when there are none.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist

from .config import StageConfig

_attached = weakref.WeakSet()  # the models a stage has hooked: a second stage would double the hooks


class Stage:
    """The outline of a training step, for every stage: `train_step` runs forward and backward on
    each micro-batch (the stage's hooks fire inside), then the stage's `step`.

    Gradient accumulation: `train_step(x, y, micro_batches=K)` splits this rank's batch into K
    micro-batches, divides each one's loss by K (so that the gradients add up to the whole
    batch's) and takes one optimizer step. A stage that communicates gradients during backward
    does so after every micro-batch when `config.sync_each_micro_batch`, and only after the last
    one otherwise: the second sends 1/K of the bytes; what each holds in between depends on the
    stage (ZeRO-2 and ZeRO-3 hold only shards when they sync every micro-batch)."""

    stage: int = None  # 0 (DDP) .. 3

    def __init__(self, model: torch.nn.Module, config: StageConfig | None = None, observers=()):
        if model in _attached:
            raise ValueError("this model is hooked by another stage already, whose hooks would fire too: build a "
                             "new model (zeronb.models.make_model), or call the other stage's detach() first")
        self.model, self.config = model, config or StageConfig()
        self.observers = list(observers)
        self.hooks = []  # the handles of the hooks the stage put on the model: detach() removes them
        dtype = self.config.dtype
        if any(p.dtype != dtype for p in model.parameters()):
            raise ValueError(f"precision {self.config.precision!r} needs the model's parameters in {dtype}; "
                             f"build it with zeronb.models.make_model(cfg, dtype={dtype})")
        self.names = {p: n for n, p in model.named_parameters()}
        self.shard_group, self.replica_group = self.config.shard_group, self.config.replica_group
        # this rank's place among the ranks it shards over, and how many they are (with replicas, HSDP: fewer than all)
        self.shard_rank, self.num_shards = dist.get_rank(self.shard_group), dist.get_world_size(self.shard_group)
        replicas = dist.get_world_size(self.replica_group) if self.replica_group is not None else 1
        self.data_parallel = self.num_shards * replicas  # the ranks whose gradients are averaged
        self.last_micro_batch = True

    def claim_model(self) -> None:
        """Mark the model as hooked by this stage (done when the hooks go on): another stage's
        hooks would fire too, so another stage is refused until `detach`."""
        _attached.add(self.model)

    def detach(self) -> None:
        """Take the stage's hooks off the model (it keeps the parameters' current values), so that
        another stage can train it."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []
        _attached.discard(self.model)

    def close(self) -> None:
        """Let go of what the stage holds beyond the model, once it is done with (DeepSpeed's engine)."""

    # -- the step -----------------------------------------------------------------------------

    def train_step(self, x, y, micro_batches: int = 1) -> float:
        """One step on this rank's batch, in `micro_batches` equal slices; returns the local loss."""
        if micro_batches < 1 or len(x) % micro_batches:
            raise ValueError(f"this rank's batch of {len(x)} rows does not split into {micro_batches} equal "
                             "micro-batches; choose a number of micro-batches that divides it")
        losses = []
        try:
            for i, (xi, yi) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
                self.last_micro_batch = i == micro_batches - 1
                self.begin_micro_batch()
                self.tell("forward pass", i)
                with self.gradient_sync(self.sync_now()):
                    loss = self.loss(xi, yi) / micro_batches
                    self.tell("backward pass", i)
                    loss.backward()
                self.check_backward()
                self.end_micro_batch()
                self.tell("backward pass done", i)
                losses.append(loss.detach())
            self.step()
        except BaseException:
            self.tell("step failed")  # (an observer may hold something open until the step ends)
            raise
        self.tell("step done")
        return torch.stack(losses).sum().item()  # (after the step: .item() waits for a GPU)

    def loss(self, x, y) -> torch.Tensor:
        return self.model.loss(self.model(x), y)

    def sync_now(self) -> bool:
        """Whether this micro-batch's gradients are communicated now (else: kept until the last)."""
        return self.config.sync_each_micro_batch or self.last_micro_batch

    def begin_micro_batch(self) -> None:
        """Before a micro-batch's forward: the stage's bookkeeping."""

    def check_backward(self) -> None:
        """After a micro-batch's backward: raise if it left the stage unable to go on."""

    def end_micro_batch(self) -> None:
        """After a micro-batch's backward: the stage's bookkeeping."""

    def gradient_sync(self, sync: bool):
        """The context a micro-batch's forward and backward run in (PyTorch's stages switch their
        gradient communication on and off here)."""
        return contextlib.nullcontext()

    def step(self) -> None:
        """After the last micro-batch: what is left to communicate, and the optimizer step."""
        raise NotImplementedError

    def tell(self, event: str, where=None) -> None:
        """Let the observers know (see zeronb.zero.observe); without observers this costs nothing."""
        for observer in self.observers:
            observer(self, event, where)

    # -- what a stage holds ---------------------------------------------------------------------

    def state_tensors(self) -> dict:
        """{"params", "grads", "optimizer"}: the tensors this rank holds in each role."""
        raise NotImplementedError

    def full_parameters(self) -> dict:
        """{name: tensor} of the whole model, on every rank (a stage that shards gathers)."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    @property
    def last_grad_norm(self) -> float | None:
        """The whole model's gradient 2-norm in the last step, before clipping (with clip_norm)."""
        raise NotImplementedError

    def shard_pieces(self, tensors: list) -> dict:
        """{name: (start, stop, values)}: which elements of each (flattened) parameter `tensors`
        hold, laid out like the shards this rank's optimizer updates (one tensor per shard)."""
        raise NotImplementedError

    # -- checkpoints (zeronb.checkpoint) -------------------------------------------------------

    def checkpoint_state(self) -> dict:
        """{key: tensor}: what a sharded checkpoint saves of this rank, and loads into in place."""
        raise NotImplementedError

    def load_checkpoint_state(self, state: dict) -> None:
        """After torch.distributed.checkpoint has loaded into `checkpoint_state()`'s tensors."""

    def checkpoint_layout(self) -> dict | None:
        """What an export needs to rebuild the parameters by name from the saved tensors (None:
        they are saved by name already)."""
        return None
