"""The ZeRO stages, one short module each: ddp (stage 0), zero1, zero2, zero3 (and FSDP's options).

Every stage is a class with the same small interface, so that a training loop, the train CLI and
the chapters can swap one for another:

    engine = ZeRO1(model, precision="float32", lr=1e-3)
    loss = engine.train_step(x, y)       # forward, backward, communication, optimizer step
    engine.state_tensors()               # {"params": [...], "grads": [...], "optimizer": [...]}
    engine.full_parameters()             # {name: full tensor}, gathered if sharded
"""
from .ddp import DDP, NaiveDDP
from .zero1 import ZeRO1
from .zero2 import ZeRO2
from .zero3 import ZeRO3

STAGES = {0: DDP, 1: ZeRO1, 2: ZeRO2, 3: ZeRO3}

__all__ = ["DDP", "NaiveDDP", "ZeRO1", "ZeRO2", "ZeRO3", "STAGES"]
