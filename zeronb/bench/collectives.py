"""`python -m zeronb.bench collectives`: sweeps of all-reduce, reduce-scatter and all-gather -
zeronb's ring, the naive root, and the backend's own - reported as nccl-tests reports them (algbw,
busbw; doc/PERFORMANCE.md), with an alpha-beta fit and the copy bandwidth along the bytes' path (a
rough bound for a CPU pool, a reference on GPUs).

The timing is not nccl-tests': it launches iterations back to back, with no barrier between them,
and reports the per-iteration time averaged over the ranks (src/common.cu, `-a 1` by default).
Here each call runs alone between barriers, its time is the slowest rank's (the skew with which
ranks leave the barrier included), and a size's time is the median over repetitions."""
import statistics
import time

from .. import collectives as C
from ..collectives import SEGMENT_BYTES
from ..cost import fit_alpha_beta
from ..ledger import CommLedger, bus_factor
from ..pool.cluster import Cluster
from ..runtime.backend import backend_for, device
from ..runtime.compat import all_gather_single, reduce_scatter_single
from ..shards import bounds

OPS = ("all_reduce", "reduce_scatter", "all_gather")
IMPLS = ("ring", "naive", "torch")
SIZES = tuple(4 << (2 * i) << 10 for i in range(8))  # 4 KiB, 16 KiB, ..., 64 MiB


def _time_collectives(nbytes: int, ops, impls, reps: int, segment_bytes: int) -> dict:
    """Inside a rank: time each (op, impl) on a float32 tensor of `nbytes`, `reps` times,
    interleaved, each call alone between barriers. A time is the slowest rank's (a collective is
    done when every rank is done); the result is the median of each. `segment_bytes`: the ring's
    segment size (zeronb.collectives.ring).

    The first round warms up and is not timed: each call runs once inside a CommLedger, which
    counts what this rank sent in it - the sends it made (for the ring and the naive algorithm;
    a built-in is credited by formula) and, under gloo, the bytes the OS saw leave on its TCP
    connections. Returns {"seconds": {"op/impl": median}, "sent": {...}, "wire": {... or None}}."""
    import torch
    import torch.distributed as dist

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
    sent, wire = {}, {}
    on_wire = backend_for(full) == "gloo"  # the OS counts gloo's TCP traffic (not NCCL's)
    for rep in range(reps + 1):  # the first round warms up (connections, allocations)
        order = list(times)
        order = order[rep % len(order):] + order[:rep % len(order)]  # rotate: no fixed position
        for key in order:
            dist.barrier()
            if not rep:  # the warm-up: what this rank sends in each call, counted (not timed)
                with CommLedger(wire=on_wire) as ledger:
                    calls[key]()
                sent[key], wire[key] = ledger.bytes_sent, ledger.wire_bytes
                full.normal_()
                continue
            t0 = time.perf_counter()
            calls[key]()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[key].append(t.item())
            full.normal_()  # keep values bounded across repeated in-place sums
    return {"seconds": {f"{op}/{impl}": statistics.median(v) for (op, impl), v in times.items()},
            "sent": {f"{op}/{impl}": v for (op, impl), v in sent.items()},
            "wire": {f"{op}/{impl}": v for (op, impl), v in wire.items()}}


def memcpy_bandwidth(nbytes: int = 64 << 20, reps: int = 5, device="cpu", to=None) -> float:
    """Bytes per second of one large tensor copy from `device` to `to` (default: the same device;
    bytes copied, not read + written), the median of `reps`. On the CPU it is the physical bound
    of a pool on one machine: every byte a collective moves is copied through memory (loopback TCP
    copies it twice: into the kernel and out again). From one GPU to another it crosses the link
    between them (NVLink or PCIe), the path NCCL's bytes take: a reference there, not a bound (one
    copy runs on the copy engines; NCCL's kernels move bytes over several channels at once, and
    with NVLink SHARP the switch adds, so fewer bytes cross each link than busbw's factor assumes)."""
    import torch

    device = torch.device(device)
    to = device if to is None else torch.device(to)
    src, dst = torch.randn(nbytes // 4, device=device), torch.empty(nbytes // 4, device=to)

    def wait():  # a GPU copy is queued: wait for both ends before reading the clock
        for d in {device, to}:
            if d.type == "cuda":
                torch.cuda.synchronize(d)

    dst.copy_(src)
    ts = []
    for _ in range(reps):
        wait()
        t0 = time.perf_counter()
        dst.copy_(src)
        wait()
        ts.append(time.perf_counter() - t0)
    return nbytes / statistics.median(ts)


def _copy_here() -> dict | None:
    """Inside a rank: rank 0 times one large copy along the path a collective's bytes take, while
    the other ranks wait at a barrier, so that it has the machine to itself: on the CPU a copy in
    memory (loopback TCP copies every byte); under NCCL a copy from its GPU to the next rank's,
    over the link between them. The other ranks return None."""
    import torch
    import torch.distributed as dist

    result = None
    if dist.get_rank() == 0:
        dev = device()
        if dev.type == "cuda" and dist.get_world_size() > 1:
            peer = torch.device("cuda", (dev.index + 1) % torch.cuda.device_count())
            result = {"Bps": memcpy_bandwidth(256 << 20, device=dev, to=peer), "device": f"{dev} to {peer}",
                      "name": f"{torch.cuda.get_device_name(dev)}, GPU to GPU"}
        else:
            name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} thread(s)"
            result = {"Bps": memcpy_bandwidth(device=dev), "device": str(dev), "name": name}
    dist.barrier()
    return result


def copy_ceiling(world_size: int, cores: int | None = None, device="cpu") -> float:
    """A rough ceiling for busbw on one machine, as a fraction of the copy bandwidth `_copy_here`
    measured for `device`. On the CPU: over loopback every byte is copied twice (into the kernel,
    out of it), every rank sends and receives busbw bytes/s, and N ranks share C cores: busbw <~
    min(C, N) / (2N) * memcpy. Under NCCL: 1.0, the GPU-to-GPU copy itself, drawn as a reference
    rather than a proven ceiling (see memcpy_bandwidth)."""
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
    algbw, busbw, sent, wire}]}: "copy" is the bandwidth of one large copy along the path the N-rank
    pool's bytes take (in the CPU's memory under gloo, GPU to GPU under NCCL), measured on rank 0
    while the other ranks wait. "sent" and "wire" list, rank by rank, what each rank sent in one
    untimed call of the row's collective: the ledger's count (the sends made; a built-in's by
    formula) and the bytes on its TCP connections as the OS counted them (None under NCCL).
    algbw = S / t; busbw = algbw * bus_factor(op, N), the nccl-tests definitions, with S the full
    tensor (the all-reduce's input, the reduce-scatter's input, the all-gather's output); the
    times are taken as the module docstring says, not as nccl-tests takes them.
    `segment_bytes`: the ring's segment size (None: zeronb.collectives.SEGMENT_BYTES).
    """
    from tqdm.auto import tqdm

    rows = []
    bar = tqdm(total=len(world_sizes) * len(sizes), desc="collectives sweep", disable=not progress)
    copy = {}
    for n in world_sizes:
        with Cluster(n, verbose=False) as c:
            backend = c.backend
            copy[n] = c.run(_copy_here, echo=False)[0]  # (rank 0's, measured alone)
            for nbytes in sizes:
                r = max(3, min(reps * 4, int(reps * (4 << 20) / nbytes) or reps)) if nbytes < (4 << 20) else reps
                res = c.run(_time_collectives, nbytes, ops, impls, r, segment_bytes or SEGMENT_BYTES,
                            echo=False, timeout=600)
                for key, t in res[0]["seconds"].items():  # (every rank has the slowest rank's times)
                    op, impl = key.split("/")
                    rows.append({"world_size": n, "backend": backend, "op": op, "impl": impl, "bytes": nbytes, "seconds": t,
                                 "algbw": nbytes / t, "busbw": nbytes / t * bus_factor(op, n),
                                 "sent": [rk["sent"][key] for rk in res], "wire": [rk["wire"][key] for rk in res]})
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


def print_collectives(result) -> None:
    rows = result["rows"]
    for n in sorted({r["world_size"] for r in rows}):
        copy = result["copy"][n]
        memcpy = copy["Bps"]
        print(f"\n{n} ranks: bandwidth of one large copy, {copy['device']} ({copy['name']}), on rank 0 alone: "
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
