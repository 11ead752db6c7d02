"""Inside a rank of a pool on several nodes: who is at the other end of each of its connections,
and a slow link between the nodes that the kernel makes real.

With `inter_node_bandwidth`, every TCP connection between ranks on different nodes is paced by the
kernel (zeronb.runtime.sockets.set_pacing): each end may send at most that many bytes per second
on it. `intra_node_bandwidth` paces the connections within a node the same way (unpaced otherwise:
loopback, as fast as the CPU copies). What this models: one link per pair of ranks, each direction
at the given rate, like one NIC per GPU with a non-blocking network between them. What it does
not: a NIC shared by a node's GPUs, switch contention, latency (the pacing adds none), NVLink's
and NCCL's own algorithms.

To tell which rank is at the other end of a connection, every rank publishes the local address of
each of its connections in the rendezvous store; a connection's peer address is some rank's local
address. `Links` does this when the pool starts and each time torch makes a process group in the
rank (zeronb.runtime.groups' groups, a learner's `new_group`, a DeviceMesh: all go through
compat.after_new_group), before the group is handed back, waiting for the peers' entries: a
connection is paced before it carries its first byte, whoever made the group. A background thread
looks again every 50 ms, for connections opened any other way. The kernel itself lets the first
ten segments of every TCP connection out unpaced (as the fq scheduler does;
`tcp_update_skb_after_send`): up to 640 KiB on loopback, whose segments are up to 64 KiB. Timings
that matter run an untimed round first.
"""
from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from .compat import after_new_group
from .sockets import UNPACED, connections, set_pacing
from .topology import INTER_ENV, INTRA_ENV, Topology, parse_rate


def _key(address) -> str:
    return f"zeronb-links/{address[0]}:{address[1]}"


class Links:
    """Inside a rank of a pool on several nodes: who is at the other end of each of this rank's
    connections (`peer_rank`), and, with rates, the pacing of those that cross nodes (`inter`) and
    of those within the node (`intra`)."""

    def __init__(self, store_address: tuple, rank: int, topology: Topology, inter: int | None = None,
                 intra: int | None = None, poll_s: float = 0.05):
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
        self.update()
        after_new_group(update_links)
        threading.Thread(target=self._watch, name="zeronb-links", daemon=True).start()
        return self

    def _watch(self) -> None:
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
