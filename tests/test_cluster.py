"""The rank pool: real processes, a real gloo process group, and every way a call can go wrong."""
import ctypes
import os
import signal
import sys
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

import zeronb
from zeronb import Cluster, RankError, RankTimeout


@pytest.fixture(scope="module")
def pool():
    with Cluster(world_size=4, verbose=False) as c:
        yield c


@pytest.fixture
def pair():
    with Cluster(world_size=2, verbose=False) as c:
        yield c


def _alive(pids):
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


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


def test_the_process_group_is_created_once_and_reused(pool):
    ids = pool.run(lambda: (os.getpid(), id(dist.group.WORLD)), echo=False)
    again = pool.run(lambda: (os.getpid(), id(dist.group.WORLD)), echo=False)
    assert list(ids) == list(again)


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


# --- failures --------------------------------------------------------------------------------

def test_exception_while_others_wait_in_a_collective(pair):
    def f():
        if dist.get_rank() == 1:
            raise ValueError("rank one is unhappy")
        dist.barrier()  # rank 0 waits here for rank 1, which never comes

    t0 = time.monotonic()
    with pytest.raises(RankError) as e:
        pair.run(f, echo=False)
    assert time.monotonic() - t0 < 5
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
    took = time.monotonic() - t0
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
    assert time.monotonic() - t0 < 5


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
    assert time.monotonic() - t0 < 5
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
    with Cluster(world_size=2) as c:
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
    assert time.monotonic() - t0 < 4
    assert not _alive(old_pids)
    assert pair.run(lambda: 1, echo=False) == [1, 1]


def test_shutdown_leaves_no_process_behind():
    c = zeronb.start(3, verbose=False)
    pids = c.pids
    assert len(_alive(pids)) == 3
    zeronb.shutdown()
    assert not _alive(pids)
    with pytest.raises(RuntimeError, match="zeronb.start"):
        zeronb.run(int)


def test_start_is_idempotent_and_resizes():
    try:
        a = zeronb.start(2, verbose=False)
        assert zeronb.start(2) is a
        b = zeronb.start(3, verbose=False)
        assert b is not a and a.closed and len(zeronb.run(int, echo=False)) == 3
    finally:
        zeronb.shutdown()


def test_pools_side_by_side_do_not_collide():
    with Cluster(2, verbose=False) as a, Cluster(2, verbose=False) as b:
        ra = a.run(lambda: os.environ["MASTER_PORT"], echo=False)
        rb = b.run(lambda: os.environ["MASTER_PORT"], echo=False)
        assert ra[0] != rb[0]


def test_nothing_listens_beyond_loopback(pool):
    procs = [psutil.Process(os.getpid())] + [psutil.Process(p) for p in pool.pids]
    listening = [c.laddr for p in procs for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening, "expected the store (and gloo) to listen somewhere"
    assert all(addr.ip in ("127.0.0.1", "::1") for addr in listening), listening


def test_simulated_nodes_set_torchrun_variables():
    with Cluster(4, nodes=2, verbose=False) as c:
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
    c = Cluster(1, verbose=False)
    assert c.run(lambda: 5, echo=False) == [5]  # world size 1 is a real (trivial) group
    c.close()
    with pytest.raises(RuntimeError, match="closed"):
        c.run(int)
