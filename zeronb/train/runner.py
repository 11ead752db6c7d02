"""`run(RunConfig(...))`: train with a ZeRO stage - on a pool of ranks, under torchrun, or in one
process - and `run_many`, several runs on the same ranks. (`python -m zeronb.train`, zeronb.train.cli,
is the same from the command line.)

    python -m zeronb.train --stage 2 --nproc 4 --model gpt --precision float64 --steps 5 --report r.json
    torchrun --nproc-per-node 4 -m zeronb.train --stage 3 --model mlp    # joins torchrun's group

Stage 0 is data parallelism (DDP); `--nproc 1 --stage 0` is plain single-process training on the
whole global batch - the reference every stage must match. `--impl torch` runs PyTorch's own
counterpart instead of zeronb's: DistributedDataParallel (0), ZeroRedundancyOptimizer (1), FSDP2
`fully_shard` with reshard_after_forward False (2) and True (3). `--optimizer sgd` trains with
plain SGD, whose parameters show a gradient scaled by a constant (Adam's hardly do).

Training in practice, for every stage and both impls (each also for the single-process reference):
`--grad-accum K` (K micro-batches per rank and step; `--accum-sync every|last` says when gradients
are communicated), `--clip NORM` (global-norm clipping over shards), `--reduce-dtype fp32|bf16`
(the dtype gradients are reduced in), `--activation-checkpointing` (recompute each unit's
activations in backward), `--shard-size G` (shard over groups of G ranks and replicate across
them: HSDP), `--checkpoint DIR` (a sharded checkpoint at the end, with
torch.distributed.checkpoint) and `--resume DIR` (load it on any number of ranks and train on to
`--steps` in total); `python -m zeronb.checkpoint DIR OUT` exports one file of full tensors.

The report (--report, JSON) holds the settings and, per rank, what zeronb.train.runs.RankReport lists:
the bytes of parameters, gradients and optimizer state it holds between steps and what
zeronb.memory's formula expects, the bytes it sent in the last step per collective (logical:
what the algorithm sends) and on the wire (what the OS counted on gloo's TCP connections; None
under NCCL), CUDA's allocated and peak bytes on a GPU, the activations saved in the last forward,
the gradient bytes held after each micro-batch, the gradient norm (with --clip), the median step
time, and the final loss (of the global batch).
"""
from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist

from ..pool.cluster import Cluster
from ..runtime.backend import join_torchrun_group
from ..runtime.topology import parse_rate
from .ranks import train_rank, train_ranks
from .reference import train_single
from .runs import RunConfig, RunReport


def run(config: RunConfig, pool=None, build=None) -> RunReport:
    """Train as `config` says; the report, with rank 0's final parameters in `params`. Inside a
    process group (torchrun, or a rank) it trains there; `nproc` 1 at stage 0 is the one-process
    reference; otherwise on `pool` (a zeronb.Cluster) or on a new pool of `nproc` ranks.
    `build(model, stage_config)`: train with that stage instead of the one the config names."""
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized()
    if dist.is_initialized() or under_torchrun:
        if under_torchrun:
            join_torchrun_group()
        mine = train_rank(config, build)
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, dataclasses.replace(mine, params=None, grads=None))
        ranks[dist.get_rank()] = mine
        return RunReport(config, len(ranks), ranks, mine.params)
    if pool is None and build is None and config.nproc == 1 and config.stage == 0 and config.impl == "zeronb" \
            and not (config.checkpoint or config.resume):
        return train_single(config)
    return run_many([config], pool, build)[0]


def run_many(configs, pool=None, build=None):
    """Several runs, one after another on the same ranks in one call (the same processes, the same
    conditions): a RunReport each, in a list for a list of configs, by key for a dict of them."""
    if isinstance(configs, dict):
        return dict(zip(configs, run_many(list(configs.values()), pool, build)))

    if pool is None:
        pools = {(c.nproc or 2, c.nodes or 1, c.inter_node_bandwidth, c.intra_node_bandwidth) for c in configs}
        if len(pools) > 1:
            raise ValueError(f"run_many runs every config on one pool; they ask for different ones (ranks, nodes, "
                             f"links): {sorted(pools, key=str)}")
        size, nodes, inter, intra = pools.pop()
        _check_nodes(configs, nodes)
        with Cluster(size, verbose=False, nodes=nodes, inter_node_bandwidth=inter, intra_node_bandwidth=intra) as new:
            return run_many(configs, new, build)
    for c in configs:
        _check_fits(c, pool)
    _check_nodes(configs, pool.nodes)
    per_rank = pool.run(train_ranks, configs, build, timeout=sum(c.timeout for c in configs), echo=False)
    return [RunReport(config, pool.world_size, [r[i] for r in per_rank], per_rank[0][i].params)
            for i, config in enumerate(configs)]


def _check_nodes(configs: list, nodes: int) -> None:
    if nodes == 1 and any(c.hpz or c.shard_group == "node" for c in configs):
        raise ValueError("hpz and shard_group 'node' need a pool on several nodes: give nodes=2 (--nodes 2), or run "
                         "on a pool started with zeronb.start(world_size=4, nodes=2)")


def _check_fits(config: RunConfig, pool) -> None:
    """A config run on a given pool takes the pool as it is: what it asks of the pool must match."""
    asked = {"ranks": (config.nproc, pool.world_size), "nodes": (config.nodes, pool.nodes),
             "inter_node_bandwidth": (parse_rate(config.inter_node_bandwidth), pool.links["inter"]),
             "intra_node_bandwidth": (parse_rate(config.intra_node_bandwidth), pool.links["intra"])}
    for what, (want, have) in asked.items():
        if want is not None and want != have:
            raise ValueError(f"the pool has {what} {have}, the config asks for {want}: leave it unset to run on the "
                             "pool as it is, or start a pool with those settings")
