"""The checker of chapter 12's exercise: gradient accumulation with global-norm clipping over shards.
It grades the values (the mean over ranks and micro-batches, clipped by the whole model's norm), the
norm returned, and the method: reduce-scattered gradients and one number per rank for the norm."""
from __future__ import annotations

import torch

from ...ledger import CommLedger
from ...shards import chunk_bounds
from .checking import Verdict, _inputs, _run, by_rank, each_pool, what_is_wrong


def _try_accumulate_and_clip(fn, max_norm, k, numel):
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    # K micro-batch gradients of this rank (each of its micro-batch's mean loss), flat and padded
    micro = [_inputs(1000 * i + rank, numel, torch.float64) for i in range(k)]
    everyone = [[_inputs(1000 * i + r, numel, torch.float64) for i in range(k)] for r in range(n)]
    total = torch.stack([torch.stack(g).sum(0) for g in everyone]).sum(0)
    mean = total / (n * k)                                          # the step's gradient
    norm = mean.norm().item()
    scale = min(1.0, max_norm / (norm + 1e-6))                      # clip_grad_norm_'s rule
    a, b = chunk_bounds(numel, n, rank)
    want, unclipped = mean[a:b] * scale, mean[a:b]
    with CommLedger() as ledger:
        out = fn([g.clone() for g in micro], max_norm)
    got_norm = None
    if isinstance(out, tuple) and len(out) == 2:
        out, got_norm = out
    if isinstance(got_norm, torch.Tensor):
        got_norm = got_norm.item() if got_norm.numel() == 1 else None
    problems = []
    summed_norm = isinstance(got_norm, float) and any(abs(got_norm - f * norm) <= 1e-9 * f * norm
                                                      for f in {k, n, n * k} - {1})
    own = unclipped * min(1.0, max_norm / (unclipped.norm().item() + 1e-6))
    sum_message = f"a sum where the step needs the mean: divide by N x K = {n} x {k} (before the norm is taken)"
    wrong = what_is_wrong("the clipped shard", out.cpu() if isinstance(out, torch.Tensor) else out, want.cpu(),
                          torch.float64, known=[
                              (unclipped, f"not clipped (the global norm is {norm:.4g} > max_norm {max_norm})"),
                              (own, "clipped by the norm of this rank's own shard, not the whole model's: all-reduce "
                                    "each rank's sum of squares, then take the root"),
                              (want * k, sum_message), (want * n, sum_message), (want * n * k, sum_message),
                              (total[a:b] / (4 * k) * min(1.0, max_norm / (total.norm().item() / (4 * k) + 1e-6))
                               if n != 4 else None, f"divided by 4 x K: divide by N x K, and N is {n} here")])
    if summed_norm:  # (clipped, a sum comes out close to the mean: the norm tells them apart)
        wrong = f"the clipped shard: {sum_message}"
    if wrong:
        problems.append(wrong)
    if got_norm is None or abs(got_norm - norm) > 1e-9 * norm:
        problems.append(f"returned norm {got_norm}; the whole model's gradient norm before clipping is {norm:.10g}")
    # once more with a max_norm above the norm: clip_grad_norm_ leaves such a gradient as it is
    loose = 10 * norm
    again = fn([g.clone() for g in micro], loose)
    again = again[0] if isinstance(again, tuple) else again
    if isinstance(again, torch.Tensor) and not wrong and not torch.allclose(again.cpu(), unclipped.cpu(), rtol=1e-10,
                                                                             atol=1e-13):
        scaled = torch.allclose(again.cpu(), unclipped.cpu() * loose / norm, rtol=1e-6, atol=1e-12)
        problems.append(f"with max_norm {loose:.4g} above the norm {norm:.4g} the gradient changed"
                        + (": it was scaled up to the max_norm; clip_grad_norm_ scales by min(1, max_norm / norm)"
                           if scaled else ": a gradient whose norm is below max_norm is left as it is"))
    big = sorted(op for op in ledger.calls if op not in ("reduce_scatter", "all_reduce"))
    if big:
        problems.append(f"you called {', '.join(big)}: nothing needs gathering - each rank clips its own shard, with a "
                        "norm made of one number from each rank")
    if ledger.elements.get("all_reduce", 0) > ledger.calls.get("all_reduce", 0):  # a call of more than one number
        problems.append(f"all-reduced {ledger.elements['all_reduce']} elements: the norm needs one number from each "
                        "rank (its sum of squares), not its gradient")
    if not ledger.calls.get("reduce_scatter"):
        problems.append("no reduce-scatter: each rank's shard of the summed gradients comes from reduce-scattering them")
    return problems


def check_accumulate_and_clip(fn, world_size: int = 4, max_norm: float = 0.5, micro_batches: int = 3,
                              also: int | None = 3, numel: int = 4092) -> Verdict:
    """Exercise (chapter 12): `fn(micro_grads, max_norm) -> (grad_shard, norm)`. `micro_grads` are
    this rank's flat gradients of K micro-batches (each of its micro-batch's mean loss). Return
    this rank's chunk of the step's gradient - the mean over ranks and micro-batches - clipped as
    torch.nn.utils.clip_grad_norm_ would clip the whole model's gradient on one process, and the
    norm before clipping. Communicate only what is needed: gradient shards, and one number each.
    Checked on `world_size` ranks and on `also` (`numel` divides by both)."""
    title = "accumulation and global-norm clipping over shards"
    problems = []
    for pool in each_pool(world_size, also):
        res, err = _run(pool, _try_accumulate_and_clip, fn, max_norm, micro_batches, numel, timeout=60)
        if err:
            return Verdict(title, [f"on {pool.world_size} ranks: {err}"])
        problems += [f"on {pool.world_size} ranks, {p}" for p in by_rank(dict(enumerate(res)), pool.world_size)]
        if problems:
            break
    sizes = " and ".join(map(str, [world_size] + ([also] if also and also != world_size else [])))
    return Verdict(title, problems, [f"checked on {sizes} ranks, {micro_batches} micro-batches of {numel} float64 "
                                     f"gradients each, max_norm {max_norm}, against clip_grad_norm_'s rule, with "
                                     "the collectives each rank called"])
