"""Fault injection: the pool under faults and load. Every fault must surface in the notebook within
seconds, as an exception that names the ranks, and leave a pool that works; each case records how
long it took, and the test run ends with a table of those times."""
import ctypes
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

from conftest import running, surfaced
from zeronb import Cluster, RankError, RankTimeout
from zeronb.pool import forkserver


@pytest.fixture
def pair():
    with Cluster(world_size=2, backend="gloo", verbose=False) as c:
        yield c


# --- a rank fails: an exception, a crash, a hang, an interrupt ---------------------------------

def test_exception_while_others_wait_in_a_collective(pair):
    def f():
        if dist.get_rank() == 1:
            raise ValueError("rank one is unhappy")
        dist.barrier()  # rank 0 waits here for rank 1, which never comes

    t0 = time.monotonic()
    with pytest.raises(RankError) as e:
        pair.run(f, echo=False)
    assert surfaced("exception on rank 1 while rank 0 waits in a barrier", t0) < 5
    err = e.value
    assert err.failed == [1]
    assert "ValueError: rank one is unhappy" in err.tracebacks[1]
    assert 'raise ValueError("rank one is unhappy")' in err.tracebacks[1]  # the source line
    assert "barrier" in err.stacks[0]  # where rank 0 was blocked
    assert "dist.barrier()" in err.stacks[0]
    # the pool restarts and works
    assert list(pair.run(dist.get_rank, echo=False)) == [0, 1]


def test_exception_on_every_rank_keeps_the_pool(pair):
    pids = pair.pids

    def f():
        raise KeyError(dist.get_rank())

    with pytest.raises(RankError) as e:
        pair.run(f, echo=False)
    assert e.value.failed == [0, 1] and not e.value.stacks
    assert pair.pids == pids  # nobody was blocked: no restart needed
    assert e.value.exit_codes == {}  # every rank raised, reported, and lives on


def test_a_rank_that_exits_after_reporting_its_error_is_reported(pair):
    # rank 1 reports its error, then its process exits (as a torchrun worker's would): rank 0, waiting in
    # the barrier, reads a closed connection. The exit is named, and the next call restarts the pool.
    def f():
        if dist.get_rank() == 1:
            threading.Timer(0.2, os._exit, (3,)).start()  # once the error has been sent
            raise ValueError("rank one reports, then exits")
        dist.barrier()

    pids = pair.pids
    with pytest.raises(RankError) as e:
        pair.run(f, echo=False)
    assert e.value.exit_codes == {1: 3}, e.value.exit_codes
    assert "then exited" in str(e.value) and "exited with status 3" in e.value.tracebacks[1]
    assert list(pair.run(dist.get_rank, echo=False)) == [0, 1]
    assert not set(pair.pids) & set(pids)  # restarted: the group had lost a rank


def test_chained_exceptions_are_shown(pair):
    def f():
        try:
            {}["missing"]
        except KeyError as k:
            raise RuntimeError("lookup failed") from k

    with pytest.raises(RankError) as e:
        pair.run(f, echo=False)
    tb = e.value.tracebacks[0]
    assert "KeyError: 'missing'" in tb and "direct cause" in tb and "RuntimeError: lookup failed" in tb


def test_timeout_shows_where_each_rank_is_blocked(pair):
    def f():
        if dist.get_rank() == 0:
            t = torch.zeros(1)
            dist.recv(t, src=1)  # rank 1 never sends
        else:
            time.sleep(60)

    t0 = time.monotonic()
    with pytest.raises(RankTimeout) as e:
        pair.run(f, timeout=2, echo=False)
    took = surfaced("call past its 2 s timeout (rank 0 blocked in recv)", t0)
    assert 2 <= took < 6
    assert isinstance(e.value, TimeoutError) and isinstance(e.value, RankError)
    assert "timeout of 2 s" in str(e.value)
    assert "dist.recv(t, src=1)" in e.value.stacks[0] and "in recv" in e.value.stacks[0]
    assert "time.sleep(60)" in e.value.stacks[1]
    assert pair.run(lambda: 7, echo=False) == [7, 7]


def test_timeout_from_environment(pair, monkeypatch):
    monkeypatch.setenv("ZERONB_TIMEOUT", "1.5")
    t0 = time.monotonic()
    with pytest.raises(RankTimeout):
        pair.run(time.sleep, 30, echo=False)
    assert surfaced("timeout of 1.5 s from ZERONB_TIMEOUT", t0) < 5


@pytest.mark.parametrize("how", ["sigkill", "segfault"])
def test_a_rank_that_dies(pair, how):
    def f():
        if dist.get_rank() == 1:
            print("about to go", flush=True)
            if how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            ctypes.string_at(0)  # segmentation fault
        dist.barrier()

    t0 = time.monotonic()
    with pytest.raises(RankError) as e:
        pair.run(f, echo=False)
    assert surfaced(f"rank 1 {'SIGKILLed' if how == 'sigkill' else 'segfaulted'} while rank 0 waits", t0) < 5
    err = e.value
    assert 1 in err.failed and list(err.exit_codes) == [1]
    assert err.exit_codes[1] == -(signal.SIGKILL if how == "sigkill" else signal.SIGSEGV)
    assert ("SIGKILL" if how == "sigkill" else "SIGSEGV") in str(err)
    assert err.stdout[1] == "about to go\n"
    if how == "segfault":  # faulthandler's dump, from the rank's stderr
        assert "Segmentation fault" in err.tracebacks[1] and "string_at" in err.tracebacks[1]
    # rank 0 was waiting in the barrier: still blocked there, or failed in it when gloo saw rank 1 go
    assert "barrier" in err.stacks.get(0, "") + err.tracebacks.get(0, "")
    assert pair.run(dist.get_world_size, echo=False) == [2, 2]


def test_restart_says_state_was_lost(capsys):
    with Cluster(world_size=2, backend="gloo") as c:
        with pytest.raises(RankTimeout):
            c.run(time.sleep, 30, timeout=1, echo=False)
        capsys.readouterr()
        c.run(int, echo=False)
        assert "per-rank state from earlier calls was lost" in capsys.readouterr().out


def test_keyboard_interrupt_stops_the_call_promptly(pair):
    old_pids = pair.pids
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        pair.run(time.sleep, 60, echo=False)
    assert surfaced("KeyboardInterrupt 1 s into a call", t0 + 1.0) < 3
    assert not running(old_pids)
    assert pair.run(lambda: 1, echo=False) == [1, 1]


def _mismatched_collectives():
    t = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=1)
    return t.tolist()


def test_mismatched_collectives_do_not_hang():
    with Cluster(2, backend="gloo", verbose=False) as c:
        t0 = time.monotonic()
        with pytest.raises(RankError):  # gloo notices (an error) or not (our timeout): never a hang
            c.run(_mismatched_collectives, timeout=10, echo=False)
        assert surfaced("mismatched collectives (all_reduce against broadcast)", t0) < 15
        assert c.run(dist.get_rank, echo=False) == [0, 1]

def _mismatched_sizes():
    from zeronb.collectives import ring_all_reduce

    return ring_all_reduce(torch.ones(10 + dist.get_rank()))


def test_mismatched_sizes_in_a_ring_op_raise_on_every_rank_instead_of_hanging():
    with Cluster(3, backend="gloo", verbose=False) as c:
        t0 = time.monotonic()
        with pytest.raises(RankError) as e:
            c.run(_mismatched_sizes, echo=False, timeout=30)
        assert surfaced("mismatched tensor sizes in a ring all-reduce", t0) < 5
        assert e.value.failed == [0, 1, 2] and not e.value.blocked
        assert "rank 0: 10 x torch.float32, rank 1: 11 x torch.float32, rank 2: 12" in str(e.value)
        assert c.run(lambda: 1, echo=False) == [1, 1, 1]  # the pool needed no restart


# --- the process around the pool: a killed parent, many pools, strangers, a soak -----------

def test_ranks_die_with_a_killed_parent():
    script = textwrap.dedent("""
        import sys, time, zeronb
        c = zeronb.Cluster(3, backend="gloo", verbose=False)
        print(" ".join(map(str, c.pids)), flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(running(pids)) == 3
        parent.kill()
        t0 = time.monotonic()
        while running(pids) and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        assert not running(pids)
        assert surfaced("parent process SIGKILLed: all ranks gone", t0) < 2
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
        with zeronb.Cluster(2, backend="gloo", verbose=False) as c:
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

    with Cluster(1, backend="gloo", verbose=False) as c:  # warm: imports and the first store
        c.run(int, echo=False)
    before = snapshot()
    for _ in range(50):
        with Cluster(1, backend="gloo", verbose=False) as c:
            assert c.run(dist.get_world_size, echo=False) == [1]
    after = snapshot()
    assert after[0] == before[0] == 0, "rank processes left behind"
    assert after[1] <= before[1] + 2, f"file descriptors grew: {before[1]} -> {after[1]}"
    assert after[2] <= before[2] + 1, f"threads grew: {before[2]} -> {after[2]}"
    assert after[3] <= before[3], f"listening sockets grew: {before[3]} -> {after[3]}"


def test_a_wrong_key_is_refused_and_the_pool_starts_anyway(monkeypatch):
    """While the pool accepts its ranks, a connection with a wrong key comes in: refused."""
    from zeronb.pool import launch

    rogue_result, real_accept = [], launch.accept

    def accept_with_a_rogue(listener, ranks, timeout):
        def rogue():  # in a thread: the challenge only comes once the pool is accepting
            try:
                Client(listener.address, authkey=b"not the key")
                rogue_result.append("accepted")
            except AuthenticationError as e:
                rogue_result.append(f"refused: {e}")
            except (OSError, EOFError) as e:  # the server closed the connection on it
                rogue_result.append(f"refused: {type(e).__name__}")

        t = threading.Thread(target=rogue, daemon=True)
        t.start()
        try:
            return real_accept(listener, ranks, timeout)
        finally:
            t.join(10)

    monkeypatch.setattr(launch, "accept", accept_with_a_rogue)
    with Cluster(2, backend="gloo", verbose=False) as c:
        assert len(rogue_result) == 1 and rogue_result[0].startswith("refused"), rogue_result
        assert c.run(dist.get_rank, echo=False) == [0, 1]


def test_control_channel_is_closed_once_the_ranks_are_in():
    with Cluster(2, backend="gloo", verbose=False) as c:
        host, port = c.control_address
        assert host == "127.0.0.1"
        with pytest.raises(OSError):
            Client((host, port), authkey=b"whatever")


def _mixed(i):
    """One of four kinds of communication, on the rank's device (test_gpu.py soaks NCCL with it)."""
    from zeronb import device
    from zeronb.runtime.compat import all_gather_single
    from zeronb.collectives import ring_all_reduce

    t = torch.full((256,), float(i), device=device())
    kind = i % 4
    if kind == 0:
        dist.all_reduce(t)
    elif kind == 1:
        ring_all_reduce(t)
    elif kind == 2:
        dist.broadcast(t, src=i % dist.get_world_size())
    else:
        all_gather_single(t.new_empty(256 * dist.get_world_size()), t)
    return t.sum().item()


def test_soak_1000_dispatches_memory_stays_flat():
    with Cluster(2, backend="gloo", verbose=False) as c:
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


# --- the helper process that forks the ranks ---------------------------------------------------

def _helper_pid(c: Cluster) -> int:
    parents = {psutil.Process(p).ppid() for p in c.pids}
    assert len(parents) == 1, parents
    return parents.pop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_helper_holds_no_cuda_and_no_threads_when_it_forks():
    with Cluster(2, backend="gloo", verbose=False) as c:
        helper = _helper_pid(c)
        assert helper == forkserver.helper().pid and helper != os.getpid()
        assert helper not in [p.pid for p in psutil.Process().children(recursive=True)]  # detached
        # measured from outside, between two forks: one thread (no OpenMP or BLAS pool, no CUDA
        # driver threads), no GPU device open (a CUDA build maps libcuda at import, but only
        # initialising CUDA opens /dev/nvidia*), torch and torch._dynamo already imported
        tasks = os.listdir(f"/proc/{helper}/task")
        assert len(tasks) == 1, [open(f"/proc/{helper}/task/{t}/comm").read().strip() for t in tasks]
        open_files = [os.readlink(f"/proc/{helper}/fd/{fd}") for fd in os.listdir(f"/proc/{helper}/fd")]
        assert not [f for f in open_files if f.startswith("/dev/nvidia")], open_files
        assert "libtorch_cpu" in open(f"/proc/{helper}/maps").read()
        modules = c.run(lambda: sorted({"torch._dynamo", "cloudpickle", "zeronb.ledger"} & set(sys.modules)),
                        echo=False)
        assert modules[0] == ["cloudpickle", "torch._dynamo", "zeronb.ledger"]


def test_restarts_fork_from_the_same_helper():
    with Cluster(2, backend="gloo", verbose=False) as c:
        helper, pids = _helper_pid(c), c.pids
        with pytest.raises(RankError):
            c.run(os._exit, 3, echo=False)
        assert c.run(dist.get_world_size, echo=False) == [2, 2]
        assert c.pids != pids and _helper_pid(c) == helper


def test_a_killed_helper_is_reported_and_replaced(capfd):
    with Cluster(2, backend="gloo", verbose=False) as c:
        helper = _helper_pid(c)
        os.kill(helper, signal.SIGKILL)
        t0 = time.monotonic()
        while running(c.pids) and time.monotonic() - t0 < 5:
            time.sleep(0.02)
        assert not running(c.pids), "ranks outlived the helper that forked them"
        with pytest.raises(RankError) as e:  # the call meets ranks that are gone, and says why
            c.run(int, echo=False)
        assert "because the helper process that forked them exited" in str(e.value)
        surfaced("helper SIGKILLed between calls: the next call", t0)
        capfd.readouterr()
        assert c.run(dist.get_rank, echo=False) == [0, 1]  # restarted, on a new helper
        assert f"helper process that forks the ranks (pid {helper}) exited; starting a new one" in capfd.readouterr().err
        assert _helper_pid(c) not in (helper, os.getpid())



def test_a_replaced_helper_leaves_running_pools_alone(monkeypatch, capsys):
    with Cluster(2, backend="gloo") as a:
        old = _helper_pid(a)
        monkeypatch.setenv("TORCH_ZERONB_TEST_SETTING", "1")  # TORCH_*: read at import, a new helper
        capsys.readouterr()
        with Cluster(2, backend="gloo") as b:
            assert "starting a new helper process for the ranks" in capsys.readouterr().out
            assert _helper_pid(b) != old
            assert a.run(dist.get_rank, echo=False) == [0, 1]  # a's ranks, the old helper's, live on
            assert b.run(dist.get_rank, echo=False) == [0, 1]
