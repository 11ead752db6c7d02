"""Every process group and device mesh zeronb makes, in one place, made once per default process
group (each costs connections, and dies with the group it belongs to):

    sharding_groups(g)   # (shard group, replica group): shard over g consecutive ranks, replicate across (HSDP)
    node_groups()        # (this rank's node, its cross-node ring): the same layout, g = ranks per node
    device_mesh(s, r)    # the DeviceMesh of the same layout, for DTensors, FSDP2 and DCP

Every group torch makes in a rank of a pool on several nodes, these and a learner's own, is
announced to zeronb.runtime.links before it is handed back (compat.after_new_group), so that its
connections are paced from their first byte. Above zeronb.runtime.backend and .topology; below
the collectives and the stages, which take their groups from here.

One exception, torch's: FSDP2 told to reshard a unit to the ranks of a node after its forward
(`reshard_after_forward=g`, PyTorch's counterpart of ZeRO++'s hpZ, zeronb.zero.torch_impls) makes
a mesh of its own for each unit inside `fully_shard`; its API takes a number there, not a mesh.
"""
from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .backend import device
from .topology import Topology

_per_world: dict = {}  # what belongs to the current default process group, by key


def per_world(key, make):
    """What `make()` returns, made once per process group (its subgroups, a device mesh): each
    costs connections, and dies with the group that it belongs to, so a new group starts afresh."""
    if _per_world.get("world") is not dist.group.WORLD:
        _per_world.clear()
        _per_world["world"] = dist.group.WORLD
    if key not in _per_world:
        _per_world[key] = make()
    return _per_world[key]


def device_mesh(shards: int, replicas: int = 1, group=None):
    """The DeviceMesh of the sharding ranks (DTensors, FSDP2, DCP): 1-D over all ranks or over
    `group`; with replicas 2-D, (replicas, shards), shards consecutive as sharding_groups
    lays them out (FSDP2 replicates over dimension 0). Made once per process group."""
    kind = device().type
    if group is not None:
        return per_world(("mesh", kind, group), lambda: DeviceMesh.from_group(group, kind))
    shape, names = ((shards,), ("shard",)) if replicas == 1 else ((replicas, shards), ("replicate", "shard"))
    return per_world(("mesh", kind, shape), lambda: init_device_mesh(kind, shape, mesh_dim_names=names))


def sharding_groups(shard_size: int) -> tuple:
    """(shard group, replica group) of this rank for sharding over `shard_size` consecutive ranks
    and replicating across the groups (HSDP): with 4 ranks and shard_size 2, ranks {0, 1} and
    {2, 3} each hold one copy of the shards, and ranks {0, 2} and {1, 3} average their gradients.
    The two dimensions of `device_mesh(shard_size, replicas)`, so that zeronb's stages and FSDP2
    share one layout and one set of groups. Every rank must call this (making a group is collective)."""
    n = dist.get_world_size()
    if shard_size < 1 or n % shard_size:
        raise ValueError(f"shard_size must divide the {n} ranks, not {shard_size}")
    if shard_size == n:
        return None, None
    mesh = device_mesh(shard_size, n // shard_size)  # (replicas, shards): row r holds ranks r*g .. r*g + g-1
    return mesh.get_group("shard"), mesh.get_group("replicate")


def node_groups() -> tuple:
    """(this rank's node group, its cross-node group: the ranks with the same local rank, one per
    node), made once per process group; every rank must call it (making a group is collective).
    The same layout as `sharding_groups`: shards within a node, replicas across."""
    return sharding_groups(Topology.from_env().per_node)
