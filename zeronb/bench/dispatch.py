"""`python -m zeronb.bench dispatch`: what starting a pool and calling into it cost - start,
restart, warm dispatch - against mp.spawn and torchrun, which start processes for every call."""
import os
import statistics
import sys
import time

from ..pool import forkserver
from ..pool.cluster import Cluster
from ..pool.errors import RankError
from ..pool.launch import loopback_interface, loopback_store

_TRIVIAL_RANK = """
import os, torch, torch.distributed as dist
if "{backend}" == "nccl":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("{backend}")
int()  # the same trivial call as the warm dispatch
dist.destroy_process_group()
"""


def _spawned_rank(index: int, world_size: int, store_port: int, backend: str) -> None:
    """What one rank does when no pool is kept: start, join a group, run, leave."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(index)
    store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(backend, store=store, rank=index, world_size=world_size)
    int()
    dist.destroy_process_group()


def spawn_once(world_size: int, backend: str = "gloo") -> float:
    """Seconds for one torch.multiprocessing.spawn of `world_size` ranks running a trivial call,
    with the same loopback rendezvous and backend as the pool."""
    from datetime import timedelta

    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    store = loopback_store(world_size, timedelta(seconds=60))
    t0 = time.perf_counter()
    mp.spawn(_spawned_rank, args=(world_size, store.port, backend), nprocs=world_size, join=True)
    return time.perf_counter() - t0


def torchrun_once(world_size: int, backend: str = "gloo") -> float:
    """Seconds for one `torchrun --standalone` of `world_size` ranks running a trivial call: what
    running a script per experiment costs (the launcher's own start included)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "trivial.py")
        with open(script, "w") as f:
            f.write(_TRIVIAL_RANK.format(backend=backend))
        env = dict(os.environ, GLOO_SOCKET_IFNAME=loopback_interface(), OMP_NUM_THREADS="1")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={world_size}", script], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
        return time.perf_counter() - t0


def _percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _timed_calls(c, n: int) -> list:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        c.run(int, echo=False)
        out.append(time.perf_counter() - t0)
    return out


def dispatch(sizes=(1, 2, 4, 8), calls=300, rounds=3, baselines=True) -> dict:
    """What a pool costs and saves, per world size, measured side by side: start (helper warm),
    restart after a failed call, the first 50 calls after a start, warm dispatch (median, p90),
    and the alternatives of starting the ranks per call (torch.multiprocessing.spawn, torchrun).
    Each round does all of them in turn, so a slow moment of the machine hits every column."""
    forkserver.close()  # the first start pays the helper's import of torch: measure that once
    t0 = time.perf_counter()
    with Cluster(2, verbose=False) as c:
        backend = c.backend
    cold = time.perf_counter() - t0
    rows = []
    for n in sizes:
        m = {k: [] for k in ("start", "restart", "first50", "warm", "spawn", "torchrun")}
        for _ in range(rounds):
            t0 = time.perf_counter()
            c = Cluster(n, verbose=False)
            m["start"].append(time.perf_counter() - t0)
            backend = c.backend
            try:
                m["first50"] += _timed_calls(c, 50)
                m["warm"] += _timed_calls(c, calls // rounds)
                try:
                    c.run(os._exit, 1, echo=False)  # every rank dies: the next call restarts them
                except RankError:
                    pass
                m["restart"] += _timed_calls(c, 1)
            finally:
                c.close()
            if baselines:
                m["spawn"].append(spawn_once(n, backend))
                m["torchrun"].append(torchrun_once(n, backend))
        med = {k: statistics.median(v) if v else float("nan") for k, v in m.items()}
        rows.append({"world_size": n, "backend": backend, "start_s": med["start"], "restart_s": med["restart"],
                     "first50_median_ms": med["first50"] * 1e3, "dispatch_median_ms": med["warm"] * 1e3,
                     "dispatch_p90_ms": _percentile(m["warm"], 0.9) * 1e3,
                     "spawn_s": med["spawn"], "torchrun_s": med["torchrun"]})
    return {"cold_start_s": cold, "rows": rows}


def print_dispatch(result) -> None:
    rows = result["rows"]
    print(f"first pool of the process (2 ranks, the helper imports torch): {result['cold_start_s']:.2f} s")
    print(f"every later pool, {rows[0]['backend']} (medians; the helper is warm):")
    print(f"{'ranks':>5}  {'start':>7}  {'restart':>7}  {'first 50 calls':>14}  {'warm call':>9}  {'p90':>7}  "
          f"{'mp.spawn':>8}  {'torchrun':>8}  {'spawn / start':>13}  {'spawn / call':>12}")
    for r in rows:
        print(f"{r['world_size']:>5}  {r['start_s']:>6.2f}s  {r['restart_s']:>6.2f}s  {r['first50_median_ms']:>12.2f}ms  "
              f"{r['dispatch_median_ms']:>7.2f}ms  {r['dispatch_p90_ms']:>5.2f}ms  {r['spawn_s']:>7.2f}s  "
              f"{r['torchrun_s']:>7.2f}s  {r['spawn_s'] / r['start_s']:>12.1f}x  "
              f"{r['spawn_s'] * 1e3 / r['dispatch_median_ms']:>11.0f}x")
    if len(rows) >= 2:  # how each cost grows with the number of ranks: a line through the points
        import numpy as np

        ns = [r["world_size"] for r in rows]
        for key, what in (("start_s", "pool start"), ("spawn_s", "mp.spawn"), ("torchrun_s", "torchrun")):
            ys = [r[key] for r in rows]
            if all(y == y for y in ys):  # not NaN (baselines skipped)
                per_rank, fixed = np.polyfit(ns, ys, 1)
                print(f"  {what:>10} ~ {fixed * 1e3:7.0f} ms + {per_rank * 1e3:6.0f} ms per rank")
