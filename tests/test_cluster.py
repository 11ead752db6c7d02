"""The rank pool: real processes, a real gloo process group, its life cycle and bad input. (What
happens when a rank fails is in test_faults.py.)"""
import ctypes
import os
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from conftest import listening_addresses, running
import zeronb
from zeronb import Cluster, RankError


@pytest.fixture
def pool(gloo_pool):
    return gloo_pool(4)


# --- running code on the ranks ---------------------------------------------------------------

def test_results_are_per_rank_and_the_group_is_real(pool):
    def f(x):
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        return dist.get_rank(), dist.get_world_size(), t.item() + x, os.getpid()

    res = pool.run(f, 100, echo=False)
    assert [r[0] for r in res] == [0, 1, 2, 3]
    assert all(r[1] == 4 for r in res)
    assert all(r[2] == 1 + 2 + 3 + 4 + 100 for r in res)
    pids = {r[3] for r in res}
    assert len(pids) == 4 and os.getpid() not in pids and pids == set(pool.pids)


def _remember_the_group():
    """Keep a reference to the rank's default group (so that it cannot be freed and replaced by
    another at the same address), and say how many groups the rank has made so far."""
    import zeronb

    zeronb._remembered_group = dist.group.WORLD
    return os.getpid(), dist.get_pg_count()


def _still_the_same_group():
    import zeronb

    return os.getpid(), dist.get_pg_count(), zeronb._remembered_group is dist.group.WORLD


def test_the_process_group_is_created_once_and_reused(pool):
    first = pool.run(_remember_the_group, echo=False)
    later = pool.run(_still_the_same_group, echo=False)
    assert len(first) == len(later) == 4
    for (pid, groups), (pid_later, groups_later, same) in zip(first, later):
        assert pid == pid_later and groups == groups_later and same


def test_closures_and_classes_from_main_are_shipped_by_value(pool):
    scale = 3

    class Box:
        def __init__(self, v):
            self.v = v

    def f():
        return Box(dist.get_rank() * scale)

    res = pool.run(f, echo=False)
    assert [b.v for b in res] == [0, 3, 6, 9]


def test_output_grouped_by_rank_in_rank_order(pool, capsys):
    def f():
        time.sleep(0.05 * (3 - dist.get_rank()))  # rank 3 prints first
        print(f"hello from {dist.get_rank()}")
        print("second line")

    res = pool.run(f)
    out = capsys.readouterr().out
    expected = "".join(f"[rank {r}] hello from {r}\n[rank {r}] second line\n" for r in range(4))
    assert out == expected
    assert res.stdout[2] == "hello from 2\nsecond line\n"


def test_output_from_c_code_is_captured(pool):
    def f():
        libc = ctypes.CDLL(None)
        libc.printf(b"printf says %d\n", dist.get_rank())  # C stdio, buffered: must be flushed
        os.write(2, b"raw fd 2\n")

    res = pool.run(f, echo=False)
    assert res.stdout == [f"printf says {r}\n" for r in range(4)]
    assert res.stderr == ["raw fd 2\n"] * 4


def test_live_output_arrives_during_the_call(pool):
    stamps = []

    class Clock:
        def write(self, s):
            if "early" in s:
                stamps.append(time.monotonic())
            return len(s)

        def flush(self):
            pass

    def f():
        print("early")
        time.sleep(1.5)
        print("late")

    old, sys.stdout = sys.stdout, Clock()
    try:
        res = pool.run(f, live=True)
    finally:
        sys.stdout = old
    done = time.monotonic()
    assert len(stamps) == 4  # each rank's line once, not repeated after the call
    assert done - max(stamps) > 1.0
    assert res.stdout[0] == "early\nlate\n"


def test_input_in_a_rank_fails_instead_of_hanging(pool):
    with pytest.raises(RankError) as e:
        pool.run(input, timeout=20, echo=False)
    assert "EOFError" in str(e.value)


def test_dispatch_is_fast_when_warm(pool):
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        pool.run(int, echo=False)
        times.append(time.perf_counter() - t0)
    assert sorted(times)[15] < 0.25  # a correctness bound (no process start per call); speed is in bench


# --- the pool's life: start, shutdown, several pools ---------------------------------------

def test_shutdown_leaves_no_process_behind():
    c = zeronb.start(3, backend="gloo", verbose=False)
    pids = c.pids
    assert len(running(pids)) == 3
    zeronb.shutdown()
    assert not running(pids)
    with pytest.raises(RuntimeError, match="zeronb.start"):
        zeronb.run(int)


def test_start_is_idempotent_and_resizes():
    try:
        a = zeronb.start(2, backend="gloo", verbose=False)
        assert zeronb.start(2, backend="gloo") is a
        b = zeronb.start(3, backend="gloo", verbose=False)
        assert b is not a and a.closed and len(zeronb.run(int, echo=False)) == 3
    finally:
        zeronb.shutdown()


def test_pools_side_by_side_do_not_collide():
    with Cluster(2, backend="gloo", verbose=False) as a, Cluster(2, backend="gloo", verbose=False) as b:
        ra = a.run(lambda: os.environ["MASTER_PORT"], echo=False)
        rb = b.run(lambda: os.environ["MASTER_PORT"], echo=False)
        assert ra[0] != rb[0]


def test_nothing_listens_beyond_loopback(pool):
    listening = listening_addresses([os.getpid(), *pool.pids])  # test_gpu.py does the same on NCCL
    assert listening, "expected the store (and gloo) to listen somewhere"
    assert all(ip in ("127.0.0.1", "::1") for ip in listening), listening


def test_simulated_nodes_set_torchrun_variables():
    with Cluster(4, nodes=2, backend="gloo", verbose=False) as c:
        env = c.run(lambda: {k: int(os.environ[k]) for k in
                             ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}, echo=False)
    assert [(e["RANK"], e["GROUP_RANK"], e["LOCAL_RANK"]) for e in env] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert all(e["WORLD_SIZE"] == 4 and e["LOCAL_WORLD_SIZE"] == 2 for e in env)


# --- bad input -------------------------------------------------------------------------------

@pytest.mark.parametrize("ws,exc", [(0, ValueError), (-3, ValueError), (2.0, TypeError), ("2", TypeError),
                                    (True, TypeError), (None, TypeError), (10**6, ValueError)])
def test_bad_world_size(ws, exc):
    t0 = time.monotonic()
    with pytest.raises(exc, match="world_size"):
        zeronb.start(ws)
    with pytest.raises(exc, match="world_size"):
        Cluster(ws)
    assert time.monotonic() - t0 < 1  # refused before any process starts


def test_bad_backend_and_nodes():
    with pytest.raises(ValueError, match="backend must be one of"):
        Cluster(2, backend="mpi")
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="one GPU per rank|no NCCL"):
            Cluster(2, backend="nccl")
    with pytest.raises(ValueError, match="divides"):
        Cluster(4, nodes=3)


def test_unpicklable_function(pool):
    lock = threading.Lock()
    with pytest.raises(TypeError, match="cannot send .*picklable"):
        pool.run(lambda: lock.locked())
    with pytest.raises(TypeError, match="needs a function"):
        pool.run(42)


def test_unpicklable_return_value_names_rank_and_type(pool):
    def f():
        return threading.Lock() if dist.get_rank() == 2 else 1

    with pytest.raises(TypeError, match=r"rank\(s\) 2 returned .*lock"):
        pool.run(f, echo=False)
    assert pool.run(lambda: 1, echo=False) == [1] * 4  # the pool is fine


def test_bad_timeout(pool):
    with pytest.raises(ValueError, match="timeout"):
        pool.run(int, timeout=0)


def test_run_on_a_closed_cluster():
    c = Cluster(1, backend="gloo", verbose=False)
    assert c.run(lambda: 5, echo=False) == [5]  # world size 1 is a real (trivial) group
    c.close()
    with pytest.raises(RuntimeError, match="closed"):
        c.run(int)


def test_a_call_that_destroys_the_group_leaves_a_working_pool(capsys):
    def all_reduce():
        t = torch.ones(2) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        return t.tolist()

    with Cluster(3, backend="gloo") as c:
        pids = c.pids
        c.run_cell("kept = 41", "<setup>", echo=False)
        capsys.readouterr()
        c.run(dist.destroy_process_group, echo=False)  # how scripts written for torchrun end
        out = capsys.readouterr().out
        assert "rank(s) 0, 1, 2 destroyed the process group" in out and "joined a new one" in out
        assert c.run(all_reduce, echo=False) == [[6.0, 6.0]] * 3
        # on one rank only: the others leave their group too, and all join a new one
        c.run(lambda: dist.get_rank() == 1 and dist.destroy_process_group(), echo=False)
        assert "rank(s) 1 destroyed the process group" in capsys.readouterr().out
        assert c.run(all_reduce, echo=False) == [[6.0, 6.0]] * 3
        assert c.pids == pids and c.run_cell("kept", "<check>", echo=False) == [41] * 3  # state kept


def test_bad_settings_leave_the_running_pool_alone():
    try:
        a = zeronb.start(2, backend="gloo", verbose=False)
        pids = a.pids
        with pytest.raises(ValueError, match="backend must be one of"):
            zeronb.start(3, backend="mpi")
        with pytest.raises(ValueError, match="divides"):
            zeronb.start(3, nodes=2)
        with pytest.raises(ValueError, match="threads"):
            zeronb.start(3, threads=0)
        with pytest.raises(TypeError, match="unknown argument"):
            zeronb.start(3, colour="red")
        assert zeronb.current() is a and running(pids) == pids
        assert zeronb.run(dist.get_world_size, echo=False) == [2, 2]
    finally:
        zeronb.shutdown()
