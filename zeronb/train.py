"""`python -m zeronb.train`: the ZeRO stages as a script - on a pool of ranks, or under torchrun -
and `run(RunConfig(...))`, the same from Python.

    python -m zeronb.train --stage 2 --nproc 4 --model gpt --dtype float64 --steps 5 --report r.json
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

The report (--report, JSON) holds the settings and, per rank, what zeronb.runs.RankReport lists:
the bytes of parameters, gradients and optimizer state it holds between steps and what
zeronb.memory's formula expects, the bytes it sent in the last step per collective (logical:
what the algorithm sends) and on the wire (what the OS counted on gloo's TCP connections; None
under NCCL), CUDA's allocated and peak bytes on a GPU, the activations saved in the last forward,
the gradient bytes held after each micro-batch, the gradient norm (with --clip), the median step
time, and the final loss (of the global batch).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from . import memory
from .ledger import CommLedger
from .models import checkpoint_activations, choose_units, local_batch, make_model, num_params
from .observe import Gradients, MemoryTrace, PhaseTraffic, StepMemory, Timeline
from .parity import grad_diff, max_diff  # noqa: F401  (where the chapters and tests find them)
from .reference import train_single
from .runs import RankReport, RunConfig, RunReport

__all__ = ["RunConfig", "RunReport", "RankReport", "run", "run_many", "train_rank", "train_single",
           "build_stage", "parse_args", "main", "max_diff", "grad_diff"]


# --- one rank of a distributed run ---------------------------------------------------------------

def build_stage(config: RunConfig, model, build=None):
    """The stage to train with, zeronb's own or PyTorch's counterpart, built from the run's settings
    (its process groups too: with shard_size, HSDP's). `build(model, stage_config)`: another
    stage class (a chapter's own, say) to train with instead of the one `config.stage` names."""
    from .nodes import node_groups
    from .torch_impls import TorchStage
    from .zero import STAGES, ZeROPlusPlus, sharding_groups

    groups = (node_groups() if config.shard_group == "node" else
              sharding_groups(config.shard_size) if config.shard_size else (None, None))
    stage_config = config.stage_config(*groups)
    if build is not None:
        return build(model, stage_config)
    if config.impl == "torch":
        return TorchStage(model, config.stage, stage_config, hpz=config.hpz)
    if config.stage != 3:
        return STAGES[config.stage](model, stage_config)
    zero3 = dict(prefetch=config.prefetch, reshard_after_forward=config.reshard_after_forward,
                 units=choose_units(model, config.wrap))  # ZeRO-3's own settings
    if config.hpz or config.quantize_weights:
        return ZeROPlusPlus(model, stage_config, hpz=config.hpz, quantize_weights=config.quantize_weights, **zero3)
    return STAGES[3](model, stage_config, **zero3)


def train_rank(config: RunConfig, build=None) -> RankReport:
    """Run inside a rank (a pool's or torchrun's): train, measure, and report. `build`: see build_stage."""
    from .backend import backend_for, device

    rank, n = dist.get_rank(), dist.get_world_size()
    cfg, dtype, dev = config.model_config(), config.torch_dtype(), device()
    # bytes on the wire, as the OS counts them, where gloo carries the traffic over TCP
    wire = sys.platform.startswith("linux") and backend_for(dev) == "gloo"
    model = make_model(cfg, dtype, dev)
    if config.activation_checkpointing:
        checkpoint_activations(model)
    stage = build_stage(config, model, build)
    first = 0
    if config.resume:  # the saved shards, resharded by DCP onto this many ranks
        from . import checkpoint

        first = checkpoint.load(stage, config.resume)["steps_done"]
    # the last step is watched from outside (zeronb.observe, and a CommLedger counting its bytes);
    # the others run with nothing watching, and are the ones timed
    step_memory, gradients = StepMemory(), Gradients()
    traced = [Timeline(dev), MemoryTrace(), PhaseTraffic(wire)] if config.trace else []
    memory.reset_cuda_peak(dev)  # the peak this run reaches, not an earlier call's on this rank
    losses, times = [], []
    try:
        for step in range(first, config.steps - 1):
            x, y = local_batch(cfg, step, rank, n, dtype, dev)
            dist.barrier()
            t0 = time.perf_counter()
            losses.append(stage.train_step(x, y, micro_batches=config.grad_accum))
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        x, y = local_batch(cfg, config.steps - 1, rank, n, dtype, dev)
        stage.observers = [step_memory, gradients, *traced]
        dist.barrier()
        t0 = time.perf_counter()
        with CommLedger(wire=wire) as ledger:
            losses.append(stage.train_step(x, y, micro_batches=config.grad_accum))
        observed_ms = (time.perf_counter() - t0) * 1e3
    finally:
        stage.observers = []  # (a pool's rank lives on: nothing of this run stays attached)
    if config.checkpoint:
        from . import checkpoint

        checkpoint.save(stage, config.checkpoint, {**config.settings(), "steps_done": config.steps})
    loss = torch.tensor([losses[-1]], dtype=torch.float64, device=dev)
    dist.all_reduce(loss)  # equal local batches: the mean of local losses is the global batch's loss
    psi, per_parameter = num_params(model), memory.bytes_per_parameter(config.dtype, config.optimizer)
    # the median unobserved step after the first (which warms up); the observed one if none other ran
    step_ms = statistics.median(times[1:] or times) * 1e3 if times else observed_ms
    timeline = traced[0] if traced else None
    return RankReport(
        rank=rank, device=str(dev), num_params=psi, steps_taken=config.steps - first, final_loss=loss.item() / n,
        step_ms=step_ms, bytes=memory.measure(**stage.state_tensors()),
        expected_bytes=memory.model_state_breakdown(psi, stage.shards, config.stage, *per_parameter),
        sent_bytes_per_step=dict(ledger.by_op), calls_per_step=dict(ledger.calls), wire_bytes_per_step=ledger.wire_bytes,
        wire_within_node=(ledger.wire_by_node or {}).get("within"), wire_across_nodes=(ledger.wire_by_node or {}).get("across"),
        grad_norm=stage.last_grad_norm if config.clip is not None else None,
        activation_bytes=step_memory.activation_bytes,
        grad_bytes_after_micro_batch=step_memory.grad_bytes_after_micro_batch, grads=gradients.pieces,
        timeline=timeline.spans() if timeline else None, events=timeline.records() if timeline else None,
        timeline_origin=timeline.origin if timeline else None, memory_trace=traced[1].notes if traced else None,
        phases=traced[2].phases if traced else None,
        params={k: v.cpu() for k, v in stage.full_parameters().items()}, **memory.cuda_memory(dev))


def _train_ranks(configs: list, build=None) -> list:
    return [train_rank(c, build) for c in configs]


# --- putting it together ---------------------------------------------------------------------------

def run(config: RunConfig, pool=None, build=None) -> RunReport:
    """Train as `config` says; the report, with rank 0's final parameters in `params`. Inside a
    process group (torchrun, or a rank) it trains there; `nproc` 1 at stage 0 is the one-process
    reference; otherwise on `pool` (a zeronb.Cluster) or on a new pool of `nproc` ranks.
    `build(model, stage_config)`: train with that stage instead of the one the config names."""
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized()
    if dist.is_initialized() or under_torchrun:
        if under_torchrun:
            _join_torchrun_group()
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
    from .cluster import Cluster

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
    per_rank = pool.run(_train_ranks, configs, build, timeout=sum(c.timeout for c in configs), echo=False)
    return [RunReport(config, pool.world_size, [r[i] for r in per_rank], per_rank[0][i].params)
            for i, config in enumerate(configs)]


def _check_nodes(configs: list, nodes: int) -> None:
    if nodes == 1 and any(c.hpz or c.shard_group == "node" for c in configs):
        raise ValueError("hpz and shard_group 'node' need a pool on several nodes: give nodes=2 (--nodes 2), or run "
                         "on a pool started with zeronb.start(world_size=4, nodes=2)")


def _check_fits(config: RunConfig, pool) -> None:
    """A config run on a given pool takes the pool as it is: what it asks of the pool must match."""
    from .nodes import parse_rate

    asked = {"ranks": (config.nproc, pool.world_size), "nodes": (config.nodes, pool.nodes),
             "inter_node_bandwidth": (parse_rate(config.inter_node_bandwidth), pool.links["inter"]),
             "intra_node_bandwidth": (parse_rate(config.intra_node_bandwidth), pool.links["intra"])}
    for what, (want, have) in asked.items():
        if want is not None and want != have:
            raise ValueError(f"the pool has {what} {have}, the config asks for {want}: leave it unset to run on the "
                             "pool as it is, or start a pool with those settings")


def _join_torchrun_group() -> None:
    """Under torchrun: join its process group (env:// reads RANK, WORLD_SIZE, MASTER_ADDR/PORT),
    on this node's GPU LOCAL_RANK where every local rank has one, on the CPU otherwise."""
    from .backend import cuda_device_count, join_group

    local_rank, per_node = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if dist.is_nccl_available() and cuda_device_count() >= per_node:
        join_group("nccl", torch.device("cuda", local_rank))
    else:
        join_group("gloo", torch.device("cpu"))


# --- the command line ---------------------------------------------------------------------------

def parse_args(argv=None) -> RunConfig:
    """The command line, parsed into a RunConfig (a bad combination exits with what to do)."""
    return _parse(argv)[0]


def _parse(argv):
    """(RunConfig, args): the run, and where the command line writes its results."""
    d = RunConfig()
    p = argparse.ArgumentParser(prog="python -m zeronb.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=d.stage)
    p.add_argument("--nproc", type=int, default=2, help="ranks to start (ignored under torchrun)")
    p.add_argument("--model", choices=["mlp", "gpt"], default=d.model)
    p.add_argument("--dtype", choices=["float32", "float64", "bf16-mixed"], default=d.dtype)
    p.add_argument("--optimizer", choices=["adam", "sgd"], default=d.optimizer,
                   help="Adam, or plain SGD (no momentum): parity under SGD shows a mis-scaled gradient")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--global-batch", type=int, default=d.global_batch)
    p.add_argument("--impl", choices=["zeronb", "torch"], default=d.impl)
    p.add_argument("--prefetch", action="store_true", help="stage 3: prefetch the next unit's parameters")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum, metavar="K",
                   help="split each rank's share of --global-batch into K micro-batches; the result is still "
                        "one step on the whole global batch")
    p.add_argument("--accum-sync", choices=["every", "last"], default=d.accum_sync,
                   help="with --grad-accum: communicate gradients after every micro-batch, or only after the "
                        "last (DDP's no_sync; ZeRO-2/3 keep the full gradients until then)")
    p.add_argument("--clip", type=float, default=None, metavar="NORM",
                   help="clip by the global gradient norm, as torch.nn.utils.clip_grad_norm_ would on one "
                        "process holding the whole model")
    p.add_argument("--reduce-dtype", choices=["fp32", "bf16"], default=None,
                   help="the dtype gradients are reduced in (default: their own); bf16 halves the bytes")
    p.add_argument("--reduce-scatter", choices=["torch", "ring"], default=d.reduce_scatter,
                   help="the stages' reduce-scatters: the backend's, or zeronb's ring (on gloo the wire then "
                        "shows a reduce-scatter's bytes, not the all-reduce gloo runs instead)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each unit's activations in backward instead of keeping them")
    p.add_argument("--shard-size", type=int, default=None, metavar="G",
                   help="shard over groups of G consecutive ranks and replicate across the groups (HSDP)")
    p.add_argument("--shard-group", choices=["world", "node"], default=d.shard_group,
                   help="node: shard within each node and replicate across the nodes (HSDP; with --grad-accum, "
                        "MiCS's two hops: the replicas' all-reduce once per step)")
    p.add_argument("--nodes", type=int, default=None, metavar="K",
                   help="simulate K nodes of nproc/K ranks each (ignored under torchrun: its nodes are real)")
    p.add_argument("--inter-node-bandwidth", default=None, metavar="RATE",
                   help="pace every link between nodes at RATE, e.g. 50MB/s (zeronb.nodes; Linux)")
    p.add_argument("--intra-node-bandwidth", default=None, metavar="RATE", help="pace the links within a node too")
    p.add_argument("--hpz", action="store_true",
                   help="stage 3: ZeRO++'s hpZ, a copy of the parameters sharded within the node for the backward "
                        "all-gathers (--impl torch: FSDP2 resharding to the node after forward)")
    p.add_argument("--quantize-weights", choices=["int8"], default=None,
                   help="stage 3 (zeronb): the forward all-gathers in int8, a scale per block (ZeRO++'s qwZ; lossy)")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="save a sharded checkpoint (torch.distributed.checkpoint) here at the end")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="load a checkpoint saved by --checkpoint (on any number of ranks) and train on until "
                        "--steps steps in total have been taken")
    p.add_argument("--report", default=None, help="write the JSON report here")
    p.add_argument("--save-params", default=None, help="rank 0 saves {name: full tensor} here (torch.save)")
    p.add_argument("--timeout", type=float, default=d.timeout, help="seconds for the whole run on a pool")
    args = p.parse_args(argv)
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    try:
        config = RunConfig(**{k: v for k, v in vars(args).items() if k in fields})
    except ValueError as e:
        p.error(str(e))
    return config, args


def main(argv=None) -> int:
    config, args = _parse(argv)
    report = run(config)
    is_writer = not dist.is_initialized() or dist.get_rank() == 0
    if is_writer:
        if args.save_params:
            torch.save(report.params, args.save_params)
        if args.report:
            with open(args.report, "w") as f:
                json.dump(report.to_json(), f, indent=1)
        r0 = report.ranks[0]
        sent, wire = sum(r0.sent_bytes_per_step.values()), r0.wire_bytes_per_step
        on_wire = f" ({wire / 1024:.1f} KiB on the wire)" if wire is not None else ""
        print(f"stage {config.stage} ({config.impl}), {report.world_size} rank(s), {config.model}, {config.dtype}, "
              f"{config.optimizer}: final loss {report.final_loss:.6f}; rank 0 holds {sum(r0.bytes.values()) / 1024:.1f} "
              f"KiB of model states, sent {sent / 1024:.1f} KiB{on_wire} in the last step, {r0.step_ms:.1f} ms/step")
    if dist.is_initialized() and "RANK" in os.environ:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
