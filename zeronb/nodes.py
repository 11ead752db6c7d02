"""Nodes on one machine: which rank sits on which node, and a slow link between the nodes that the
kernel makes real.

A pool started with `nodes=k` numbers its ranks node-major, as torchrun does on k machines of g
processes each: rank r is local rank r % g on node r // g, with LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK and NODE_RANK set accordingly (`Topology.from_env()` reads them back, here or under
torchrun on a real cluster).

With `inter_node_bandwidth`, every TCP connection between ranks on different nodes is paced by the
kernel (the socket option SO_MAX_PACING_RATE, Linux; no privileges needed): each end may send at
most that many bytes per second on it. `intra_node_bandwidth` paces the connections within a node
the same way (unpaced otherwise: loopback, as fast as the CPU copies). What this models: one link
per pair of ranks, each direction at the given rate, like one NIC per GPU with a non-blocking
network between them. What it does not: a NIC shared by a node's GPUs, switch contention, latency
(the pacing adds none), NVLink's and NCCL's own algorithms.

The connections are gloo's, opened in C++ whenever a process group is made, so a rank finds them
where the kernel lists them (/proc/self/fd). To tell which rank is at the other end, every rank
publishes the local address of each of its connections in the rendezvous store; a connection's
peer address is some rank's local address. `Links` does this when the pool starts and each time
torch makes a process group in the rank (`new_group`, a DeviceMesh: compat.after_new_group), before
the group is handed back, waiting for the peers' entries: a connection is paced before it carries
its first byte, whoever made the group. A background thread looks again every 50 ms, for
connections opened any other way. The kernel itself lets the first ten segments of every TCP
connection out unpaced (as the fq scheduler does; `tcp_update_skb_after_send`): up to 640 KiB on
loopback, whose segments are up to 64 KiB. Timings that matter run an untimed round first.
"""
from __future__ import annotations

import os
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # Linux: include/uapi/asm-generic/socket.h
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


def check_links(world_size: int, nodes: int, inter_node_bandwidth=None, intra_node_bandwidth=None) -> dict:
    """The pool's link settings, checked before anything starts: {"inter": bytes/s or None, "intra": ...}.
    Pacing needs Linux (the socket option); elsewhere asking for it is an error that says so."""
    topology = Topology(world_size, nodes)
    links = {"inter": parse_rate(inter_node_bandwidth), "intra": parse_rate(intra_node_bandwidth)}
    if links["inter"] is not None and topology.nodes == 1:
        raise ValueError("inter_node_bandwidth needs nodes > 1: with one node there is no link between nodes")
    if any(v is not None for v in links.values()) and not os.path.isdir("/proc/self/fd"):
        raise ValueError("pacing links needs Linux (SO_MAX_PACING_RATE, /proc/self/fd); on this system start "
                         "the pool without inter_node_bandwidth / intra_node_bandwidth (the nodes stay a topology)")
    return links


def node_groups() -> tuple:
    """(this rank's node group, its cross-node group: the ranks with the same local rank, one per
    node), made once per process group; every rank must call it (making a group is collective)."""
    from .zero import sharding_groups  # the same layout: shards within a node, replicas across

    return sharding_groups(Topology.from_env().per_node)


def link_environment(links: dict) -> dict:
    """The environment variables a rank reads its link rates from."""
    env = {}
    for key, name in (("inter", INTER_ENV), ("intra", INTRA_ENV)):
        if links.get(key) is not None:
            env[name] = str(links[key])
    return env


# --- inside a rank: find gloo's connections, tell who is at the other end, pace them ------------

def connections() -> dict:
    """{(local address, peer address): fd} for this process's connected TCP sockets, except those to
    the notebook (control channel, rendezvous store: peer port ZERONB_PORT or MASTER_PORT)."""
    skip = {int(os.environ[k]) for k in ("ZERONB_PORT", "MASTER_PORT") if os.environ.get(k)}
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(name)))  # a copy: family and type read from the fd
        except OSError:
            continue
        with s:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                peer, local = s.getpeername()[:2], s.getsockname()[:2]
            except OSError:  # listening, or not connected
                continue
            if peer[1] not in skip:
                out[(local, peer)] = int(name)
    return out


UNPACED = 2**32 - 1  # ~0U: the kernel's "no limit"


def set_pacing(fd: int, rate: int) -> None:
    """Pace the socket behind `fd`: at most `rate` bytes per second sent on it (UNPACED: no limit)."""
    with socket.socket(fileno=os.dup(fd)) as s:
        s.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("I" if rate <= UNPACED else "Q", rate))


def _key(address) -> str:
    return f"zeronb-links/{address[0]}:{address[1]}"


class Links:
    """Inside a rank of a pool on several nodes: who is at the other end of each of this rank's
    connections (`peer_rank`), and, with rates, the pacing of those that cross nodes (`inter`) and
    of those within the node (`intra`)."""

    def __init__(self, store_address: tuple, rank: int, topology: Topology, inter: int | None = None,
                 intra: int | None = None, poll_s: float = 0.05):
        import torch.distributed as dist

        self.rank, self.topology, self.rates = rank, topology, {"inter": inter, "intra": intra}
        self._store_address, self._poll_s = store_address, poll_s
        self._store = dist.TCPStore(*store_address, is_master=False, timeout=timedelta(seconds=60))
        self.peer_rank: dict = {}   # (local address, peer address) -> rank at the other end
        self._published: set = set()
        self._lock = threading.Lock()

    def _publish(self, store, conns) -> None:
        for local, _ in conns:
            if local not in self._published:
                store.set(_key(local), str(self.rank))
                self._published.add(local)

    def _classify(self, store, conns, wait: bool) -> None:
        for (local, peer), fd in conns.items():
            if (local, peer) in self.peer_rank:
                continue
            if not wait and not store.check([_key(peer)]):
                continue  # the peer has not published it yet: next time
            other = int(store.get(_key(peer)))
            kind = "inter" if self.topology.node_of(other) != self.topology.node_of(self.rank) else "intra"
            if self.rates[kind] is not None:
                try:
                    set_pacing(fd, self.rates[kind])
                except OSError as e:
                    raise RuntimeError(f"could not pace a link ({e}): this kernel lacks SO_MAX_PACING_RATE; start the "
                                       "pool without inter_node_bandwidth / intra_node_bandwidth") from e
            self.peer_rank[(local, peer)] = other

    def update(self) -> None:
        """Find every connection now open, publish ours, and classify (and pace) each one, waiting
        for its peer to publish its own (every rank publishes, now or from its background thread)."""
        with self._lock:
            conns = connections()
            self._publish(self._store, conns)
            self._classify(self._store, conns, wait=True)

    def start(self) -> "Links":
        """Update now and after every process group made from now on; look for other new
        connections in the background."""
        from .compat import after_new_group

        self.update()
        after_new_group(update_links)
        threading.Thread(target=self._watch, name="zeronb-links", daemon=True).start()
        return self

    def _watch(self) -> None:
        import torch.distributed as dist

        store = dist.TCPStore(*self._store_address, is_master=False, timeout=timedelta(seconds=60))
        while True:
            time.sleep(self._poll_s)
            try:
                with self._lock:
                    conns = connections()
                    self._publish(store, conns)
                    self._classify(store, conns, wait=False)
            except Exception:  # a socket closed meanwhile, the store going away at exit: try again
                continue

    def set_rates(self, inter: int | None, intra: int | None) -> None:
        """Pace every known connection at new rates (None: unpaced), and the ones to come."""
        with self._lock:
            self.rates = {"inter": inter, "intra": intra}
            for (local, peer), fd in connections().items():
                other = self.peer_rank.get((local, peer))
                if other is not None:
                    kind = "inter" if self.topology.node_of(other) != self.topology.node_of(self.rank) else "intra"
                    set_pacing(fd, self.rates[kind] if self.rates[kind] is not None else UNPACED)

    def crosses_nodes(self, connection) -> bool:
        """Whether a (local address, peer address) connection leads to another node."""
        if connection not in self.peer_rank:
            self.update()
        return self.topology.node_of(self.peer_rank[connection]) != self.topology.node_of(self.rank)


_links: Links | None = None  # this rank's, in a pool on several nodes


def start_links(store_address: tuple, rank: int) -> Links | None:
    """In a rank of a pool: on several nodes, start telling its links apart (and pacing them, as
    the environment says); on one node, nothing. Called again after a new process group."""
    global _links
    topology = Topology.from_env()
    if topology.nodes == 1:
        return None
    if _links is None:
        inter, intra = (int(os.environ[k]) if os.environ.get(k) else None for k in (INTER_ENV, INTRA_ENV))
        _links = Links(store_address, rank, topology, inter, intra).start()
    else:
        _links.update()
    return _links


def set_link_rates(inter_node_bandwidth=None, intra_node_bandwidth=None) -> None:
    """In every rank of a pool on several nodes (zeronb.run(set_link_rates, "20MB/s")): pace its links
    at new rates from now on, without restarting the pool (None: unpaced). For sweeps over link
    speeds; a pool's own settings stay what it was started with."""
    if _links is None:
        raise RuntimeError("set_link_rates needs a pool on several nodes: zeronb.start(world_size=4, nodes=2)")
    _links.set_rates(parse_rate(inter_node_bandwidth), parse_rate(intra_node_bandwidth))


def update_links() -> None:
    """Classify and pace the connections opened since the last look. Called after every process
    group torch makes in a rank of a pool on several nodes; without nodes it does nothing."""
    if _links is not None:
        _links.update()


def split_by_node(by_connection: dict) -> dict | None:
    """{"within": bytes, "across": bytes}: `by_connection`'s bytes by whether each connection's peer
    is on this rank's node; None in a process not started on several nodes of a pool."""
    if _links is None:
        return None
    out = {"within": 0, "across": 0}
    for connection, nbytes in by_connection.items():
        out["across" if _links.crosses_nodes(connection) else "within"] += nbytes
    return out
