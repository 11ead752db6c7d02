"""The hierarchical all-reduce across nodes (Horovod's, after Thakur et al.): three rings - within
each node, across the nodes on a shard, within each node again - so that most bytes stay on the
fast links inside the nodes (zeronb.runtime.topology: which rank sits on which node)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime.groups import node_groups
from ..runtime.topology import Topology
from .checks import check_float
from .ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter


def hierarchical_all_reduce(tensor: torch.Tensor, *, average: bool = False, groups=None) -> torch.Tensor:
    """In place: `tensor` becomes the element-wise sum (or average) over all ranks, in three hops
    that keep most of the bytes inside the nodes (zeronb.runtime.topology; Horovod's hierarchical all-reduce,
    after Thakur et al.): a ring reduce-scatter within this rank's node leaves it 1/g of the node's
    sum (g ranks per node); a ring all-reduce of that shard across the k nodes, among the ranks with
    the same local rank, makes it the shard of the total; a ring all-gather within the node hands
    every rank all of it. Each rank sends 2(g-1)/g * S within its node and 2(k-1)/k * S/g across,
    where a flat ring sends 2(N-1)/N * S, and on some links all of it, across. Returns `tensor`.

    `groups`: (within, across) process groups to use in place of the pool's nodes (zeronb.runtime.groups.
    node_groups()), for instance groups that assume another placement of the ranks on the nodes."""
    check_float(tensor, "hierarchical_all_reduce", average)
    topology = Topology.from_env()
    if groups is None and (topology.nodes == 1 or topology.per_node == 1):  # one level only: one ring
        return ring_all_reduce(tensor, average=average)
    within, across = groups or node_groups()
    flat = tensor.detach().reshape(-1)
    shard = ring_reduce_scatter(flat, group=within)   # 1. this rank's shard of its node's sum
    ring_all_reduce(shard, group=across)              # 2. + the same shard of every other node's
    full = ring_all_gather(shard, flat.numel(), group=within)  # 3. every shard, within the node
    if average:
        full.div_(dist.get_world_size())
    tensor.copy_(full.view_as(tensor))
    return tensor
