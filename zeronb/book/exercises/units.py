"""The checker of chapter 10's second exercise: one ZeRO-3 unit, gathered before forward and backward,
freed after each, its gradients reduce-scattered. The checker's own hooks look at what the unit holds
and computes with at each point; the learner's hooks are swept for what they keep."""
from __future__ import annotations

import torch

from ...ledger import CommLedger
from ...zero.buckets import Bucket
from .checking import Verdict, kept_alive, registered_hooks
from .engines import _call_learner, _mlp_and_reference, _verdict_from_ranks


def _try_zero3_unit(fn):
    import torch.distributed as dist

    local = []
    model, batches, reference = _mlp_and_reference(steps=1, local=local)
    rank, n = dist.get_rank(), dist.get_world_size()
    unit = model.layers[1]   # one unit in the middle: the rest of the model stays whole
    names = {p: name for name, p in model.named_parameters()}
    flat = Bucket(list(unit.parameters()), n, "unit")
    full_values = flat.data.clone()
    shard = flat.chunk(rank).clone()
    grad_shard = torch.zeros_like(shard)
    nbytes = flat.data.untyped_storage().nbytes()
    flat.data.untyped_storage().resize_(0)  # between steps: only the shard
    before = registered_hooks(unit.modules())
    _, err = _call_learner("my_zero3_unit(unit, flat, shard, grad_shard)", fn, unit, flat, shard, grad_shard)
    if err:
        return [err]
    learners = [h for h in registered_hooks(unit.modules()) if not any(h is b for b in before)]
    seen = {}

    def storage():
        return flat.data.untyped_storage().nbytes()

    # the checker's module hooks, registered after the learner's: what the unit holds at each point
    unit.register_forward_pre_hook(lambda m, a: seen.__setitem__("forward", (storage(), flat.data.clone() if storage() else None)))
    unit.register_forward_hook(lambda m, a, out: seen.__setitem__("after forward", storage()))
    unit.register_full_backward_pre_hook(lambda m, g: seen.__setitem__(
        "backward", (storage(), flat.data.clone() if storage() >= nbytes else None)))
    problems = []
    (x, y), want = batches[0], reference[0]
    with CommLedger() as ledger:
        _, crashed = _call_learner("the step (forward and backward, your hooks)", lambda: model.loss(model(x), y).backward())
    if crashed and "forward" not in seen:  # (a hook of the learner's raised before the unit's forward)
        return [crashed]
    size, values = seen.get("forward", (0, None))
    if size < nbytes:
        return [f"when the unit's forward ran, its buffer held {size} of {nbytes} bytes: gather before forward (resize "
                "the storage back to flat.padded elements, then all_gather_single into flat.data)"]
    if crashed:
        return [crashed]
    elif not torch.allclose(values, full_values, rtol=0, atol=0):
        problems.append("the unit's forward saw parameters that are not the full ones: all-gather every rank's shard")
    if seen.get("after forward", 0):
        problems.append(f"after its forward the unit still held {seen['after forward']} bytes of full parameters: free them "
                        "(flat.data.untyped_storage().resize_(0))")
    size, values = seen.get("backward", (0, None))
    if size < nbytes:
        problems.append("the unit's backward began without its full parameters: gather them again before backward "
                        "(register_full_backward_pre_hook)")
    elif not torch.equal(values, full_values):
        problems.append("the unit's backward saw parameters that are not the full ones: gather every rank's shard "
                        "again before backward (the gradient flowing back through the unit is made with them)")
    before = model.layers[0]  # the gradient that flowed back through the unit, into the layer before it
    for name, p in before.named_parameters(prefix="layers.0"):
        if p.grad is None or not torch.allclose(p.grad, local[0][name], rtol=1e-10, atol=1e-12):
            problems.append(f"{name}'s gradient, which flows back through the unit, is wrong: the unit's backward "
                            "computed with the wrong parameters")
            break
    if storage():
        problems.append(f"after backward the unit still holds {storage()} bytes of full parameters: free them once its "
                        "gradients are reduce-scattered")
    unit_params = list(unit.parameters())
    if any(p.grad is not None for p in unit_params):
        problems.append("after backward the unit's full gradients are still held: set them to None once reduce-scattered")
    kept = kept_alive(learners, unit_params + [flat.data, shard, grad_shard])
    if kept:
        problems.append(f"after backward your hooks still hold {kept} bytes of tensors (a copy of the gathered "
                        "parameters, or of the gradients?): between steps a ZeRO-3 rank holds its shards only")
    summed = torch.zeros(flat.padded, dtype=torch.float64, device=shard.device)
    summed[:flat.numel] = torch.cat([want[names[p]].reshape(-1) for p in unit_params]) * n
    if not torch.allclose(grad_shard, flat.chunk(rank, summed), rtol=1e-10, atol=1e-12):
        if torch.allclose(grad_shard, flat.chunk(rank, summed) / n, rtol=1e-10, atol=1e-12):
            problems.append("grad_shard holds the average: keep the sum over the ranks (the step divides by N)")
        else:
            problems.append(f"grad_shard is off by up to {(grad_shard - flat.chunk(rank, summed)).abs().max().item():.3g} from "
                            f"chunk {rank} of the gradient summed over the ranks")
    gathers, scatters = ledger.calls.get("all_gather", 0), ledger.calls.get("reduce_scatter", 0)
    others = sorted(op for op in ledger.calls if op not in ("all_gather", "reduce_scatter"))
    if others:
        problems.append(f"you called {', '.join(others)}: ZeRO-3 all-gathers the parameters and reduce-scatters the "
                        "gradients, each rank keeping only its chunk")
    elif (gathers, scatters) != (2, 1):
        problems.append(f"one step made {gathers} all-gather(s) and {scatters} reduce-scatter(s) of the unit; ZeRO-3 makes 2 "
                        "(before forward, before backward) and 1 (after backward)")
    return problems


def check_zero3_unit(fn, world_size: int = 4) -> Verdict:
    """Exercise (chapter 10): `fn(unit, flat, shard, grad_shard)` makes one unit (a Linear layer in
    the middle of the MLP) live the ZeRO-3 way. Its parameters are views into `flat.data`, whose
    storage has been freed (0 bytes); `shard` is this rank's chunk of them. Register hooks: gather
    before forward, free after it; gather again before backward; once all its gradients exist,
    reduce-scatter them (summed) into `grad_shard`, and free gradients and parameters."""
    return _verdict_from_ranks("ZeRO-3 unit", _try_zero3_unit, fn, world_size,
                               "one step of the MLP in float64: what the unit holds before and after forward and "
                               "backward, its gradient shard, its collectives")
