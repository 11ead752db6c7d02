"""`python -m zeronb.bench nodes`: 2 nodes x 2 ranks on this machine, the links within a node paced
at one rate and those between nodes at 1/ratio of it (zeronb.runtime.links), for several ratios in one pool:

- the flat ring, the hierarchical all-reduce and gloo's all-reduce, measured (the slowest rank's
  median, the three interleaved), beside the α–β model's prediction (zeronb.cost) from (α, β) fitted
  to this pool's own single messages within a node and across nodes at that ratio;
- the stages' step time and bytes across nodes (all ranks together, as the OS counted them) at one
  ratio, beside what the ring formulas say should cross.
"""
from __future__ import annotations

import statistics

from .. import cost
from ..collectives import hierarchical_all_reduce, ring_all_reduce
from ..cost import bytes_across
from ..models import Config, make_model
from ..pool.cluster import Cluster
from ..runtime.links import set_link_rates
from ..runtime.topology import human_rate
from ..shards import padded_numel
from ..train.runner import run_many
from ..train.runs import RunConfig

MiB = 1 << 20


def time_all_reduces(nbytes: int, reps: int, ways: dict | None = None) -> dict:
    """Inside a rank: {way: [seconds, ...]}, `reps` timings of each all-reduce of `nbytes` (float32),
    each the slowest rank's. The ways take turns (one of each, then again), so that a slow moment of
    the machine falls on all of them alike, after one untimed turn that makes what a first call
    makes (process groups and their connections, buffers). `ways`: {name: fn(tensor)}; by default
    the flat ring, the hierarchical all-reduce and gloo's own."""
    import time

    import torch
    import torch.distributed as dist

    x = torch.ones(nbytes // 4)
    if ways is None:
        ways = {"flat ring": ring_all_reduce, "hierarchical": hierarchical_all_reduce, "gloo": dist.all_reduce}
    times = {name: [] for name in ways}
    for rep in range(reps + 1):
        for name, fn in ways.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn(x)
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if rep:  # the first turn warms up
                times[name].append(t.item())
    return times


def spread(samples) -> tuple:
    """(median, lowest, highest) of repeated timings: what a page prints beside a median."""
    return statistics.median(samples), min(samples), max(samples)


def message_seconds(x, src: int, dst: int, group=None) -> float:
    """Inside a rank: seconds from the moment rank `src` starts sending `x` to the moment rank `dst`
    has all of it. Both ends read the machine's monotonic clock, which all the ranks of a pool share
    (they run on one machine): a clock started at a barrier would count the time one rank leaves
    the barrier before the other. Every rank calls it; every rank gets the same."""
    import time

    import torch
    import torch.distributed as dist

    rank, stamps = dist.get_rank(), torch.zeros(2, dtype=torch.float64)
    dist.barrier()
    if rank == src:
        stamps[0] = time.perf_counter()
        dist.send(x, dst, group=group)
    elif rank == dst:
        dist.recv(x, src, group=group)
        stamps[1] = time.perf_counter()
    dist.all_reduce(stamps, op=dist.ReduceOp.MAX)
    return (stamps[1] - stamps[0]).item()


def message_sizes(bps: float, seconds=(0.025, 0.1, 0.2)) -> tuple:
    """Bytes of messages that take these many seconds at `bps` (whole float32 elements): long enough
    for the kernel's pacing to set their time, where a busy machine adds milliseconds."""
    return tuple(int(bps * s) // 4 * 4 for s in seconds)


def time_messages(sizes=(256 << 10, 1 << 20, 4 << 20), reps: int = 3) -> dict:
    """Inside a rank: {link: [(bytes, seconds)]} of single messages, one way, within a node (rank 0
    to 1) and across nodes (rank 1 to 2) (`message_seconds`), median of `reps`. `sizes`: the same for
    both links, or {link: sizes} (one link only, or sizes fitted to each link's speed). For cost.fit;
    every rank returns the same."""
    import torch

    pairs = {"within": (0, 1), "across": (1, 2)}
    per_link = sizes if isinstance(sizes, dict) else {link: sizes for link in pairs}
    out = {}
    for link, link_sizes in per_link.items():
        src, dst = pairs[link]
        out[link] = []
        for nbytes in link_sizes:
            x = torch.ones(nbytes // 4)
            out[link].append((nbytes, statistics.median(message_seconds(x, src, dst) for _ in range(reps))))
    return out


def _set_rates(inter, intra):
    set_link_rates(inter, intra)


def nodes(ratios=(1, 4, 10, 16), sizes=(4 * MiB, 64 * MiB), intra_bps: float = 100e6, reps: int = 3,
          stage_ratio: int = 10, steps: int = 4) -> dict:
    """{"collectives": rows, "stages": rows}; see the module docstring."""
    rows, stage_rows = [], []
    with Cluster(4, backend="gloo", nodes=2, intra_node_bandwidth=intra_bps, inter_node_bandwidth=intra_bps,
                 verbose=False) as c:
        for ratio in ratios:
            c.run(_set_rates, intra_bps / ratio, intra_bps, echo=False)
            ratio = int(ratio) if ratio == int(ratio) else ratio
            timings = c.run(time_messages, {"within": message_sizes(intra_bps),
                                             "across": message_sizes(intra_bps / ratio)}, echo=False)[0]
            intra, inter = cost.fit(timings["within"]), cost.fit(timings["across"])
            for nbytes in sizes:
                samples = c.run(time_all_reduces, nbytes, reps, echo=False, timeout=1200)[0]
                measured = {way: statistics.median(ts) for way, ts in samples.items()}
                predicted = {"flat ring": cost.flat_all_reduce(nbytes, 2, 2, intra, inter),
                             "hierarchical": cost.hierarchical_all_reduce(nbytes, 2, 2, intra, inter)}
                predicted["gloo"] = predicted["flat ring"]  # gloo's all-reduce: a ring's bytes, a link between nodes
                rows.append({"ratio": ratio, "bytes": nbytes, "measured": measured, "predicted": predicted,
                             "samples": samples, "intra": intra, "inter": inter})
        c.run(_set_rates, intra_bps / stage_ratio, intra_bps, echo=False)
        variants = {"DDP": dict(stage=0), "ZeRO-3": dict(stage=3, reduce_scatter="ring"),
                    "HSDP": dict(stage=3, shard_group="node", reduce_scatter="ring"),
                    "ZeRO++ hpZ": dict(stage=3, hpz=True, reduce_scatter="ring"),
                    "ZeRO++ hpZ + qwZ": dict(stage=3, hpz=True, quantize_weights="int8", reduce_scatter="ring"),
                    "MiCS (HSDP, 2 micro-batches)": dict(stage=3, shard_group="node", grad_accum=2,
                                                         reduce_scatter="ring")}
        reports = run_many({name: RunConfig(model="gpt", steps=steps, **kw) for name, kw in variants.items()}, c)
    for name, rep in reports.items():
        stage_rows.append({"variant": name, "step_ms": max(r.step_ms for r in rep.ranks),
                           "across": sum(r.wire_across_nodes for r in rep.ranks),
                           "within": sum(r.wire_within_node for r in rep.ranks),
                           "expected_across": expected_across(name, rep), "psi_b": rep.ranks[0].num_params * 4})
    return {"collectives": rows, "stages": stage_rows, "intra_bps": intra_bps, "stage_ratio": stage_ratio}


def expected_across(name: str, report, nodes: int = 2) -> float:
    """Bytes all ranks together should send across nodes in one step (zeronb.cost.bytes_across),
    nan where there is no formula (qwZ)."""
    N, b = report.world_size, 4
    variant = {"MiCS (HSDP, 2 micro-batches)": "MiCS", "ZeRO++ hpZ": "hpZ"}.get(name, name)
    if variant == "DDP":
        units = [report.ranks[0].num_params * b]
    else:
        units = [padded_numel(sum(p.numel() for p in u.parameters()), N) * b
                 for u in make_model(Config(kind="gpt")).units()]
    try:
        return bytes_across(variant, units, nodes, N // nodes)
    except ValueError:
        return float("nan")


def print_nodes(result) -> None:
    print(f"2 nodes x 2 ranks; links within a node paced at {human_rate(result['intra_bps'])}, between nodes at "
          "1/ratio of that. Times: the slowest rank's median (ms); predicted: the alpha-beta model fitted to this "
          "pool's single messages within and across nodes at that ratio.")
    print(f"{'ratio':>5} {'size':>8}  {'flat ring':>17} {'hierarchical':>17} {'gloo':>17}   hier vs flat (measured / "
          "predicted)")
    for r in result["collectives"]:
        m, p = r["measured"], r["predicted"]
        cells = "".join(f" {m[k] * 1e3:8.1f} / {p[k] * 1e3:6.1f}" for k in ("flat ring", "hierarchical", "gloo"))
        print(f"{r['ratio']:>5} {r['bytes'] // MiB:>5} MiB {cells}   {m['flat ring'] / m['hierarchical']:.2f}x / "
              f"{p['flat ring'] / p['hierarchical']:.2f}x")
    print(f"\nStages at a {result['stage_ratio']}:1 ratio (GPT, float32; zeronb's ring reduce-scatter): bytes across "
          "nodes per step, all ranks together, as the OS counted them, against the ring formula")
    print(f"{'variant':>30} {'step ms':>8} {'across KiB':>11} {'formula KiB':>12} {'÷ formula':>10} {'within KiB':>11}")
    for r in result["stages"]:
        known = r["expected_across"] == r["expected_across"]  # (no formula: nan)
        formula = f"{r['expected_across'] / 1024:12.1f} {r['across'] / r['expected_across']:10.3f}" if known else \
            f"{'–':>12} {'–':>10}"
        print(f"{r['variant']:>30} {r['step_ms']:8.1f} {r['across'] / 1024:11.1f} {formula} {r['within'] / 1024:11.1f}")
