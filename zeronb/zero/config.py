"""What every stage is told when it is built: one config, the same for DDP, ZeRO-1, -2, -3 and
PyTorch's counterparts. (What only one stage has - DDP's bucket size, ZeRO-3's prefetch - is an
argument of that stage.)"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..precision import Precision, check_optimizer, precision

REDUCE_SCATTERS = ("torch", "ring")


@dataclass
class StageConfig:
    """precision: "float32", "float64" or "bf16-mixed" (zeronb.precision).
    optimizer, lr: "adam" or "sgd" (plain, no momentum), and its learning rate.
    clip_norm: clip the whole model's gradient to this 2-norm before each optimizer step.
    reduce_dtype: the dtype gradients are communicated in (None: their own; bfloat16 halves the bytes).
    sync_each_micro_batch: with gradient accumulation, communicate gradients after every
        micro-batch (True) or only after the last (False: DDP's no_sync).
    reduce_scatter: "torch" (the backend's) or "ring" (zeronb's ring: on gloo, the wire then shows
        a reduce-scatter's bytes, not the all-reduce gloo runs instead).
    shard_group: the ranks a stage shards over (None: every rank).
    replica_group: ranks that hold the same shards and average their gradients (None: no
        replicas). Sharded within a group of g ranks and replicated across r such groups is HSDP."""
    precision: str = "float32"
    optimizer: str = "adam"
    lr: float = 1e-3
    clip_norm: Optional[float] = None
    reduce_dtype: Optional[torch.dtype] = None
    sync_each_micro_batch: bool = True
    reduce_scatter: str = "torch"
    shard_group: Optional[dist.ProcessGroup] = None
    replica_group: Optional[dist.ProcessGroup] = None

    def __post_init__(self):
        precision(self.precision)
        check_optimizer(self.optimizer)
        if self.reduce_scatter not in REDUCE_SCATTERS:
            raise ValueError(f"reduce_scatter must be one of {', '.join(REDUCE_SCATTERS)}, not {self.reduce_scatter!r}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be a positive norm (or None), not {self.clip_norm!r}")

    @property
    def dtype(self) -> torch.dtype:
        return precision(self.precision).dtype

    @property
    def precision_spec(self) -> Precision:
        return precision(self.precision)
