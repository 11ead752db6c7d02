"""Benchmarks: `python -m zeronb.bench dispatch`, `... collectives` and `... zero`.

Figures are measured side by side in one run and printed as ratios, because this kind of machine
(a couple of shared cores) is noisy: medians over many calls, alternatives interleaved.
"""
import argparse
import os
import statistics
import sys
import time


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

    from .launch import loopback_interface, loopback_store

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

    from .launch import loopback_interface

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
    from . import forkserver
    from .cluster import Cluster
    from .errors import RankError

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


def _print_dispatch(result) -> None:
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


# --- collectives: nccl-tests style sweeps ------------------------------------------------------

OPS = ("all_reduce", "reduce_scatter", "all_gather")
IMPLS = ("ring", "naive", "torch")
SIZES = tuple(4 << (2 * i) << 10 for i in range(8))  # 4 KiB, 16 KiB, ..., 64 MiB


def _time_collectives(nbytes: int, ops, impls, reps: int, segment_bytes: int) -> dict:
    """Inside a rank: time each (op, impl) on a float32 tensor of `nbytes`, `reps` times,
    interleaved. A time is the slowest rank's (a collective is done when every rank is done)."""
    import torch
    import torch.distributed as dist

    from . import collectives as C
    from .backend import all_gather_single, device, reduce_scatter_single
    from .shards import bounds

    rank, n = dist.get_rank(), dist.get_world_size()
    numel = nbytes // 4
    dev = device()
    full = torch.randn(numel, device=dev)
    a, b = bounds(numel, n, rank)
    shard, out = full[a:b].clone(), torch.empty(numel, device=dev)
    out_shard = torch.empty(b - a, device=dev)
    calls = {
        ("all_reduce", "ring"): lambda: C.ring_all_reduce(full, segment_bytes=segment_bytes),
        ("all_reduce", "naive"): lambda: C.naive_all_reduce(full),
        ("all_reduce", "torch"): lambda: dist.all_reduce(full),
        ("reduce_scatter", "ring"): lambda: C.ring_reduce_scatter(full, segment_bytes=segment_bytes),
        ("reduce_scatter", "naive"): lambda: C.naive_reduce_scatter(full),
        ("reduce_scatter", "torch"): lambda: reduce_scatter_single(out_shard, full),
        ("all_gather", "ring"): lambda: C.ring_all_gather(shard, numel, segment_bytes=segment_bytes),
        ("all_gather", "naive"): lambda: C.naive_all_gather(shard, numel),
        ("all_gather", "torch"): lambda: all_gather_single(out, shard),
    }
    if nbytes % (4 * n):
        raise ValueError(f"sizes must divide evenly over {n} ranks (torch's single-tensor collectives need it)")
    times = {(op, impl): [] for op in ops for impl in impls}
    for rep in range(reps + 1):  # the first round warms up (connections, allocations)
        order = list(times)
        order = order[rep % len(order):] + order[:rep % len(order)]  # rotate: no fixed position
        for key in order:
            dist.barrier()
            t0 = time.perf_counter()
            calls[key]()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if rep:
                times[key].append(t.item())
            full.normal_()  # keep values bounded across repeated in-place sums
    return {f"{op}/{impl}": statistics.median(v) for (op, impl), v in times.items()}


def memcpy_bandwidth(nbytes: int = 64 << 20, reps: int = 5, device="cpu") -> float:
    """Bytes per second of one large tensor copy on `device` (bytes copied, not read + written).
    On the CPU it is the physical bound of a pool on one machine: every byte a collective moves is
    copied through memory (loopback TCP copies it twice: into the kernel and out again). On a GPU
    it is the GPU's own device-to-device copy, timed with CUDA events."""
    import torch

    device = torch.device(device)
    src, dst = torch.randn(nbytes // 4, device=device), torch.empty(nbytes // 4, device=device)
    dst.copy_(src)
    ts = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            ts.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            ts.append(time.perf_counter() - t0)
    return nbytes / statistics.median(ts)


def _copy_here() -> dict:
    """Inside a rank: the copy bandwidth of this rank's device, and which device that is."""
    import torch

    from .backend import device

    dev = device()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} thread(s)"
    return {"Bps": memcpy_bandwidth(device=dev), "device": str(dev), "name": name}


def fit_alpha_beta(sizes, seconds) -> tuple[float, float]:
    """Least-squares fit of t = alpha + beta * S: alpha the latency (s), beta seconds per byte."""
    import numpy as np

    t = np.asarray(seconds, float)
    # weights 1/t: fit relative errors, or the largest sizes decide everything and alpha is noise
    beta, alpha = np.polyfit(np.asarray(sizes, float), t, 1, w=1 / t)
    return float(alpha), float(beta)


def copy_ceiling(world_size: int, cores: int | None = None, device="cpu") -> float:
    """A rough ceiling for busbw on one machine, as a fraction of the copy bandwidth measured on
    `device`. On the CPU: over loopback every byte is copied twice (into the kernel, out of it),
    every rank sends and receives busbw bytes/s, and N ranks share C cores: busbw <~ min(C, N) /
    (2N) * memcpy. On a GPU each rank's device does its own copies: the GPU's copy bandwidth."""
    import os

    import torch

    if torch.device(device).type == "cuda":
        return 1.0
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, world_size) / (2 * world_size)


def collectives(world_sizes=(2, 4), sizes=SIZES, ops=OPS, impls=IMPLS, reps=5,
                segment_bytes=None, progress=True) -> dict:
    """The sweep: for each world size, size, op and impl, the median time, algbw and busbw.

    Returns {"copy": {N: {"Bps", "device", "name"}}, "rows": [{world_size, op, impl, bytes, seconds,
    algbw, busbw}]}: "copy" is the copy bandwidth of one large tensor on the device the N-rank
    pool's ranks use (the CPU under gloo, the GPU under NCCL), measured on rank 0.
    algbw = S / t; busbw = algbw * bus_factor(op, N), the nccl-tests definitions, with S the full
    tensor (the all-reduce's input, the reduce-scatter's input, the all-gather's output).
    """
    from tqdm.auto import tqdm

    from .cluster import Cluster
    from .collectives import SEGMENT_BYTES
    from .ledger import bus_factor

    rows = []
    bar = tqdm(total=len(world_sizes) * len(sizes), desc="collectives sweep", disable=not progress)
    copy = {}
    for n in world_sizes:
        with Cluster(n, verbose=False) as c:
            backend = c.backend
            copy[n] = c.run(_copy_here, echo=False)[0]
            for nbytes in sizes:
                r = max(3, min(reps * 4, int(reps * (4 << 20) / nbytes) or reps)) if nbytes < (4 << 20) else reps
                res = c.run(_time_collectives, nbytes, ops, impls, r, segment_bytes or SEGMENT_BYTES,
                            echo=False, timeout=600)[0]
                for key, t in res.items():
                    op, impl = key.split("/")
                    rows.append({"world_size": n, "backend": backend, "op": op, "impl": impl, "bytes": nbytes, "seconds": t,
                                 "algbw": nbytes / t, "busbw": nbytes / t * bus_factor(op, n)})
                bar.update(1)
    bar.close()
    return {"copy": copy, "rows": rows}


def speedups(result, nbytes=16 << 20) -> list[dict]:
    """Ring vs torch's built-in, at one size: time(torch) / time(ring), per world size and op."""
    rows = result["rows"]
    out = []
    for n in sorted({r["world_size"] for r in rows}):
        for op in OPS:
            t = {r["impl"]: r["seconds"] for r in rows if r["world_size"] == n and r["op"] == op and r["bytes"] == nbytes}
            if "ring" in t and "torch" in t:
                out.append({"world_size": n, "op": op, "bytes": nbytes, "ring_s": t["ring"], "torch_s": t["torch"],
                            "speedup": t["torch"] / t["ring"]})
    return out


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.3g} {unit}"
        nbytes /= 1024


def _print_collectives(result) -> None:
    rows = result["rows"]
    for n in sorted({r["world_size"] for r in rows}):
        copy = result["copy"][n]
        memcpy = copy["Bps"]
        print(f"\n{n} ranks: copy bandwidth of one 64 MiB tensor on {copy['device']} ({copy['name']}): "
              f"{memcpy / 1e9:.2f} GB/s")
        for op in OPS:
            print(f"\n{op}, {n} ranks      time (ms)                 busbw (GB/s)            busbw / memcpy")
            print(f"{'size':>10}  " + "  ".join(f"{i:>7}" for i in IMPLS) + "   "
                  + "  ".join(f"{i:>7}" for i in IMPLS) + "   " + "  ".join(f"{i:>6}" for i in IMPLS))
            for nbytes in sorted({r["bytes"] for r in rows}):
                sel = {r["impl"]: r for r in rows if r["world_size"] == n and r["op"] == op and r["bytes"] == nbytes}
                print(f"{_human(nbytes):>10}  " + "  ".join(f"{sel[i]['seconds'] * 1e3:7.2f}" for i in IMPLS) + "   "
                      + "  ".join(f"{sel[i]['busbw'] / 1e9:7.3f}" for i in IMPLS) + "   "
                      + "  ".join(f"{sel[i]['busbw'] / memcpy:6.1%}" for i in IMPLS))
            for impl in IMPLS if len({r["bytes"] for r in rows}) >= 3 else ():  # a line needs a few sizes
                pts = sorted((r["bytes"], r["seconds"]) for r in rows
                             if r["world_size"] == n and r["op"] == op and r["impl"] == impl)
                alpha, beta = fit_alpha_beta(*zip(*pts))
                print(f"  alpha-beta fit, {impl:>5}: t = {alpha * 1e6:8.1f} us + S / ({1 / beta / 1e9:.3f} GB/s)")
    print("\nring vs torch's built-in at 16 MiB (time(torch) / time(ring); > 1 means the ring is faster):")
    for s in speedups(result):
        print(f"  {s['world_size']} ranks  {s['op']:>14}: {s['speedup']:.2f}x  "
              f"(ring {s['ring_s'] * 1e3:.1f} ms, torch {s['torch_s'] * 1e3:.1f} ms)")


# --- the ZeRO stages side by side ---------------------------------------------------------------

def practice_variants(k: int = 4) -> dict:
    """Training in practice, per stage: the flags of each variant `bench zero` measures beside the
    plain step (accumulation over k micro-batches, synced every micro-batch or after the last;
    gradients reduced in bf16)."""
    accum = ["--grad-accum", str(k), "--accum-sync"]
    return {"plain": [], f"accum {k}, every": accum + ["every"], f"accum {k}, last": accum + ["last"],
            "bf16 reduce": ["--reduce-dtype", "bf16"]}


def _zero_rounds(models, stages, rounds, steps, dtype, variants):
    """Inside a rank: train each (model, stage, variant) `rounds` times, interleaved, and report each."""
    from .train import parse_args, train_rank

    out = {}
    for _ in range(rounds):
        for model in models:
            for stage in stages:
                for name, flags in variants.items():
                    if stage == 1 and "every" in flags:
                        continue  # ZeRO-1 reduce-scatters once, at the step, whatever --accum-sync says
                    args = parse_args(["--model", model, "--stage", str(stage), "--steps", str(steps),
                                       "--dtype", dtype, *flags])
                    rep = train_rank(args)
                    rep.pop("params", None)
                    out.setdefault((model, stage, name), []).append(rep)
    return out


def zero(world_size=4, models=("mlp", "gpt"), stages=(0, 1, 2, 3), rounds=3, steps=6, dtype="float32",
         accum=4) -> list:
    """Per model, stage and variant (practice_variants): median step time, bytes sent per step (by
    the ledger, and on the wire where the OS counts them), model-state bytes held on rank 0, the
    gradient bytes held between micro-batches, and each against the plain step of the same stage
    and against DDP's - all measured in one run on one pool, the variants interleaved."""
    from .cluster import Cluster

    variants = practice_variants(accum)
    with Cluster(world_size, verbose=False) as c:
        res = c.run(_zero_rounds, models, stages, rounds, steps, dtype, variants, echo=False, timeout=3600)
    rows = []
    for (model, st, name) in res[0]:
        # a step takes as long as its slowest rank
        step_ms = statistics.median(max(r[(model, st, name)][i]["step_ms"] for r in res) for i in range(rounds))
        rep = res[0][(model, st, name)][-1]
        held_between = rep["grad_bytes_after_micro_batch"]
        rows.append({"model": model, "stage": st, "variant": name, "step_ms": step_ms,
                     "sent": sum(rep["sent_bytes_per_step"].values()), "wire": rep["wire_bytes_per_step"],
                     "held": sum(rep["bytes"].values()), "expected_held": sum(rep["expected_bytes"].values()),
                     "grads_between": held_between[0] if held_between and len(held_between) > 1 else None,
                     "num_params": rep["num_params"]})
    by = {(r["model"], r["stage"], r["variant"]): r for r in rows}
    for r in rows:
        plain = by[r["model"], r["stage"], "plain"]
        r["vs_ddp"] = r["step_ms"] / by[r["model"], stages[0], "plain"]["step_ms"]
        r["sent_vs_plain"] = r["sent"] / plain["sent"] if plain["sent"] else None
        r["wire_vs_plain"] = r["wire"] / plain["wire"] if r["wire"] and plain["wire"] else None
    return rows


def _print_zero(rows, world_size, dtype) -> None:
    print(f"ZeRO stages on {world_size} ranks, {dtype}: rank 0's model states and traffic, median step time")
    print(f"{'model':>5} {'stage':>5} {'params':>8} {'held KiB':>9} {'formula KiB':>11} {'sent KiB/step':>14} "
          f"{'sent / psi*b':>12} {'step ms':>8} {'vs DDP':>7}")
    b = {"float32": 4, "float64": 8, "bf16-mixed": 2}[dtype]
    for r in rows:
        if r["variant"] == "plain":
            print(f"{r['model']:>5} {r['stage']:>5} {r['num_params']:>8} {r['held'] / 1024:>9.1f} "
                  f"{r['expected_held'] / 1024:>11.1f} {r['sent'] / 1024:>14.1f} {r['sent'] / (r['num_params'] * b):>12.3f} "
                  f"{r['step_ms']:>8.1f} {r['vs_ddp']:>6.2f}x")
    print("\nTraining in practice, the same run: each variant against the plain step of its stage "
          "(grads between = gradient bytes held after the first micro-batch)")
    print(f"{'model':>5} {'stage':>5} {'variant':>16} {'sent KiB':>9} {'x plain':>8} {'wire KiB':>9} {'x plain':>8} "
          f"{'grads between KiB':>18} {'/ psi*b':>8} {'step ms':>8}")
    def fmt(value, spec):  # "-" where a variant has no such number (no micro-batches; no wire count)
        return "-".rjust(int(spec.split(".")[0])) if value is None else format(value, spec)

    for r in rows:
        between = r["grads_between"]
        print(f"{r['model']:>5} {r['stage']:>5} {r['variant']:>16} {r['sent'] / 1024:>9.1f} {fmt(r['sent_vs_plain'], '8.2f')} "
              f"{fmt(r['wire'] and r['wire'] / 1024, '9.1f')} {fmt(r['wire_vs_plain'], '8.2f')} "
              f"{fmt(between and between / 1024, '18.1f')} {fmt(between and between / (r['num_params'] * b), '8.2f')} "
              f"{r['step_ms']:>8.1f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zeronb.bench", description=__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("dispatch", help="pool start and restart, dispatch latency, and spawn / torchrun per call")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--calls", type=int, default=300, help="warm calls per world size")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every measurement, interleaved")
    p.add_argument("--no-baselines", action="store_true", help="skip mp.spawn and torchrun (slow)")
    p = sub.add_parser("collectives", help="all-reduce / reduce-scatter / all-gather: ring vs naive vs torch")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="bytes")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--segment-bytes", type=int, default=None)
    p.add_argument("--json", default=None, help="also write the results to this file")
    p = sub.add_parser("zero", help="step time, bytes sent and memory per ZeRO stage, both models; and what "
                                    "accumulation and bf16 reduction change, per stage")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bf16-mixed"])
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches of the accumulation variants")
    p.add_argument("--models", nargs="+", default=["mlp", "gpt"], choices=["mlp", "gpt"])
    args = parser.parse_args(argv)
    if args.what == "zero":
        _print_zero(zero(args.world_size, models=tuple(args.models), rounds=args.rounds, steps=args.steps,
                         dtype=args.dtype, accum=args.grad_accum), args.world_size, args.dtype)
    if args.what == "collectives":
        result = collectives(tuple(args.world_sizes), tuple(args.sizes), reps=args.reps,
                             segment_bytes=args.segment_bytes)
        _print_collectives(result)
        if args.json:
            import json
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    if args.what == "dispatch":
        print(f"dispatch benchmark on {os.cpu_count()} CPU core(s); a trivial call on every rank")
        _print_dispatch(dispatch(tuple(args.world_sizes), calls=args.calls, rounds=args.rounds,
                                 baselines=not args.no_baselines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
