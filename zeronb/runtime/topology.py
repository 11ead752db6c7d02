"""Ranks on nodes, as a pool or torchrun numbers them, and the link speeds a pool is started with.

A pool started with `nodes=k` numbers its ranks node-major, as torchrun does on k machines of g
processes each: rank r is local rank r % g on node r // g, with LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK and NODE_RANK set accordingly (`Topology.from_env()` reads them back, here or under
torchrun on a real cluster). The link rates travel to the ranks in two environment variables
(`link_environment`); zeronb.runtime.links paces the connections with them.

Imports nothing from zeronb.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

INTER_ENV, INTRA_ENV = "ZERONB_INTER_NODE_BPS", "ZERONB_INTRA_NODE_BPS"  # what a rank reads: bytes per second

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1024, "m": 1e6, "mb": 1e6, "mib": 1 << 20,
          "g": 1e9, "gb": 1e9, "gib": 1 << 30}


def parse_rate(rate) -> int | None:
    """Bytes per second, from a number or a string such as "50MB/s", "100 MiB/s", "2.5GB/s" or
    "400Gbit/s" (MB = 1e6 bytes, MiB = 2**20). None stays None: no pacing."""
    if rate is None:
        return None
    if isinstance(rate, bool):
        raise ValueError(f"a bandwidth must be a number of bytes per second or a string like '50MB/s', not {rate!r}")
    if isinstance(rate, (int, float)):
        value = float(rate)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmg]?i?b?)(it)?\s*(/\s*s)?\s*", str(rate), re.IGNORECASE)
        if not m or (m.group(3) and not m.group(2).lower().endswith("b")):
            raise ValueError(f"cannot read the bandwidth {rate!r}: write bytes per second, e.g. '50MB/s', "
                             "'100 MiB/s' or '400Gbit/s'")
        unit = m.group(2).lower()
        value = float(m.group(1)) * _UNITS[unit] / (8 if m.group(3) else 1)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"a bandwidth must be a positive, finite number of bytes per second, not {rate!r}")
    return int(value)


def human_rate(bps: float) -> str:
    return f"{bps / 1e9:.3g} GB/s" if bps >= 1e9 else f"{bps / 1e6:.3g} MB/s"


@dataclass(frozen=True)
class Topology:
    """`nodes` nodes of `per_node` ranks each, numbered node-major."""
    world_size: int
    nodes: int

    def __post_init__(self):
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1 \
                or self.world_size % self.nodes:
            raise ValueError(f"nodes must be a positive int that divides world_size={self.world_size}, "
                             f"not {self.nodes!r}")

    @property
    def per_node(self) -> int:
        return self.world_size // self.nodes

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.per_node

    def ranks_on(self, node: int) -> list[int]:
        return list(range(node * self.per_node, (node + 1) * self.per_node))

    def same_local_rank(self, local: int) -> list[int]:
        """The ranks with this local rank, one per node: who a cross-node collective connects."""
        return [node * self.per_node + local for node in range(self.nodes)]

    @classmethod
    def from_env(cls) -> "Topology":
        """The topology this process was started in: WORLD_SIZE and LOCAL_WORLD_SIZE, as torchrun and
        a zeronb pool set them (one node when LOCAL_WORLD_SIZE is absent)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return cls(world, world // per_node)


def link_environment(links: dict) -> dict:
    """The environment variables a rank reads its link rates from."""
    env = {}
    for key, name in (("inter", INTER_ENV), ("intra", INTRA_ENV)):
        if links.get(key) is not None:
            env[name] = str(links[key])
    return env
