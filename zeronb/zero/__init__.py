"""The ZeRO stages, one short module each: ddp (stage 0), zero1, zero2, zero3 (and FSDP's options),
zeropp (ZeRO-3 with ZeRO++'s hpZ and qwZ, for several nodes), behind one interface (stage.Stage)
and one config (config.StageConfig); PyTorch's counterparts behind the same interface
(torch_impls), and DeepSpeed's own ZeRO stages 1-3 (deepspeed_engine); and what watches a stage from outside (observe):

    stage = ZeRO1(model, StageConfig(precision="float32", lr=1e-3))
    loss = stage.train_step(x, y)        # forward, backward, communication, optimizer step
    stage.state_tensors()                # {"params": [...], "grads": [...], "optimizer": [...]}
    stage.full_parameters()              # {name: full tensor}, gathered if sharded

What zeronb's stages share is in flat.py (FlatStage: gradient hooks, the collectives on buckets,
the one division by N), buckets.py (parameters in flat buffers, their gradients' state and
collectives during a step), optim.py (the optimizer on a rank's shards) and saving.py (what a
stage saves and loads, and which piece of each parameter its shards hold).

May import the lessons (zeronb.collectives, .shards, .memory, .precision, .ledger, ...) and
zeronb.runtime (process groups come from zeronb.runtime.groups); not the pool, training or book.
"""
from .config import StageConfig
from .ddp import DDP, NaiveDDP
from .stage import Stage
from .zero1 import ZeRO1
from .zero2 import ZeRO2
from .zero3 import ZeRO3
from .zeropp import ZeROPlusPlus

STAGES = {0: DDP, 1: ZeRO1, 2: ZeRO2, 3: ZeRO3}

__all__ = ["DDP", "NaiveDDP", "ZeRO1", "ZeRO2", "ZeRO3", "ZeROPlusPlus", "STAGES", "Stage", "StageConfig"]
