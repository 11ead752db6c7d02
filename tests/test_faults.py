"""Fault injection: the pool under faults and load. Each case prints how long the fault took to
surface (run with -s, or read the captured output of a failure)."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing.connection import AuthenticationError, Client

import psutil
import pytest
import torch
import torch.distributed as dist

import zeronb
from zeronb import Cluster, RankError, RankTimeout


def _running(pids):
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _surfaced(what, t0):
    took = time.monotonic() - t0
    print(f"{what}: surfaced in {took:.2f} s")
    return took


def _mismatched_collectives():
    t = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=1)
    return t.tolist()


def test_mismatched_collectives_do_not_hang():
    with Cluster(2, verbose=False) as c:
        t0 = time.monotonic()
        with pytest.raises(RankError):  # gloo notices (an error) or not (our timeout): never a hang
            c.run(_mismatched_collectives, timeout=10, echo=False)
        assert _surfaced("mismatched collectives", t0) < 15
        assert c.run(dist.get_rank, echo=False) == [0, 1]


def test_ranks_die_with_a_killed_parent():
    script = textwrap.dedent("""
        import sys, time, zeronb
        c = zeronb.Cluster(3, verbose=False)
        print(" ".join(map(str, c.pids)), flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(_running(pids)) == 3
        parent.kill()
        t0 = time.monotonic()
        while _running(pids) and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        assert not _running(pids)
        assert _surfaced("parent SIGKILLed, ranks gone", t0) < 2
    finally:
        parent.kill()
        parent.wait()


def test_three_pools_at_once_in_three_processes():
    script = textwrap.dedent("""
        import torch, torch.distributed as dist, zeronb
        def f():
            t = torch.ones(1000) * (dist.get_rank() + 1)
            dist.all_reduce(t)
            return t[0].item()
        with zeronb.Cluster(2, verbose=False) as c:
            print(list(c.run(f, echo=False)))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.strip() == "[3.0, 3.0]"


def test_fifty_start_shutdown_cycles_leak_nothing():
    me = psutil.Process()

    def snapshot():
        listening = [c.laddr.port for c in me.net_connections("inet") if c.status == psutil.CONN_LISTEN]
        return len(me.children(recursive=True)), me.num_fds(), threading.active_count(), len(listening)

    with Cluster(1, verbose=False) as c:  # warm: imports and the first store
        c.run(int, echo=False)
    before = snapshot()
    for _ in range(50):
        with Cluster(1, verbose=False) as c:
            assert c.run(dist.get_world_size, echo=False) == [1]
    after = snapshot()
    assert after[0] == before[0] == 0, "rank processes left behind"
    assert after[1] <= before[1] + 2, f"file descriptors grew: {before[1]} -> {after[1]}"
    assert after[2] <= before[2] + 1, f"threads grew: {before[2]} -> {after[2]}"
    assert after[3] <= before[3], f"listening sockets grew: {before[3]} -> {after[3]}"


class _RogueCluster(Cluster):
    """A Cluster whose control channel gets a connection with a wrong key while it starts."""

    rogue_result = None

    def _accept(self, key, deadline):
        def rogue():  # in a thread: the challenge only comes once the pool is accepting
            try:
                Client(self._listener.address, authkey=b"not the key")
                type(self).rogue_result = "accepted"
            except AuthenticationError as e:
                type(self).rogue_result = f"refused: {e}"
            except (OSError, EOFError) as e:  # the server closed the connection on it
                type(self).rogue_result = f"refused: {type(e).__name__}"

        t = threading.Thread(target=rogue, daemon=True)
        t.start()
        try:
            return super()._accept(key, deadline)
        finally:
            t.join(10)


def test_a_wrong_key_is_refused_and_the_pool_starts_anyway():
    with _RogueCluster(2, verbose=False) as c:
        assert _RogueCluster.rogue_result.startswith("refused"), _RogueCluster.rogue_result
        assert c.run(dist.get_rank, echo=False) == [0, 1]


def test_control_channel_is_closed_once_the_ranks_are_in():
    with Cluster(2, verbose=False) as c:
        host, port = c.control_address
        assert host == "127.0.0.1"
        with pytest.raises(OSError):
            Client((host, port), authkey=b"whatever")


def _mixed(i):
    from zeronb.collectives import ring_all_reduce

    t = torch.full((256,), float(i))
    kind = i % 4
    if kind == 0:
        dist.all_reduce(t)
    elif kind == 1:
        ring_all_reduce(t)
    elif kind == 2:
        dist.broadcast(t, src=i % dist.get_world_size())
    else:
        out = torch.empty(256 * dist.get_world_size())
        from zeronb.backend import all_gather_single
        all_gather_single(out, t)
    return t.sum().item()


def test_soak_1000_dispatches_memory_stays_flat():
    with Cluster(2, verbose=False) as c:
        procs = [psutil.Process(p) for p in c.pids]
        for i in range(100):  # warm-up: allocator pools, connections, imports
            c.run(_mixed, i, echo=False)
        rss0 = [p.memory_info().rss for p in procs]
        t0 = time.monotonic()
        for i in range(1000):
            res = c.run(_mixed, i, echo=False)
            assert res[0] == res[1]
        took = time.monotonic() - t0
        rss1 = [p.memory_info().rss for p in procs]
    print(f"soak: 1000 dispatches in {took:.1f} s; rank RSS {[r >> 20 for r in rss0]} -> {[r >> 20 for r in rss1]} MiB")
    for a, b in zip(rss0, rss1):
        assert b < 1.10 * a, f"rank memory grew {a >> 20} -> {b >> 20} MiB"
