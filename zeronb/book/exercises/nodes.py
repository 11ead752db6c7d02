"""Checkers for the exercises of chapter 13 (nodes): the hierarchical all-reduce and HSDP's gradient
path. Both run on a pool of 2 nodes x 2 ranks, then on 2 nodes x 3 (a node size or world size
written into the solution shows there), and count, with the OS, the bytes each rank sent across
nodes: a right answer that sends the whole tensor over the slow link is still wrong."""
from __future__ import annotations

import torch

from ...ledger import CommLedger, WireMeter
from ...pool.cluster import Cluster, current, start
from ...runtime.topology import Topology
from .checking import Verdict, _inputs, _run, by_rank, collectives_made, what_is_wrong

SLACK = 1.05, 4096  # gloo's message headers and TCP's small messages: 5 % and 4 KiB over the ring's bytes


def _node_pool(world_size: int, nodes: int):
    """The notebook's pool if it already has this shape (its link rates kept), else a new one."""
    try:
        pool = current()
    except RuntimeError:  # (no pool running)
        pool = None
    if pool is not None and pool.world_size == world_size and pool.nodes == nodes:
        return pool
    return start(world_size, nodes=nodes, verbose=False)


def _node_pools(world_size: int, nodes: int, also):
    """The notebook's pool of this shape (or a new one), then a short-lived one of `also` = (world size,
    nodes), each opened only when the one before is done with."""
    yield _node_pool(world_size, nodes)
    if also and tuple(also) != (world_size, nodes):
        with Cluster(world_size=also[0], nodes=also[1], verbose=False) as other:
            yield other


def _bytes_note(pool) -> str:
    if pool.backend == "gloo":
        return "bytes across nodes counted by the OS"
    return "bytes across nodes not checked: the OS counts gloo's TCP only, not NCCL's traffic"


def _across_limit(nbytes: float) -> int:
    return int(SLACK[0] * nbytes + SLACK[1])


def _try_hierarchical(fn, numel, dtype):
    import torch.distributed as dist

    x = _inputs(dist.get_rank(), numel, dtype)
    want = x.clone()
    dist.all_reduce(want)
    with WireMeter() as wire, CommLedger() as ledger:
        got = fn(x)
    method = collectives_made(dict(ledger.calls), {"reduce_scatter": 1, "all_reduce": 1, "all_gather": 1},
                              "three hops: reduce-scatter within the node, all-reduce of the shard across nodes, "
                              "all-gather within the node")
    return (got.cpu() if isinstance(got, torch.Tensor) else got), want.cpu(), wire.by_node, method


def check_hierarchical_all_reduce(fn, world_size: int = 4, nodes: int = 2, sizes=(65532, 12),
                                  dtype=torch.float32, also=(6, 2)) -> Verdict:
    """Exercise (chapter 13): `fn(tensor) -> tensor`, the all-reduce (sum) in three hops: reduce-scatter
    within the node, all-reduce of this rank's shard across nodes (with the ranks of the same local
    rank), all-gather within the node (`zeronb.runtime.groups.node_groups()` gives the two groups). Besides
    the sum, each rank may send at most 2(k-1)/k of its shard across nodes (k nodes, measured by
    the OS; 5 % and 4 KiB allowed for headers). Checked on `world_size` ranks on `nodes` nodes, then on
    `also` = (ranks, nodes); sizes divide evenly by both world sizes."""
    title = "hierarchical all-reduce"
    problems = []
    for pool in _node_pools(world_size, nodes, also):
        k, g = pool.nodes, pool.world_size // pool.nodes
        where = f"on {k} nodes x {g} ranks, " if also else ""
        for numel in sizes:
            res, err = _run(pool, _try_hierarchical, fn, numel, dtype, timeout=60)
            if err:
                return Verdict(title, [f"{where}with {numel} elements: {err}"])
            n = numel // g
            chunks = [(c * n, (c + 1) * n) for c in range(g)]
            nbytes = numel * torch.tensor([], dtype=dtype).element_size()
            bound = _across_limit(2 * (k - 1) / k * nbytes / g)
            found = {}
            for rank, (got, want, by_node, method) in enumerate(res):
                mine = [method] if method else []
                wrong = what_is_wrong("the result", got, want, dtype, chunks)
                mine += [wrong] if wrong else []
                if numel >= 4096 and by_node is not None and by_node["across"] > bound:
                    mine.append(
                        f"sent {by_node['across']} bytes across nodes ({numel} elements, {nbytes} bytes); the "
                        f"hierarchical all-reduce sends 2(k-1)/k of its 1/{g} shard, {2 * (k - 1) / k * nbytes / g:.0f} "
                        "bytes (did the whole tensor, rather than the node's reduced shard, cross, or were the two "
                        "groups swapped?)")
                found[rank] = mine
            problems += [f"{where}with {numel} elements, {p}" for p in by_rank(found, pool.world_size)]
            if problems:  # (the same mistake again at the next size says nothing new)
                break
        note = _bytes_note(pool)
        if problems:
            break
    shapes = f"{nodes} nodes x {world_size // nodes} ranks" + (f" and {also[1]} nodes x {also[0] // also[1]}" if also else "")
    return Verdict(title, problems, [f"checked on {shapes}, sizes {list(sizes)}, against dist.all_reduce; {note}"])


def _try_hsdp_gradient(fn, numel):
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    topology = Topology.from_env()
    grad = _inputs(rank, numel, torch.float64)
    mean = torch.stack([_inputs(r, numel, torch.float64) for r in range(n)]).mean(0)
    c = numel // topology.per_node
    local = topology.local_rank(rank)
    want = mean[local * c:(local + 1) * c]
    with WireMeter() as wire, CommLedger() as ledger:
        got = fn(grad.clone())
    got = got.cpu() if isinstance(got, torch.Tensor) else got
    known = [(mean[j * c:(j + 1) * c], f"shard {j} of the average where local rank {local} holds shard {local}: the "
                                       "reduce-scatter within the node hands shard i to local rank i")
             for j in range(topology.per_node) if j != local]
    known += [(want * f, f"{f:g} x the average; the average over all {n} ranks is their sum divided by {n}")
              for f in (n / topology.per_node, float(n), float(topology.per_node)) if f != 1]
    if n != 4:
        known.append((want * n / 4, f"divided by 4: the average over all {n} ranks is their sum divided by {n}"))
    wrong = what_is_wrong("the gradient shard", got, want.cpu(), torch.float64, known=known)
    method = collectives_made(dict(ledger.calls), {"reduce_scatter": 1, "all_reduce": 1},
                              "a reduce-scatter within the node, then an all-reduce of the shard across nodes")
    return [p for p in (method, wrong) if p], wire.by_node


def check_hsdp_gradient(fn, world_size: int = 4, nodes: int = 2, numel: int = 32766, also=(6, 2)) -> Verdict:
    """Exercise (chapter 13): `fn(flat_grad) -> shard`, HSDP's gradient path: this rank's 1/g shard
    (g ranks per node; shard i for local rank i) of the gradient averaged over every rank of every
    node, made by a reduce-scatter within the node and an all-reduce of the shard across nodes.
    Checked against the average computed in one process, and by the bytes each rank sent across
    nodes: at most 2(k-1)/k of the shard (5 % and 4 KiB allowed for headers); on `world_size` ranks on
    `nodes` nodes, then on `also` = (ranks, nodes)."""
    title = "HSDP gradient: reduce-scatter within, all-reduce across"
    problems = []
    for pool in _node_pools(world_size, nodes, also):
        k, g = pool.nodes, pool.world_size // pool.nodes
        res, err = _run(pool, _try_hsdp_gradient, fn, numel, timeout=60)
        where = f"on {k} nodes x {g} ranks, " if also else ""
        if err:
            return Verdict(title, [where + err])
        shard_bytes = numel // g * 8
        bound = _across_limit(2 * (k - 1) / k * shard_bytes)
        found = {}
        for rank, (mine, by_node) in enumerate(res):
            if by_node is not None and by_node["across"] > bound:
                mine.append(f"sent {by_node['across']} bytes across nodes; all-reducing the {shard_bytes}-byte shard "
                            f"sends {2 * (k - 1) / k * shard_bytes:.0f} (did the whole gradient cross before the node "
                            "reduced it, or were the two groups swapped?)")
            found[rank] = mine
        problems = [where + p for p in by_rank(found, pool.world_size)]
        note = _bytes_note(pool)
        if problems:
            break
    shapes = f"{nodes} nodes x {world_size // nodes} ranks" + (f" and {also[1]} nodes x {also[0] // also[1]}" if also else "")
    return Verdict(title, problems, [f"checked on {shapes}, {numel} float64 elements, against the gradient "
                                     f"averaged in one process; {note}"])
