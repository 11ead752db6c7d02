"""`python -m zeronb.train`: the command line of zeronb.train.run (see zeronb.train.runner for what
it trains and reports)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch
import torch.distributed as dist

from ..models import MODELS
from ..precision import OPTIMIZERS, PRECISIONS
from ..zero import STAGES
from ..zero.config import REDUCE_SCATTERS
from ..zero.zeropp import QUANTIZE_WEIGHTS
from .runner import __doc__ as RUN_DOC
from .runner import run
from .runs import IMPLS, REDUCE_DTYPES, SHARD_GROUPS, RunConfig


def parse_args(argv=None) -> RunConfig:
    """The command line, parsed into a RunConfig (a bad combination exits with what to do)."""
    return _parse(argv)[0]


def _parse(argv):
    """(RunConfig, args): the run, and where the command line writes its results."""
    d = RunConfig()
    p = argparse.ArgumentParser(prog="python -m zeronb.train", description=RUN_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, choices=list(STAGES), default=d.stage)
    p.add_argument("--nproc", type=int, default=2, help="ranks to start (ignored under torchrun)")
    p.add_argument("--model", choices=MODELS, default=d.model)
    p.add_argument("--precision", "--dtype", choices=list(PRECISIONS), default=d.precision,
                   help="float32, float64, or bf16-mixed (bf16 compute, fp32 master weights); --dtype: the same")
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default=d.optimizer,
                   help="Adam, or plain SGD (no momentum): parity under SGD shows a mis-scaled gradient")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--global-batch", type=int, default=d.global_batch)
    p.add_argument("--impl", choices=IMPLS, default=d.impl)
    p.add_argument("--prefetch", action="store_true", help="stage 3: prefetch the next unit's parameters")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum, metavar="K",
                   help="split each rank's share of --global-batch into K micro-batches; the result is still "
                        "one step on the whole global batch")
    p.add_argument("--accum-sync", choices=["every", "last"], default="every",
                   help="with --grad-accum: communicate gradients after every micro-batch, or only after the "
                        "last (DDP's no_sync; ZeRO-2/3 keep the full gradients until then)")
    p.add_argument("--clip", dest="clip_norm", type=float, default=None, metavar="NORM",
                   help="clip by the global gradient norm, as torch.nn.utils.clip_grad_norm_ would on one "
                        "process holding the whole model")
    p.add_argument("--reduce-dtype", choices=[k for k in REDUCE_DTYPES if k], default=None,
                   help="the dtype gradients are reduced in (default: their own); bf16 halves the bytes")
    p.add_argument("--reduce-scatter", choices=REDUCE_SCATTERS, default=d.reduce_scatter,
                   help="the stages' reduce-scatters: the backend's, or zeronb's ring (on gloo the wire then "
                        "shows a reduce-scatter's bytes, not the all-reduce gloo runs instead)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each unit's activations in backward instead of keeping them")
    p.add_argument("--shard-size", type=int, default=None, metavar="G",
                   help="shard over groups of G consecutive ranks and replicate across the groups (HSDP)")
    p.add_argument("--shard-group", choices=SHARD_GROUPS, default=d.shard_group,
                   help="node: shard within each node and replicate across the nodes (HSDP; with --grad-accum, "
                        "MiCS's two hops: the replicas' all-reduce once per step)")
    p.add_argument("--nodes", type=int, default=None, metavar="K",
                   help="simulate K nodes of nproc/K ranks each (ignored under torchrun: its nodes are real)")
    p.add_argument("--inter-node-bandwidth", default=None, metavar="RATE",
                   help="pace every link between nodes at RATE, e.g. 50MB/s (zeronb.runtime.links; Linux)")
    p.add_argument("--intra-node-bandwidth", default=None, metavar="RATE", help="pace the links within a node too")
    p.add_argument("--hpz", action="store_true",
                   help="stage 3: ZeRO++'s hpZ, a copy of the parameters sharded within the node for the backward "
                        "all-gathers (--impl torch: FSDP2 resharding to the node after forward)")
    p.add_argument("--quantize-weights", choices=[q for q in QUANTIZE_WEIGHTS if q], default=None,
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
        config = RunConfig(**{k: v for k, v in vars(args).items() if k in fields},
                           sync_each_micro_batch=args.accum_sync == "every")
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
        print(f"stage {config.stage} ({config.impl}), {report.world_size} rank(s), {config.model}, {config.precision}, "
              f"{config.optimizer}: final loss {report.final_loss:.6f}; rank 0 holds {sum(r0.bytes.values()) / 1024:.1f} "
              f"KiB of model states, sent {sent / 1024:.1f} KiB{on_wire} in the last step, {r0.step_ms:.1f} ms/step")
    if dist.is_initialized() and "RANK" in os.environ:
        dist.destroy_process_group()
    return 0
