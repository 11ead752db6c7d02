"""What each rank of a run does: build the model and its stage, train, watch the last step from
outside (memory, bytes, timeline), and report (a RankReport). (Under torchrun, zeronb.train.runner
joins torchrun's process group first: zeronb.runtime.backend.join_torchrun_group.)"""
from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from .. import checkpoint, memory
from ..ledger import CommLedger
from ..models import checkpoint_activations, local_batch, make_model, num_params
from ..runtime.backend import backend_for, device
from ..zero.observe import Gradients, MemoryTrace, PhaseTraffic, StepMemory, Timeline
from .runs import RankReport, RunConfig
from .stages import build_stage


def train_rank(config: RunConfig, build=None) -> RankReport:
    """Run inside a rank (a pool's or torchrun's): train, measure, and report. `build`: see build_stage."""
    rank, n = dist.get_rank(), dist.get_world_size()
    cfg, dtype, dev = config.model_config(), config.torch_dtype(), device()
    # bytes on the wire, as the OS counts them, where gloo carries the traffic over TCP
    wire = sys.platform.startswith("linux") and backend_for(dev) == "gloo"
    model = make_model(cfg, dtype, dev)
    if config.activation_checkpointing:
        checkpoint_activations(model)
    psi = num_params(model)  # (before the stage is built: DeepSpeed's stage 3 empties the parameters it partitions)
    stage = build_stage(config, model, build)
    first = 0
    if config.resume:  # the saved shards, resharded by DCP onto this many ranks
        first = checkpoint.load(stage, config.resume)["steps_done"]
    # the last step is watched from outside (zeronb.zero.observe, and a CommLedger counting its bytes);
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
        checkpoint.save(stage, config.checkpoint, {**config.settings(), "steps_done": config.steps})
    loss = torch.tensor([losses[-1]], dtype=torch.float64, device=dev)
    dist.all_reduce(loss)  # equal local batches: the mean of local losses is the global batch's loss
    per_parameter = memory.bytes_per_parameter(config.precision, config.optimizer)
    # the median unobserved step after the first (which warms up); the observed one if none other ran
    step_ms = statistics.median(times[1:] or times) * 1e3 if times else observed_ms
    timeline = traced[0] if traced else None
    report = RankReport(
        rank=rank, device=str(dev), num_params=psi, steps_taken=config.steps - first, final_loss=loss.item() / n,
        step_ms=step_ms, bytes=memory.measure(**stage.state_tensors()),
        expected_bytes=memory.model_state_breakdown(psi, stage.num_shards, config.stage, *per_parameter),
        sent_bytes_per_step=dict(ledger.by_op), calls_per_step=dict(ledger.calls), elements_per_step=dict(ledger.elements),
        wire_bytes_per_step=ledger.wire_bytes,
        wire_within_node=(ledger.wire_by_node or {}).get("within"), wire_across_nodes=(ledger.wire_by_node or {}).get("across"),
        grad_norm=stage.last_grad_norm if config.clip_norm is not None else None,
        activation_bytes=step_memory.activation_bytes,
        grad_bytes_after_micro_batch=step_memory.grad_bytes_after_micro_batch, grads=gradients.pieces,
        timeline=timeline.spans() if timeline else None, events=timeline.records() if timeline else None,
        timeline_origin=timeline.origin if timeline else None, memory_trace=traced[1].notes if traced else None,
        phases=traced[2].phases if traced else None,
        params={k: v.cpu() for k, v in stage.full_parameters().items()}, swept_bytes=memory.resident_bytes(stage),
        **memory.cuda_memory(dev))
    stage.close()  # (a pool's rank lives on: DeepSpeed's engine lets go of its hooks and buffers)
    return report


def train_ranks(configs: list, build=None) -> list:
    return [train_rank(c, build) for c in configs]
