"""The α–β cost model with two kinds of link (chapter 5's model, chapter 13's nodes): a message of
S bytes over a link takes α + β·S seconds, α the link's latency per step and β its seconds per byte
(1/β its bandwidth), with one (α, β) within a node and another between nodes.

A ring over n ranks takes 2(n−1) steps for an all-reduce, each moving S/n bytes over every link at
once, so its time is set by its slowest link:

    flat ring over N ranks on k nodes        2(N−1)·α_out + 2(N−1)/N · S · β_out
    hierarchical (zeronb.collectives)        2(g−1)·α_in + 2(g−1)/g · S · β_in          within the node
                                           + 2(k−1)·α_out + 2(k−1)/k · (S/g) · β_out  across, on a shard

with g = N/k ranks per node. `fit` reads (α, β) for a link from single messages sent over it (this
pool's own measurements); `at_scale` applies the same model to published link speeds. It assumes one link per pair of ranks, each direction at full speed, no contention,
and that a ring's steps pipeline perfectly; what it leaves out is what the measurements show.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per step
    beta: float   # seconds per byte

    @property
    def bandwidth(self) -> float:
        return 1 / self.beta


def ring_all_reduce(nbytes: float, n: int, link: Link) -> float:
    """A ring all-reduce of `nbytes` over n ranks whose slowest link is `link`."""
    return 0.0 if n == 1 else 2 * (n - 1) * link.alpha + 2 * (n - 1) / n * nbytes * link.beta


def flat_all_reduce(nbytes: float, nodes: int, per_node: int, intra: Link, inter: Link) -> float:
    """One ring over all N = nodes·per_node ranks: across nodes at least one link is between nodes,
    and every step waits for it."""
    return ring_all_reduce(nbytes, nodes * per_node, inter if nodes > 1 else intra)


def hierarchical_all_reduce(nbytes: float, nodes: int, per_node: int, intra: Link, inter: Link) -> float:
    """Reduce-scatter within the node, all-reduce of the shard across nodes, all-gather within."""
    return ring_all_reduce(nbytes, per_node, intra) + ring_all_reduce(nbytes / per_node, nodes, inter)

def fit_alpha_beta(sizes, seconds) -> tuple[float, float]:
    """Fit t = alpha + beta * S, alpha the latency (s) and beta seconds per byte, by least squares
    on relative errors: each point's residual is divided by its measured time (weights 1/t), so
    that every size counts alike. (In plain seconds the largest sizes would decide everything and
    alpha would be their noise.) `fit_residuals` says how far the line misses each point."""
    t = np.asarray(seconds, float)
    beta, alpha = np.polyfit(np.asarray(sizes, float), t, 1, w=1 / t)
    return float(alpha), float(beta)


def fit_residuals(sizes, seconds, alpha: float, beta: float) -> list[float]:
    """(measured - fitted) / fitted at each size: positive where a call was slower than the line."""
    return [t / (alpha + beta * s) - 1 for s, t in zip(sizes, seconds)]



def fit(timings: list) -> Link:
    """(α, β) of a link from [(bytes, seconds)] of single messages sent over it, one way: the model's
    t = α + β·S for one message, fitted on relative errors (`fit_alpha_beta`)."""
    sizes, seconds = zip(*timings)
    alpha, beta = fit_alpha_beta(sizes, seconds)
    return Link(max(alpha, 0.0), beta)


def at_scale(nbytes: float, nodes: int, per_node: int, intra: Link, inter: Link) -> dict:
    """Communication time of one step's gradients and parameters for DDP, ZeRO-3, HSDP and ZeRO++
    (hpZ), from the model: `nbytes` the model's parameters (or gradients) in bytes. Every collective
    is a ring; ZeRO-3's all-gathers and reduce-scatter each cost half a flat all-reduce."""
    flat = flat_all_reduce(nbytes, nodes, per_node, intra, inter)
    within = ring_all_reduce(nbytes, per_node, intra)
    return {
        "DDP": flat,                                                  # one all-reduce
        "ZeRO-3": 1.5 * flat,                                         # all-gather x2 + reduce-scatter, all over N
        "HSDP": 1.5 * within + ring_all_reduce(nbytes / per_node, nodes, inter),  # ZeRO-3 in the node + the shard
        "ZeRO++ hpZ": 1.0 * flat + 0.5 * within,                      # forward gather and reduce-scatter over N
    }


def bytes_across(variant: str, unit_bytes: list, nodes: int, per_node: int, *, reduce_scatter_passes: int = 1,
                 last_unit_kept: bool = True) -> float:
    """Bytes all ranks together send across nodes in one training step, every collective a ring over
    node-major ranks. A pass (all-gather or reduce-scatter) of S bytes over all N ranks sends
    (N−1)/N·S from each rank, and the k ranks at the ring's node boundaries send theirs across:
    k(N−1)/N·S. `unit_bytes`: each unit's parameters in bytes, padded to a multiple of N, in forward
    order (DDP: one unit, the gradients). `reduce_scatter_passes`: 2 where the backend runs a
    reduce-scatter as a whole all-reduce (PyTorch's gloo process group does). `last_unit_kept`: the
    last unit stays gathered from its forward to its backward, one all-gather fewer (False: every
    unit is gathered twice).

        DDP      an all-reduce: two passes of M
        ZeRO-3   all-gathers before forward (M) and backward (M, less the last unit if kept), a reduce-scatter (M)
        hpZ      the backward's all-gathers within the node: only forward's and the reduce-scatter cross
        HSDP     within the node only, but the replicas' all-reduce of each rank's shard M/g over the k
                 nodes: 2(k−1)/k·M/g from every rank (MiCS: the same, once per step)"""
    N, k, g = nodes * per_node, nodes, per_node
    M, last = sum(unit_bytes), unit_bytes[-1]
    per_pass = k * (N - 1) / N
    rs = reduce_scatter_passes
    backward = M - last if last_unit_kept else M        # the backward's all-gathers over N ranks
    if variant == "DDP":
        return 2 * per_pass * M
    if variant == "ZeRO-3":
        return per_pass * (M + backward + rs * M)
    if variant == "hpZ":
        return per_pass * (M + rs * M)
    if variant in ("HSDP", "MiCS"):
        return N * 2 * (k - 1) / k * M / g
    raise ValueError(f"no formula for {variant!r}: DDP, ZeRO-3, hpZ, HSDP or MiCS")
