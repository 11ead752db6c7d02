"""ZeRO++ (Wang et al. 2023): ZeRO-3 with less traffic between nodes, two of its three ways.

ZeRO-3 gathers every unit's parameters twice a step over all N ranks, forward and backward, and
reduce-scatters the gradients over all of them: on k nodes most of those bytes cross the slow links
between nodes (zeronb.runtime.links). ZeRO++ cuts them in three ways; this stage does the first two.

hpZ (hierarchical partitioning): when a unit has been gathered for its forward, each rank also keeps
a *secondary* copy of the unit's parameters sharded over its own node only (1/g of the unit, g
ranks per node), and the backward gathers from those secondary shards, inside the node. The
backward's all-gather leaves the slow links; the cost is the secondary shards, Ψ/g per rank from
the forward until the optimizer step, which changes the parameters and so invalidates them (as
DeepSpeed does: a cache of the weights, dropped after each step).

qwZ (quantized weights): the forward's all-gather sends each shard as int8, with one fp32 scale per
block of BLOCK elements (its largest magnitude / 127), and every rank dequantizes what arrives. A
quarter of float32's bytes (an eighth of float64's), plus the scales; the forward then computes
with weights off by at most half a quantization step per block. The backward gathers the exact
weights (or, with hpZ, the secondary copy of what the forward used).

qgZ, ZeRO++'s quantized hierarchical all-to-all for gradients, is not built: DeepSpeed's own runs
compiled INT4 kernels (its node size, `device_count()`, could be set: LOCAL_SIZE on its CPU
accelerator, CUDA_VISIBLE_DEVICES on a GPU box); the gradients here go through ZeRO-3's
reduce-scatter unchanged.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime.compat import all_gather_single
from ..runtime.groups import node_groups
from ..runtime.topology import Topology
from .zero3 import Unit, ZeRO3

QUANTIZE_WEIGHTS = (None, "int8")  # qwZ: the forward all-gathers unquantized, or in int8
BLOCK = 256  # elements per quantization scale (ZeRO++ quantizes block by block, a scale each)


def quantize_int8(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, one float32 scale per block): x ≈ values * scale, blockwise, the last block
    padded with zeros."""
    flat = x.detach().reshape(-1).float()
    padded = torch.zeros(-(-flat.numel() // block) * block, dtype=torch.float32, device=x.device)
    padded[:flat.numel()] = flat
    blocks = padded.view(-1, block)
    scale = blocks.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
    return torch.round(blocks / scale[:, None]).to(torch.int8).view(-1), scale


def dequantize_int8(values: torch.Tensor, scale: torch.Tensor, numel: int, block: int = BLOCK) -> torch.Tensor:
    return (values.view(-1, block).float() * scale[:, None]).view(-1)[:numel]


class ZeROPlusPlus(ZeRO3):
    """ZeRO-3 with hpZ (`hpz=True`: backward gathers within the node) and/or qwZ
    (`quantize_weights="int8"`: the forward gathers int8). Other arguments: ZeRO3's."""

    def __init__(self, model, config=None, observers=(), hpz: bool = False, quantize_weights: str | None = None,
                 **zero3):
        super().__init__(model, config, observers, **zero3)
        if quantize_weights not in QUANTIZE_WEIGHTS:
            raise ValueError(f"quantize_weights must be None or 'int8', not {quantize_weights!r}")
        self.hpz, self.quantize_weights = hpz, quantize_weights
        if hpz:
            if Topology.from_env().nodes == 1:
                raise ValueError("hpz keeps a copy of the parameters sharded within a node: it needs a pool on "
                                 "several nodes (zeronb.start(world_size=4, nodes=2), or --nodes 2)")
            if self.replica_group is not None:
                raise ValueError("hpz is ZeRO-3 over every rank with a second copy sharded within the node; with "
                                 "replicas (shard_size, shard_group) the node holds whole copies already: use one")
            self.node_group, _ = node_groups()  # this rank's place in it, and its size, are the group's
        self.secondary: dict = {}  # hpZ: unit index -> this rank's secondary shard, from forward to the step
        self.in_backward = False

    def begin_micro_batch(self):
        super().begin_micro_batch()
        self.in_backward = False

    def pre_backward(self, u):
        self.in_backward = True
        super().pre_backward(u)

    def post_forward(self, u, out):
        if self.hpz:  # this rank's 1/g of the unit, while it is here: what the node gathers in backward
            node = self.node_group
            self.secondary[u.index] = u.piece(dist.get_rank(node), dist.get_world_size(node)).clone()
        super().post_forward(u, out)

    def issue_unshard(self, u: Unit):
        if self.in_backward and self.hpz and u.index in self.secondary:  # within the node: the secondary shards
            secondary = self.secondary[u.index]
            u.unshard_with(lambda: u.all_gather(secondary, self.node_group, async_op=True))
        elif not self.in_backward and self.quantize_weights:
            u.unshard_with(*self._quantized_gather(u))
        else:
            super().issue_unshard(u)

    def _quantized_gather(self, u: Unit):
        """qwZ's gather as (start, complete): every rank's shard in int8 with its scales, in one message;
        then each rank's piece dequantized into the unit's buffer."""
        sent = {}

        def start():
            values, scale = quantize_int8(u.own_chunk)
            packed = torch.cat([values, scale.view(torch.int8)])  # one message: the values and their scales
            sent.update(full=packed.new_empty(self.num_shards * packed.numel()), n=values.numel())
            return all_gather_single(sent["full"], packed, group=self.shard_group, async_op=True)

        def complete():
            n = sent["n"]
            for r, row in enumerate(sent["full"].view(self.num_shards, -1)):
                u.fill_chunk(r, dequantize_int8(row[:n], row[n:].view(torch.float32), u.chunk_numel))
        return start, complete

    def step(self):
        super().step()
        self.secondary.clear()  # the shards changed: the copies of the old weights are stale

    def state_tensors(self):
        held = super().state_tensors()
        held["params"] = held["params"] + list(self.secondary.values())
        return held
