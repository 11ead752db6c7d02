"""How a flat tensor is split into per-rank shards: the one definition every module uses.

The rule (the one FSDP and ZeRO use, and `torch.chunk` too): pad the tensor with zeros at the end
to a multiple of the world size N, cut the padded tensor into N equal chunks of
`chunk_size = ceil(numel / N)` elements, and give chunk r to rank r. A rank's *shard* is the part of
its chunk that holds real elements:

    numel = 10, N = 4  ->  chunk_size 3, padded to 12
    rank 0: [0, 3)   rank 1: [3, 6)   rank 2: [6, 9)   rank 3: [9, 10)  (+ 2 elements of padding)

Equal chunks are what the collectives need (a ring moves one chunk per step; all_gather_single and
reduce_scatter_single take equal sizes). The cost is at most N-1 elements of padding, all of it on
the last ranks; when numel < N, the last ranks own nothing at all.
"""
from __future__ import annotations


def _check(numel: int, world_size: int) -> None:
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be an int >= 0, not {numel!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, not {world_size!r}")


def chunk_size(numel: int, world_size: int) -> int:
    """Elements per chunk: ceil(numel / world_size)."""
    _check(numel, world_size)
    return -(-numel // world_size)


def padded_numel(numel: int, world_size: int) -> int:
    """numel rounded up to a multiple of world_size: the size the collectives actually move."""
    return chunk_size(numel, world_size) * world_size


def padding(numel: int, world_size: int) -> int:
    """How many zeros are appended: between 0 and world_size - 1."""
    return padded_numel(numel, world_size) - numel


def chunk_bounds(numel: int, world_size: int, index: int) -> tuple[int, int]:
    """(start, stop) of chunk `index` in the *padded* tensor: always chunk_size long."""
    c = chunk_size(numel, world_size)
    if not 0 <= index < world_size:
        raise ValueError(f"chunk index must be in 0..{world_size - 1}, not {index}")
    return index * c, (index + 1) * c


def bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """(start, stop) of the real elements rank `rank` owns; empty (start == stop) when it owns none."""
    start, stop = chunk_bounds(numel, world_size, rank)
    return min(start, numel), min(stop, numel)


def shard_numel(numel: int, world_size: int, rank: int) -> int:
    start, stop = bounds(numel, world_size, rank)
    return stop - start


def owner(index: int, numel: int, world_size: int) -> int:
    """The rank that owns element `index` of a flat tensor of `numel` elements."""
    if not 0 <= index < numel:
        raise IndexError(f"element {index} is outside a tensor of {numel} elements")
    return index // chunk_size(numel, world_size)


def all_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """bounds() of every rank, in rank order."""
    return [bounds(numel, world_size, r) for r in range(world_size)]
