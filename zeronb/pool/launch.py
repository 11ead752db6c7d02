"""Starting a pool's rank processes on this machine: the rendezvous on loopback, each rank's
environment (what torchrun would set), the fork, and the handshake on the control channel.

    listener, store, key -> fork each rank from the helper (zeronb.pool.forkserver) -> accept one
    authenticated connection per rank -> the ranks join the process group (zeronb.pool._worker)
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Listener

import torch.distributed as dist

from ..runtime.sockets import OTHER_PORTS_ENV
from ..runtime.topology import INTER_ENV, INTRA_ENV, Topology, link_environment, parse_rate
from . import forkserver
from .errors import signal_name
from .messages import WORKER_LOOP_FRAME
from .rank_output import RankOutput


def loopback_interface() -> str:
    """Name of the loopback interface, for GLOO_SOCKET_IFNAME (gloo otherwise binds to whatever the
    hostname resolves to, which may be a public address)."""
    try:
        for _, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    except OSError:
        pass
    return "lo0" if sys.platform == "darwin" else "lo"


def loopback_store(world_size: int, timeout) -> dist.TCPStore:
    """The rendezvous store, hosted by the calling process on 127.0.0.1 and a free port.

    TCPStore binds every interface when it opens its own socket; handing it a socket already bound
    to 127.0.0.1 keeps it off the network. Port 0 lets the OS pick a free port, so two notebooks
    never collide (and nothing races between choosing a port and binding it).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(max(64, world_size))
    port = sock.getsockname()[1]
    # the store owns the listening socket from here on (detach: Python must not close it)
    kw = dict(world_size=None, is_master=True, timeout=timeout, wait_for_workers=False,
              master_listen_fd=sock.detach())
    try:
        store = dist.TCPStore("127.0.0.1", port, **kw)
    except (RuntimeError, ValueError):  # older libuv stores do not take a listening fd
        store = dist.TCPStore("127.0.0.1", port, use_libuv=False, **kw)
    return store


class Rank:
    """The notebook's handle on one rank process: the process, its control connection, its
    output pipes, and the file its Python stack is dumped to on request."""

    def __init__(self, rank: int, proc: forkserver.RankProcess, stack_file: str):
        self.rank, self.proc, self.stack_file = rank, proc, stack_file
        self.output = RankOutput(rank, proc.stdout_fd, proc.stderr_fd)
        self.conn = None
        self.info = {}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def request_stack(self) -> None:
        """Ask the rank for its Python stacks: faulthandler dumps every thread on SIGUSR1, even
        while the rank is blocked inside C++ code (a gloo receive, say)."""
        open(self.stack_file, "w").close()
        try:
            os.kill(self.proc.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass

    def read_stack(self) -> str | None:
        """The dump, once it is complete (it ends with the frames of the rank's main loop)."""
        text = open(self.stack_file).read()
        if not WORKER_LOOP_FRAME.search(text):
            return None
        time.sleep(0.02)  # the last lines of the dump
        return open(self.stack_file).read()

    def kill(self) -> None:
        self.proc.kill()

    def reap(self) -> None:
        """Wait (briefly) until the helper has reaped the process, and close its pipes."""
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self.proc.close()
        if self.conn is not None:
            self.conn.close()


def stack_dumps(ranks: list[Rank], timeout: float = 3.0) -> dict[int, str]:
    """{rank: faulthandler's dump of its threads}, for those of `ranks` still alive. Usually ~0.1 s;
    on a loaded machine a rank may wait over a second to be scheduled and run its handler."""
    alive = [rk for rk in ranks if rk.alive()]
    for rk in alive:
        rk.request_stack()
    dumps: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(dumps) < len(alive) and time.monotonic() < deadline:
        time.sleep(0.02)
        for rk in alive:
            if rk.rank not in dumps and (dump := rk.read_stack()) is not None:
                dumps[rk.rank] = dump
    return dumps


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


def rank_environment(env: dict, *, world_size: int, nodes: int, store_port: int, control, backend: str,
                     threads: int, path: list, links: dict | None = None) -> list[dict]:
    """Each rank's environment: what torchrun sets (RANK, LOCAL_RANK, GROUP_RANK, WORLD_SIZE, ...),
    ranks numbered node-major, and what zeronb's worker reads (the link rates: zeronb.runtime.links)."""
    per_node = world_size // nodes
    common = dict(env)
    common.pop("PYTEST_CURRENT_TEST", None)  # (ipykernel stops capturing subprocess output under it)
    common.update({
        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(per_node),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store_port),
        "ZERONB_HOST": control[0], "ZERONB_PORT": str(control[1]),
        OTHER_PORTS_ENV: str(control[1]),  # the control channel: not a link between ranks
        "ZERONB_BACKEND": backend, "ZERONB_THREADS": str(threads),
        "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
        # one machine: gloo's pairs and NCCL's bootstrap listen on loopback, not the network
        "GLOO_SOCKET_IFNAME": loopback_interface(), "NCCL_SOCKET_IFNAME": loopback_interface(),
        # what a rank launched on its own would see: the notebook's import path (this zeronb,
        # the notebook's own modules: functions from importable modules are pickled by reference)
        "PYTHONPATH": os.pathsep.join(path),
    })
    for name in (INTER_ENV, INTRA_ENV):
        common.pop(name, None)
    common.update(link_environment(links or {}))
    return [dict(common, RANK=str(r), LOCAL_RANK=str(r % per_node), GROUP_RANK=str(r // per_node),
                 NODE_RANK=str(r // per_node)) for r in range(world_size)]


def fork_ranks(server: forkserver.ForkServer, envs: list, path: list, key: bytes, tmp: str) -> list[Rank]:
    """Fork one rank per environment from the helper process."""
    ranks = []
    for r, env in enumerate(envs):
        stack_file = os.path.join(tmp, f"rank{r}.stack")
        open(stack_file, "w").close()
        proc = server.fork(dict(env, ZERONB_STACK_FILE=stack_file), os.getcwd(), path, key)
        ranks.append(Rank(r, proc, stack_file))
    return ranks


def accept(listener: Listener, ranks: list[Rank], timeout: float) -> None:
    """Accept one authenticated connection per rank, each saying Hello(rank, pid). A connection
    with a wrong key is refused (the challenge fails) and does not count. Raises, saying why,
    when a rank dies first or the time runs out."""
    accepted, deadline = [], time.monotonic() + timeout

    def accept_all():
        while len(accepted) < len(ranks):
            try:
                conn = listener.accept()
            except OSError:  # listener closed: startup was abandoned
                return
            except Exception:  # AuthenticationError and friends: not one of ours
                continue
            accepted.append(conn)

    t = threading.Thread(target=accept_all, name="zeronb-accept", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.05)
        dead = [rk for rk in ranks if not rk.alive()]
        if dead or time.monotonic() > deadline:
            listener.close()
            t.join(1)
            if dead:
                raise start_failure(dead)
            raise RuntimeError(f"zeronb: the ranks did not connect within {timeout:.0f} s")
    for conn in accepted:
        hello = conn.recv()
        ranks[hello.rank].conn = conn


def start_failure(dead: list[Rank]) -> RuntimeError:
    """The error for ranks that died while starting, with the end of what each wrote to stderr."""
    lines = []
    for rk in dead:
        try:
            rk.proc.wait(2)
        except subprocess.TimeoutExpired:
            pass
        rk.output.drain(until_eof=True)
        lines.append(f"--- rank {rk.rank} {signal_name(rk.proc.returncode)} ---\n{rk.output.stderr_text().strip()[-3000:]}")
    return RuntimeError("zeronb: ranks failed to start:\n" + "\n".join(lines))
