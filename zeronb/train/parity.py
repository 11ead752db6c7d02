"""How far a run is from the reference (one process, the whole batch): in parameters, and in the
gradients themselves.

Parameters after Adam are a weak check: Adam's update hardly changes when every gradient is
multiplied by the same factor (up to its eps), so a stage that sums gradients instead of averaging
them would pass it (PyTorch's FSDP2 shipped such a bug on gloo, pytorch#162338). The gradients the
optimizer steps with, or parameters after plain SGD, show such a factor at once.
"""
from __future__ import annotations

import torch


def max_diff(a: dict, b: dict) -> float:
    """Largest |difference| over all parameters of two {name: tensor} dicts (on the CPU). The two
    must name the same parameters."""
    if set(a) != set(b):
        raise ValueError(f"the two runs name different parameters: {sorted(set(a) ^ set(b))}")
    return max((a[k].detach().cpu().double() - b[k].detach().cpu().double()).abs().max().item() for k in a)


def grad_diff(ranks: list, reference) -> float:
    """Largest |difference| between the averaged gradients each rank's optimizer stepped with in
    the last step (RankReport.grads: pieces of parameters, {name: (start, stop, values)}) and the
    reference's whole gradients. Every element of every parameter must be covered by some rank's
    pieces, or this raises: a check that silently skipped a shard would prove nothing."""
    full = {name: values.detach().cpu() for name, (_, _, values) in reference.grads.items()}  # (a GPU's too)
    covered = {name: torch.zeros(v.numel(), dtype=torch.bool) for name, v in full.items()}
    worst = 0.0
    for r in ranks:
        for name, (start, stop, values) in r.grads.items():
            want = full[name].reshape(-1)[start:stop].double()
            worst = max(worst, (values.detach().cpu().double() - want).abs().max().item() if stop > start else 0.0)
            covered[name][start:stop] = True
    missing = [name for name, c in covered.items() if not c.all()]
    if missing:
        raise ValueError(f"no rank reported the gradient of every element of {missing}")
    return worst
