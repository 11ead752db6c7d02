"""The part of every stage that is not the lesson: the training step's outline and bookkeeping."""
from __future__ import annotations

import torch

from .common import model_dtype


class Engine:
    """Base of the stages: `train_step` runs forward and backward, then the stage's `step`.

    Gradient accumulation: `train_step(x, y, micro_batches=K)` splits this rank's batch into K
    micro-batches and runs forward and backward on each (the loss divided by K, so that the
    gradients add up to the whole batch's), then one optimizer step. A stage that communicates
    gradients during backward does so after every micro-batch when `sync_each_micro_batch` is
    true, and only after the last one otherwise (DDP's `no_sync`; for ZeRO-2 and ZeRO-3, keeping
    the full gradients until then): the second sends 1/K of the bytes, the first holds less."""

    stage = None
    sync_each_micro_batch = True
    clip_norm = None  # clip the gradient to this global 2-norm before each optimizer step
    reduce_dtype = None  # the dtype gradients are communicated in (None: their own)
    measure_memory = False  # count activations and gradients held (costs a Python hook per saved tensor)
    activation_bytes = None

    def __init__(self, model: torch.nn.Module, precision: str = "float32", lr: float = 1e-3):
        self.model = model
        self.last_micro_batch = True
        self.precision = precision
        self.lr = lr
        self.dtype = model_dtype(precision)
        if any(p.dtype != self.dtype for p in model.parameters()):
            raise ValueError(f"precision {precision!r} needs the model's parameters in {self.dtype}; "
                             f"build it with zeronb.models.make_model(cfg, dtype={self.dtype})")
        self.names = {p: n for n, p in model.named_parameters()}

    def loss(self, x, y) -> torch.Tensor:
        return self.model.loss(self.model(x), y)

    def train_step(self, x, y, micro_batches: int = 1) -> float:
        """One step on this rank's batch: forward and backward (the stage's hooks fire inside it)
        on each of `micro_batches` equal slices of it, then the stage's communication and
        optimizer step. Returns the local loss."""
        if micro_batches < 1 or len(x) % micro_batches:
            raise ValueError(f"this rank's batch of {len(x)} rows does not split into {micro_batches} equal "
                             "micro-batches; choose a number of micro-batches that divides it")
        from ..memory import saved_activations, tensor_bytes

        total = 0.0
        self.grad_bytes_after_micro_batch = []  # what accumulation costs in memory: gradients held
        for i, (xi, yi) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
            self.begin_micro_batch(i, micro_batches)
            if self.measure_memory:
                with saved_activations(exclude=self.model.parameters) as saved:  # forward only
                    loss = self.loss(xi, yi) / micro_batches
                self.activation_bytes = saved["bytes"]  # what autograd kept for this micro-batch's backward
            else:
                loss = self.loss(xi, yi) / micro_batches
            loss.backward()
            self.end_micro_batch()
            if self.measure_memory:
                self.grad_bytes_after_micro_batch.append(tensor_bytes(self.state_tensors()["grads"]))
            total += loss.item()
        self.step()
        return total

    def begin_micro_batch(self, index: int, count: int) -> None:
        self.last_micro_batch = index == count - 1

    def end_micro_batch(self) -> None:
        """After a micro-batch's backward (a stage may fold what it communicated into its sums)."""

    @property
    def last_grad_norm(self):
        """The whole model's gradient 2-norm in the last step, before clipping (with clip_norm)."""
        return self.adam.last_grad_norm

    def sync_now(self) -> bool:
        """Whether the gradients of this backward are communicated now (else: kept until the last)."""
        return self.sync_each_micro_batch or self.last_micro_batch

    def step(self) -> None:
        raise NotImplementedError

    def flat_buckets(self) -> list:
        """The flat buckets Adam works on, in the order of `self.adam.shards` (for a stage that shards,
        shard i is this rank's chunk of bucket i; for DDP it is the whole bucket): what a sharded
        checkpoint (zeronb.checkpoint) saves and loads."""
        raise NotImplementedError(f"{type(self).__name__} does not keep its state in flat buckets")

    def after_load(self) -> None:
        """After a checkpoint was loaded into the shards: make the rest of the state agree with them."""

    def state_tensors(self) -> dict:
        raise NotImplementedError

    def full_parameters(self) -> dict:
        """{name: tensor} of the whole model, on every rank (stages that shard parameters gather)."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}
