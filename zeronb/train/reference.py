"""The reference every stage must match: plain training in one process, on the whole global batch,
with the same model, data, seed and optimizer. What `python -m zeronb.train --nproc 1` runs."""
from __future__ import annotations

import contextlib
import statistics
import time

import torch

from .. import memory
from ..models import checkpoint_activations, global_batch, make_model, num_params
from ..precision import optimizer_class, precision
from ..runtime.backend import choose_backend, rank_device
from .runs import RankReport, RunConfig, RunReport


def train_single(config: RunConfig, device=None) -> RunReport:
    """One process, the whole batch. It runs where a 1-rank pool would (the GPU, if there is one)
    and keeps its gradients between steps as DDP's buckets do, so that its report counts what
    stage 0 counts; it reports the same fields as a rank of a pool."""
    dev = torch.device(device) if device is not None else rank_device(choose_backend(1)[0], 0)
    cfg, dtype = config.model_config(), config.torch_dtype()
    model = make_model(cfg, dtype, dev)
    if config.activation_checkpointing:
        checkpoint_activations(model)
    params = list(model.parameters())
    mixed = precision(config.precision).master
    master = [p.detach().float().clone() for p in params] if mixed else params
    opt = optimizer_class(config.optimizer)(master, lr=config.lr, foreach=False)
    memory.reset_cuda_peak(dev)
    losses, times, grad_norm, grads = [], [], None, None
    for step in range(config.steps):
        x, y = global_batch(cfg, step, dtype, dev)
        t0 = time.perf_counter()
        last = step == config.steps - 1
        with memory.saved_activations(exclude=params) if last else contextlib.nullcontext() as saved:
            loss = model.loss(model(x), y)  # (activations counted in the last step, as the pool's ranks do)
        for p in params:  # zeroed in place, as DDP zeroes its buckets: the buffers stay
            if p.grad is not None:
                p.grad.zero_()
        loss.backward()
        if last:  # the gradient the optimizer steps with, before clipping (as the stages report it)
            grads = {n: (0, p.numel(), p.grad.detach().reshape(-1).clone()) for n, p in model.named_parameters()}
        if mixed:
            for m, p in zip(master, params):
                m.grad = p.grad.float()
        if config.clip_norm is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(master, config.clip_norm).item()
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
    psi = num_params(model)
    state = {"params": params, "grads": [p.grad for p in params],
             "optimizer": memory.optimizer_tensors(opt) + (master if mixed else [])}
    # as a pool's ranks time it: the unobserved steps after the first (warm-up), else what there is
    unobserved = times[:-1]
    steady = unobserved[1:] or unobserved or times
    # the fields a rank of a pool reports, for one process: nothing communicated, no micro-batches
    # (the reference takes the whole batch at once; grad_accum does not change its result)
    report = RankReport(
        rank=0, device=str(dev), num_params=psi, steps_taken=config.steps, final_loss=losses[-1],
        step_ms=statistics.median(steady) * 1e3, bytes=memory.measure(**state),
        expected_bytes=memory.model_state_breakdown(psi, 1, 0, *memory.bytes_per_parameter(config.precision, config.optimizer)),
        sent_bytes_per_step={}, calls_per_step={}, grad_norm=grad_norm, activation_bytes=saved["bytes"], grads=grads,
        params={n: p.detach().cpu().clone() for n, p in model.named_parameters()}, **memory.cuda_memory(dev))
    return RunReport(config, 1, [report], report.params)

