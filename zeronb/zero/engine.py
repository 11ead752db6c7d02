"""The part of every stage that is not the lesson: the training step's outline and bookkeeping."""
from __future__ import annotations

import torch

from .common import model_dtype


class Engine:
    """Base of the stages: `train_step` runs forward and backward, then the stage's `step`."""

    stage = None

    def __init__(self, model: torch.nn.Module, precision: str = "float32", lr: float = 1e-3):
        self.model = model
        self.precision = precision
        self.lr = lr
        self.dtype = model_dtype(precision)
        if any(p.dtype != self.dtype for p in model.parameters()):
            raise ValueError(f"precision {precision!r} needs the model's parameters in {self.dtype}; "
                             f"build it with zeronb.models.make_model(cfg, dtype={self.dtype})")
        self.names = {p: n for n, p in model.named_parameters()}

    def loss(self, x, y) -> torch.Tensor:
        return self.model.loss(self.model(x), y)

    def train_step(self, x, y) -> float:
        """One step on this rank's batch: forward, backward (the stage's hooks fire inside it),
        then the stage's communication and optimizer step. Returns the local loss."""
        loss = self.loss(x, y)
        loss.backward()
        self.step()
        return loss.item()

    def step(self) -> None:
        raise NotImplementedError

    def state_tensors(self) -> dict:
        raise NotImplementedError

    def full_parameters(self) -> dict:
        """{name: tensor} of the whole model, on every rank (stages that shard parameters gather)."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}
