"""Benchmarks: `python -m zeronb.bench dispatch`.

Figures are measured side by side in one run and printed as ratios, because this kind of machine
(a couple of shared cores) is noisy: medians over many calls, alternatives interleaved.
"""
import argparse
import os
import statistics
import sys
import time


def _spawned_rank(index: int, world_size: int, store_port: int) -> None:
    """What one rank does when a pool is not kept: start, join a group, run, leave."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=index, world_size=world_size)
    int()  # the same trivial call as the warm dispatch
    dist.destroy_process_group()


def spawn_once(world_size: int) -> float:
    """Seconds for one torch.multiprocessing.spawn of `world_size` ranks running a trivial call,
    with the same loopback rendezvous as the pool."""
    from datetime import timedelta

    import torch.multiprocessing as mp

    from .backend import loopback_interface, loopback_store

    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    store = loopback_store(world_size, timedelta(seconds=60))
    t0 = time.perf_counter()
    mp.spawn(_spawned_rank, args=(world_size, store.port), nprocs=world_size, join=True)
    return time.perf_counter() - t0


def _percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def dispatch(sizes=(2, 4), calls=300, spawns=3) -> list:
    """Pool start, warm dispatch latency (median, p90) and spawn-per-call, for each world size."""
    from .cluster import Cluster

    rows = []
    for n in sizes:
        with Cluster(n, verbose=False) as c:
            for _ in range(20):  # warm-up
                c.run(int, echo=False)
            lat, spawn = [], []
            for i in range(spawns):  # interleave: a block of dispatches, then one spawn
                for _ in range(calls // spawns):
                    t0 = time.perf_counter()
                    c.run(int, echo=False)
                    lat.append(time.perf_counter() - t0)
                spawn.append(spawn_once(n))
            rows.append({"world_size": n, "start_s": c.start_seconds,
                         "dispatch_median_ms": statistics.median(lat) * 1e3,
                         "dispatch_p90_ms": _percentile(lat, 0.9) * 1e3,
                         "spawn_median_s": statistics.median(spawn)})
    return rows


def _print_dispatch(rows) -> None:
    print(f"{'ranks':>5}  {'pool start':>10}  {'warm dispatch median':>20}  {'p90':>8}  "
          f"{'spawn per call':>14}  {'spawn / dispatch':>16}")
    for r in rows:
        ratio = r["spawn_median_s"] * 1e3 / r["dispatch_median_ms"]
        print(f"{r['world_size']:>5}  {r['start_s']:>9.2f}s  {r['dispatch_median_ms']:>18.2f}ms  "
              f"{r['dispatch_p90_ms']:>6.2f}ms  {r['spawn_median_s']:>13.2f}s  {ratio:>15.0f}x")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zeronb.bench", description=__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("dispatch", help="pool start, warm dispatch latency, and spawn-per-call, at 2 and 4 ranks")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--spawns", type=int, default=3)
    args = parser.parse_args(argv)
    if args.what == "dispatch":
        print(f"dispatch benchmark on {os.cpu_count()} CPU core(s); trivial call on every rank")
        _print_dispatch(dispatch(calls=args.calls, spawns=args.spawns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
