"""`python -m zeronb.train`: the ZeRO stages as a script - on a pool of ranks, or under torchrun.

    python -m zeronb.train --stage 2 --nproc 4 --model gpt --dtype float64 --steps 5 --report r.json
    torchrun --nproc-per-node 4 -m zeronb.train --stage 3 --model mlp    # joins torchrun's group

Stage 0 is data parallelism (DDP); `--nproc 1 --stage 0` is plain single-process training on the
whole global batch - the reference every stage must match. `--impl torch` runs PyTorch's own
counterpart instead of zeronb's: DistributedDataParallel (0), ZeroRedundancyOptimizer (1), FSDP2
`fully_shard` with reshard_after_forward False (2) and True (3).

Training in practice, for every stage and both impls (each also for the single-process reference):
`--grad-accum K` (K micro-batches per rank and step; `--accum-sync every|last` says when gradients
are communicated), `--clip NORM` (global-norm clipping over shards), `--reduce-dtype fp32|bf16`
(the dtype gradients are reduced in), `--activation-checkpointing` (recompute each unit's
activations in backward), `--checkpoint DIR` (a sharded checkpoint at the end, with
torch.distributed.checkpoint) and `--resume DIR` (load it on any number of ranks and train on to
`--steps` in total); `python -m zeronb.checkpoint DIR OUT` exports one file of full tensors.

The report (--report) holds, per rank, the bytes of parameters, gradients and optimizer state it
holds between steps, the bytes zeronb.memory's formula expects, the bytes it sent in the last step
per collective (logical: what the algorithm sends) and on the wire (what the OS counted on gloo's
TCP connections; None under NCCL), the device, CUDA's allocated and peak bytes on a GPU, the
activations saved in the last forward, the gradient bytes held after each micro-batch, the gradient
norm (with --clip), and the median step time; plus the final loss (of the global batch) and the
settings above.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from . import memory
from .ledger import CommLedger
from .models import Config, checkpoint_activations, global_batch, local_batch, make_model, num_params
from .zero.common import model_dtype


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m zeronb.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=0)
    p.add_argument("--nproc", type=int, default=2, help="ranks to start (ignored under torchrun)")
    p.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    p.add_argument("--dtype", choices=["float32", "float64", "bf16-mixed"], default="float32")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--impl", choices=["zeronb", "torch"], default="zeronb")
    p.add_argument("--prefetch", action="store_true", help="stage 3: prefetch the next unit's parameters")
    p.add_argument("--grad-accum", type=int, default=1, metavar="K",
                   help="split each rank's share of --global-batch into K micro-batches; the result is still "
                        "one step on the whole global batch")
    p.add_argument("--clip", type=float, default=None, metavar="NORM",
                   help="clip by the global gradient norm, as torch.nn.utils.clip_grad_norm_ would on one "
                        "process holding the whole model")
    p.add_argument("--reduce-dtype", choices=["fp32", "bf16"], default=None,
                   help="the dtype gradients are reduced in (default: their own); bf16 halves the bytes")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each unit's activations in backward instead of keeping them")
    p.add_argument("--accum-sync", choices=["every", "last"], default="every",
                   help="with --grad-accum: communicate gradients after every micro-batch, or only after the "
                        "last (DDP's no_sync; ZeRO-2/3 keep the full gradients until then)")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="save a sharded checkpoint (torch.distributed.checkpoint) here at the end")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="load a checkpoint saved by --checkpoint (on any number of ranks) and train on until "
                        "--steps steps in total have been taken")
    p.add_argument("--report", default=None, help="write the JSON report here")
    p.add_argument("--save-params", default=None, help="rank 0 saves {name: full tensor} here (torch.save)")
    p.add_argument("--timeout", type=float, default=600, help="seconds for the whole run on a pool")
    args = p.parse_args(argv)
    if args.impl == "torch" and args.dtype == "bf16-mixed":
        p.error("--impl torch runs float32 or float64 (the comparison is about the algorithm, not precision)")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if args.clip is not None and not args.clip > 0:
        p.error(f"--clip must be a positive norm, not {args.clip}")
    if args.grad_accum < 1 or args.global_batch % args.grad_accum:
        p.error(f"--grad-accum must be a positive divisor of --global-batch ({args.global_batch}), not {args.grad_accum}")
    if args.resume is not None:
        from . import checkpoint

        try:
            info = checkpoint.read_info(args.resume)
            checkpoint.check_compatible(info, _settings(args))
        except (FileNotFoundError, ValueError) as e:
            p.error(f"--resume: {e}")
        if info["steps_done"] >= args.steps:
            p.error(f"--resume: the checkpoint has taken {info['steps_done']} steps already; --steps counts the "
                    f"total, so ask for more than {info['steps_done']}")
    return args


def _settings(args) -> dict:
    """What a checkpoint records of the run (a resume must share its structure: checkpoint.STRUCTURE)."""
    return {"stage": args.stage, "impl": args.impl, "model": args.model, "dtype": args.dtype,
            "seed": args.seed, "global_batch": args.global_batch, "lr": args.lr}


def _config(args) -> Config:
    return Config(kind=args.model, seed=args.seed, global_batch=args.global_batch)


# --- the reference: one process, the whole batch ---------------------------------------------------

def train_single(args, device=None) -> dict:
    """Plain training in one process on the whole global batch: what every stage must reproduce.
    It runs where a 1-rank pool would (the GPU, if there is one) and keeps its gradients between
    steps as DDP's buckets do, so that its report counts what stage 0 counts."""
    from .backend import choose_backend, rank_device

    dev = torch.device(device) if device is not None else rank_device(choose_backend(1)[0], 0)
    cfg, dtype = _config(args), model_dtype(args.dtype)
    model = make_model(cfg, dtype, dev)
    if args.activation_checkpointing:
        checkpoint_activations(model)
    params = list(model.parameters())
    mixed = args.dtype == "bf16-mixed"
    master = [p.detach().float().clone() for p in params] if mixed else params
    opt = torch.optim.Adam(master, lr=args.lr, foreach=False)
    memory.reset_cuda_peak(dev)
    losses, times, grad_norm = [], [], None
    for step in range(args.steps):
        t0 = time.perf_counter()
        x, y = global_batch(cfg, step, dtype, dev)
        last = step == args.steps - 1
        with memory.saved_activations(exclude=params) if last else contextlib.nullcontext() as saved:
            loss = model.loss(model(x), y)  # (activations counted in the last step, as the pool's ranks do)
        for p in params:  # zeroed in place, as DDP zeroes its buckets: the buffers stay
            if p.grad is not None:
                p.grad.zero_()
        loss.backward()
        if mixed:
            for m, p in zip(master, params):
                m.grad = p.grad.float()
        if args.clip is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(master, args.clip).item()
        opt.step()
        if mixed:
            with torch.no_grad():
                for m, p in zip(master, params):
                    p.copy_(m)
                    m.grad = None  # the fp32 copy of a gradient lives only for the step
        losses.append(loss.item())
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    state = {"params": params, "grads": [p.grad for p in params],
             "optimizer": memory.optimizer_tensors(opt) + (master if mixed else [])}
    rank_report = _rank_report(args, model, state, {}, times, world_size=1, rank=0, device=dev)
    rank_report["grad_norm"] = grad_norm if args.clip is not None else None
    rank_report["activation_bytes"] = saved["bytes"]
    # the fields a rank of a pool reports, for one process: nothing communicated, no micro-batches
    # (the reference takes the whole batch at once; --grad-accum does not change its result)
    rank_report.update(calls_per_step={}, wire_bytes_per_step=None, grad_bytes_after_micro_batch=None, steps_taken=args.steps,
                       final_loss=losses[-1], events=[], memory_timeline=[])
    return {"losses": losses, "ranks": [rank_report],
            "params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()}}


def max_diff(a: dict, b: dict) -> float:
    """Largest |difference| over all parameters of two {name: tensor} dicts (on the CPU): how far a
    run is from the reference. The two must name the same parameters."""
    if set(a) != set(b):
        raise ValueError(f"the two runs name different parameters: {sorted(set(a) ^ set(b))}")
    return max((a[k].detach().cpu() - b[k].detach().cpu()).abs().max().item() for k in a)


# --- one rank of a distributed run ---------------------------------------------------------------

def _engine(args, model):
    """The stage to train with: zeronb's own, or PyTorch's counterpart."""
    sync_each = args.accum_sync == "every"
    reduce_dtype = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16}[args.reduce_dtype]
    if args.impl == "zeronb":
        from .zero import STAGES

        kw = {"prefetch": args.prefetch} if args.stage == 3 else {}
        if args.stage != 1:  # ZeRO-1 holds full gradients anyway and reduce-scatters once, at the step
            kw["sync_each_micro_batch"] = sync_each
        engine = STAGES[args.stage](model, precision=args.dtype, lr=args.lr, **kw)
    else:
        from .torch_impls import TorchStage

        engine = TorchStage(model, args.stage, lr=args.lr, sync_each_micro_batch=sync_each, reduce_dtype=reduce_dtype)
    engine.clip_norm = args.clip
    engine.reduce_dtype = reduce_dtype
    return engine


def train_rank(args) -> dict:
    """Run inside a rank (a pool's or torchrun's): train, measure, and report."""
    rank, n = dist.get_rank(), dist.get_world_size()
    cfg, dtype = _config(args), model_dtype(args.dtype)
    from .backend import backend_for, device

    dev = device()
    # bytes on the wire, as the OS counts them, where gloo carries the traffic over TCP
    wire = sys.platform.startswith("linux") and backend_for(dev) == "gloo"
    model = make_model(cfg, dtype, dev)
    if args.activation_checkpointing:
        checkpoint_activations(model)
    engine = _engine(args, model)
    first = 0
    if args.resume:  # the saved shards, resharded by DCP onto this many ranks
        from . import checkpoint

        first = checkpoint.load(engine, args.resume)["steps_done"]
    memory.reset_cuda_peak(dev)  # the peak this run reaches, not an earlier call's on this rank
    losses, times = [], []
    for step in range(first, args.steps):
        x, y = local_batch(cfg, step, rank, n, dtype, dev)
        engine.measure_memory = step == args.steps - 1  # the last step's, for the report (it costs time)
        dist.barrier()
        t0 = time.perf_counter()
        with CommLedger(wire=wire) as ledger:
            losses.append(engine.train_step(x, y, micro_batches=args.grad_accum))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    sent, calls = dict(ledger.by_op), dict(ledger.calls)  # the last step's traffic
    if args.checkpoint:
        from . import checkpoint

        checkpoint.save(engine, args.checkpoint, {**_settings(args), "steps_done": args.steps})
    loss = torch.tensor([losses[-1]], dtype=torch.float64, device=dev)
    dist.all_reduce(loss)  # equal local batches: the mean of local losses is the global batch's loss
    report = _rank_report(args, model, engine.state_tensors(), sent, times, n, rank, dev)
    report["final_loss"] = loss.item() / n
    report["calls_per_step"] = calls
    report["grad_norm"] = engine.last_grad_norm if args.clip is not None else None  # before clipping
    report["activation_bytes"] = engine.activation_bytes  # saved in the last micro-batch's forward
    report["wire_bytes_per_step"] = ledger.wire_bytes  # None where the OS cannot count (NCCL)
    # gradients held after each micro-batch's backward (zeronb's engines): what accumulation costs
    report["grad_bytes_after_micro_batch"] = getattr(engine, "grad_bytes_after_micro_batch", None)
    report["steps_taken"] = args.steps - first  # (fewer than --steps after --resume)
    report["memory_timeline"] = getattr(engine, "memory", [])
    report["events"] = [list(e) for e in getattr(engine, "events", [])]
    full = engine.full_parameters()
    report["params"] = {k: v.cpu() for k, v in full.items()} if rank == 0 else None
    return report


def _rank_report(args, model, state, sent, times, world_size, rank, device) -> dict:
    psi = num_params(model)
    per = memory.PRECISIONS[args.dtype]
    expected = memory.model_state_breakdown(psi, world_size, args.stage if world_size > 1 else 0, *per)
    steady = times[1:] or times  # the first step pays for warm-up (allocations, connections)
    return {"rank": rank, "bytes": memory.measure(**state), "expected_bytes": expected,
            "sent_bytes_per_step": sent, "step_ms": statistics.median(steady) * 1e3,
            "num_params": psi, "device": str(device), **memory.cuda_memory(device)}


# --- putting it together ---------------------------------------------------------------------------

def run(args) -> dict:
    """Train as the arguments say; return the report (with the final parameters under "params")."""
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized()
    if dist.is_initialized() or under_torchrun:
        if under_torchrun:
            _join_torchrun_group()
        out = train_rank(args)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {k: v for k, v in out.items() if k != "params"})
        ranks, params, world_size = gathered, out["params"], dist.get_world_size()
        losses = [r["final_loss"] for r in ranks]
    elif args.nproc == 1 and args.stage == 0 and args.impl == "zeronb" and not (args.checkpoint or args.resume):
        single = train_single(args)
        ranks, params, world_size = single["ranks"], single["params"], 1
        losses = [single["losses"][-1]]
    else:
        from .cluster import Cluster

        with Cluster(args.nproc, verbose=False) as cluster:
            ranks = list(cluster.run(train_rank, args, timeout=args.timeout, echo=False))
        params, world_size = ranks[0]["params"], args.nproc
        for r in ranks:
            r.pop("params", None)
        losses = [r["final_loss"] for r in ranks]
    return {"stage": args.stage, "world_size": world_size, "impl": args.impl, "model": args.model,
            "dtype": args.dtype, "grad_accum": args.grad_accum, "accum_sync": args.accum_sync,
            "clip": args.clip, "reduce_dtype": args.reduce_dtype,
            "activation_checkpointing": args.activation_checkpointing,
            "checkpoint": args.checkpoint, "resume": args.resume,
            "num_params": ranks[0]["num_params"], "final_loss": losses[0],
            "ranks": ranks, "params": params}


def _join_torchrun_group() -> None:
    """Under torchrun: join its process group (env:// reads RANK, WORLD_SIZE, MASTER_ADDR/PORT),
    on this node's GPU LOCAL_RANK where every local rank has one, on the CPU otherwise."""
    from .backend import cuda_device_count, join_group

    local_rank, per_node = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if dist.is_nccl_available() and cuda_device_count() >= per_node:
        join_group("nccl", torch.device("cuda", local_rank))
    else:
        join_group("gloo", torch.device("cpu"))


def main(argv=None) -> int:
    args = parse_args(argv)
    report = run(args)
    params = report.pop("params")
    is_writer = not dist.is_initialized() or dist.get_rank() == 0
    if is_writer:
        if args.save_params:
            torch.save(params, args.save_params)
        if args.report:
            with open(args.report, "w") as f:
                json.dump(report, f, indent=1)
        r0 = report["ranks"][0]
        sent, wire = sum(r0["sent_bytes_per_step"].values()), r0.get("wire_bytes_per_step")
        on_wire = f" ({wire / 1024:.1f} KiB on the wire)" if wire is not None else ""
        print(f"stage {args.stage} ({args.impl}), {report['world_size']} rank(s), {args.model}, {args.dtype}: "
              f"final loss {report['final_loss']:.6f}; rank 0 holds {sum(r0['bytes'].values()) / 1024:.1f} KiB "
              f"of model states, sent {sent / 1024:.1f} KiB{on_wire} in the last step, {r0['step_ms']:.1f} ms/step")
    if dist.is_initialized() and "RANK" in os.environ:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
