"""Checkers for the exercises that build the stages: the learner's hooks run inside real training
steps on the ranks - bucketed DDP (chapter 7), ZeRO-2's reduce-scatter hooks (chapter 9), ZeRO-3's
gather and free for one unit (chapter 10), accumulation with global-norm clipping (chapter 12).
"""
from __future__ import annotations

import torch

from ...ledger import CommLedger
from ...memory import tensor_bytes
from ...models import Config, local_batch, make_model
from ...runtime.backend import device
from ...shards import chunk_bounds
from ...zero.buckets import Bucket
from .checking import Verdict, _compare, _inputs, _pool, _run

# Each runs the learner's code on every rank inside training steps of the small MLP (float64), beside
# a plain copy of the model whose gradients are all-reduced the obvious way: the reference. The
# checker's own hooks, registered after the learner's, watch *when* things happen (ZeRO-2's weighs
# memory from tensor hooks instead, which run before any post-accumulate-grad hook: see there).

def _mlp_and_reference(steps: int = 2):
    """Inside a rank: the MLP, a plain copy of it, and for each step this rank's batch and the
    reference gradients (averaged over the ranks), by parameter name."""
    import torch.distributed as dist

    cfg, dev = Config(kind="mlp"), device()
    rank, n = dist.get_rank(), dist.get_world_size()
    model, plain = make_model(cfg, torch.float64, dev), make_model(cfg, torch.float64, dev)
    batches, reference = [], []
    for step in range(steps):
        x, y = local_batch(cfg, step, rank, n, torch.float64, dev)
        plain.zero_grad(set_to_none=True)
        plain.loss(plain(x), y).backward()
        grads = {}
        for name, p in plain.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g)
            grads[name] = g / n
        batches.append((x, y))
        reference.append(grads)
    return model, batches, reference


def _verdict_from_ranks(title, try_on_rank, fn, world_size, what) -> Verdict:
    """Run `try_on_rank(fn)` on the ranks (each returns its list of problems) and say what was found."""
    res, err = _run(_pool(world_size), try_on_rank, fn, timeout=60)
    if err:
        return Verdict(title, [err])
    problems = [f"rank {r}: {p}" for r, probs in enumerate(res) for p in probs]
    return Verdict(title, problems, [f"checked on {world_size} ranks, {what}"])


def _call_learner(what, fn, *args):
    """The learner's function, with its exception turned into a problem line."""
    try:
        return fn(*args), None
    except Exception as e:
        return None, f"{what} raised {type(e).__name__}: {e}"


def _try_bucketed_ddp(fn):
    import torch.distributed as dist

    model, batches, reference = _mlp_and_reference()
    names = {p: name for name, p in model.named_parameters()}
    layers = list(model.layers)
    buckets = [list(layer.parameters()) for layer in reversed(layers)]  # backward order: the last layer first
    finish, err = _call_learner("my_bucketed_ddp(buckets)", fn, buckets)
    if err:
        return [err]
    if not callable(finish):
        return [f"my_bucketed_ddp should return a function (finish) that waits for the all-reduces, not {type(finish).__name__}"]
    problems, n = [], dist.get_world_size()
    # the checker's hooks fire after the learner's on each parameter: when a bucket's last gradient
    # has arrived, its all-reduce should have been issued already (not after backward)
    seen = {}

    def watch(p):
        bucket = next(i for i, b in enumerate(buckets) if any(q is p for q in b))
        pending[bucket].discard(p)
        if not pending[bucket]:
            seen[bucket] = ledger.calls.get("all_reduce", 0), len(seen)

    for b in buckets:
        for p in b:
            p.register_post_accumulate_grad_hook(watch)
    for step, ((x, y), want) in enumerate(zip(batches, reference)):
        pending = [set(b) for b in buckets]
        seen.clear()
        model.zero_grad(set_to_none=True)
        label = f"step {step + 1}"
        with CommLedger() as ledger:
            _, err = _call_learner("backward (your hooks)", lambda: model.loss(model(x), y).backward())
            if err:
                return problems + [f"{label}: {err}" + (" - in the second backward: is what each bucket waits for "
                                                        "reset after the bucket is sent?" if step else "")]
            issued_in_backward = ledger.calls.get("all_reduce", 0)
            _, err = _call_learner("finish()", finish)
        if err:
            return problems + [f"{label}: {err}"]
        if issued_in_backward == 0:
            problems.append(f"{label}: no all-reduce was issued during backward"
                            + (" (the second backward: reset what each bucket waits for, after it is sent)" if step else
                               " (register_post_accumulate_grad_hook on each parameter; all-reduce a bucket when its last gradient arrives)"))
        else:
            for bucket, (count, order) in sorted(seen.items(), key=lambda kv: kv[1][1]):
                if count < order + 1:
                    problems.append(f"{label}: bucket {bucket} (layer {len(layers) - 1 - bucket}) was complete, but its all-reduce "
                                    f"had not been issued: send a bucket as soon as its last gradient arrives")
                    break
        if ledger.calls.get("all_reduce", 0) != len(buckets):
            problems.append(f"{label}: {ledger.calls.get('all_reduce', 0)} all-reduce calls for {len(buckets)} buckets: "
                            "one per bucket (flatten the bucket's gradients into one tensor)")
        for p in model.parameters():
            name = names[p]
            if p.grad is None:
                problems.append(f"{label}: {name} has no gradient after finish()")
                continue
            if torch.allclose(p.grad, want[name], rtol=1e-10, atol=1e-12):
                continue
            if n > 1 and torch.allclose(p.grad, want[name] * n, rtol=1e-10, atol=1e-12):
                problems.append(f"{label}: {name} holds the sum over the ranks: divide by N = {n} for the average")
            else:
                off = (p.grad - want[name]).abs().max().item()
                problems.append(f"{label}: {name}'s gradient is off by up to {off:.3g} from the averaged one "
                                "(did finish() wait for the work and copy the result back into .grad?)")
    return problems


def check_bucketed_ddp(fn, world_size: int = 4) -> Verdict:
    """Exercise (chapter 7): `fn(buckets) -> finish`. `buckets` lists the MLP's parameters one
    layer per bucket, last layer first. Register hooks so that each bucket is all-reduced (one
    collective, async) as soon as backward has produced all its gradients; `finish()` waits for
    them and leaves the *averaged* gradient in every parameter's .grad. Checked over two
    training steps against all-reducing each gradient after backward."""
    return _verdict_from_ranks("bucketed DDP", _try_bucketed_ddp, fn, world_size,
                               "two steps of the MLP in float64: gradients, one all-reduce per bucket, "
                               "issued during backward")


def _try_zero2_hooks(fn):
    import torch.distributed as dist

    model, batches, reference = _mlp_and_reference()
    rank, n = dist.get_rank(), dist.get_world_size()
    names = {p: name for name, p in model.named_parameters()}
    buckets = [Bucket(list(layer.parameters()), n, f"layer{len(model.layers) - 1 - i}")
               for i, layer in enumerate(reversed(model.layers))]
    grad_shards = [torch.zeros(b.chunk_numel, dtype=torch.float64, device=b.data.device) for b in buckets]
    # The memory is weighed where its peak is: at the gradient that completes a bucket, before any
    # hook can free anything. A tensor hook on a parameter runs when its gradient has been computed,
    # before autograd accumulates it into .grad and so before every post-accumulate-grad hook,
    # whenever those were registered; when it runs, every hook of the gradients before it has
    # finished. So at each bucket's completion it sees the full gradients still alive, and this one.
    bucket_of = {p: i for i, b in enumerate(buckets) for p in b.params}
    landed, completions = [set() for _ in buckets], []

    def weigh(p):
        def at_landing(grad):
            i = bucket_of[p]
            landed[i].add(p)
            if len(landed[i]) < len(buckets[i].params):
                return
            earlier = [j for j, b in enumerate(buckets) if j != i and len(landed[j]) == len(b.params)]
            alive = tensor_bytes([q.grad for q in model.parameters()]) + (grad.numel() * grad.element_size()
                                                                           if p.grad is None else 0)
            stale = [buckets[j].name for j in earlier if any(q.grad is not None for q in buckets[j].params)]
            completions.append({"bucket": buckets[i].name, "alive": alive, "stale": stale, "earlier": len(earlier),
                                "sent": ledger.calls.get("reduce_scatter", 0) - calls_before[0]})
        return at_landing

    for p in model.parameters():
        p.register_hook(weigh(p))
    _, err = _call_learner("my_zero2_hooks(buckets, grad_shards)", fn, buckets, grad_shards)
    if err:
        return [err]
    full_bytes = sum(p.numel() * 8 for p in model.parameters())
    problems, calls_before = [], [0]
    with CommLedger() as ledger:
        for k, (x, y) in enumerate(batches):  # two backwards, no step between: the shards must add up (accumulation)
            landed = [set() for _ in buckets]
            calls_before[0] = ledger.calls.get("reduce_scatter", 0)
            _, err = _call_learner("backward (your hooks)", lambda: model.loss(model(x), y).backward())
            if err:
                return [f"backward {k + 1}: {err}"]
    calls = ledger.calls.get("reduce_scatter", 0)
    if calls != 2 * len(buckets):
        hint = ("more than one per bucket: was a bucket sent before all its gradients had landed? Count the "
                "gradients it still waits for, and send it when the last one lands" if calls > 2 * len(buckets) else
                "one per bucket per backward, from its hook (reduce_scatter_single of the flat, padded gradients)"
                + ("; in the second backward too: reset what each bucket waits for once it is sent"
                   if calls == len(buckets) else ""))
        problems.append(f"{calls} reduce-scatter calls in two backwards of {len(buckets)} buckets: {hint}")
    held = [names[p] for p in model.parameters() if p.grad is not None]
    worst = max(completions, key=lambda c: (bool(c["stale"]), c["alive"]), default=None)
    if held:
        problems.append(f"after backward {len(held)} full gradients are still held ({', '.join(held[:3])}...): "
                        "set p.grad = None for a bucket's parameters once it is reduce-scattered")
    elif worst is not None and worst["stale"]:
        late = worst["sent"] < worst["earlier"]  # fewer reduce-scatters so far than buckets complete before it
        problems.append(
            f"when bucket {worst['bucket']} was complete, the full gradients of bucket(s) {', '.join(worst['stale'])}, "
            f"complete before it, were still alive{', not yet reduce-scattered' if late else ''}: "
            f"{worst['alive']} bytes of full gradients at once, "
            + (f"all of them ({full_bytes}), ZeRO-1's full gradient buffer. " if worst["alive"] >= full_bytes else
               f"{worst['alive'] / full_bytes:.0%} of all of them ({full_bytes}), where one bucket's would do. ")
            + ("Reduce-scatter each bucket from its hook as soon as its last gradient lands" if late else
               "Free a bucket's gradients (p.grad = None) right after its reduce-scatter, not when backward ends"))

    def chunk_of_sum(b, refs):  # chunk `rank` of bucket b's flat gradient, summed over ranks and `refs`
        flat = torch.zeros(b.padded, dtype=torch.float64, device=b.data.device)
        flat[:b.numel] = sum(torch.cat([ref[names[p]].reshape(-1) for p in b.params]) for ref in refs) * n
        return b.chunk(rank, flat)

    for b, got in zip(buckets, grad_shards):
        want = chunk_of_sum(b, reference)
        if torch.allclose(got, want, rtol=1e-10, atol=1e-12):
            continue
        if torch.allclose(got, chunk_of_sum(b, reference[-1:]), rtol=1e-10, atol=1e-12):
            problems.append(f"bucket {b.name}: its shard holds the last backward's sum only: add each "
                            "reduce-scatter into grad_shards[i] (+=), so that micro-batches accumulate")
        elif torch.allclose(got, want / n, rtol=1e-10, atol=1e-12):
            problems.append(f"bucket {b.name}: its shard holds the average; keep the sum (the step divides by N)")
        else:
            err = (got - want).abs().max().item()
            problems.append(f"bucket {b.name}: rank {rank}'s shard (chunk {rank}, {b.chunk_numel} elements) is off by "
                            f"up to {err:.3g} from the sum of chunk {rank} over the ranks")
    return problems


def check_zero2_hooks(fn, world_size: int = 4) -> Verdict:
    """Exercise (chapter 9): `fn(buckets, grad_shards)` registers ZeRO-2's hooks. `buckets` are
    zeronb.zero.buckets.Bucket objects (one layer each, last layer first: `.params`,
    `.flatten_grads()`, `.chunk_numel`); `grad_shards[i]` is this rank's gradient shard of bucket
    i. When all of a bucket's gradients exist: reduce-scatter them (summed), *add* the result into
    grad_shards[i], and free the full gradients. Checked over two backwards (accumulation): the
    shards, one reduce-scatter per bucket, no full gradient left after backward, and, weighed as
    each bucket's last gradient lands (before any hook runs), no full gradient of a bucket
    completed earlier still alive: the peak is one bucket, not ZeRO-1's all of them."""
    return _verdict_from_ranks("ZeRO-2 reduce-scatter hooks", _try_zero2_hooks, fn, world_size,
                               "two backwards of the MLP in float64: shards, calls, and the full gradients "
                               "alive as each bucket completes")


def _try_zero3_unit(fn):
    import torch.distributed as dist

    model, batches, reference = _mlp_and_reference(steps=1)
    rank, n = dist.get_rank(), dist.get_world_size()
    unit = model.layers[1]   # one unit in the middle: the rest of the model stays whole
    names = {p: name for name, p in model.named_parameters()}
    flat = Bucket(list(unit.parameters()), n, "unit")
    full_values = flat.data.clone()
    shard = flat.chunk(rank).clone()
    grad_shard = torch.zeros_like(shard)
    nbytes = flat.data.untyped_storage().nbytes()
    flat.data.untyped_storage().resize_(0)  # between steps: only the shard
    _, err = _call_learner("my_zero3_unit(unit, flat, shard, grad_shard)", fn, unit, flat, shard, grad_shard)
    if err:
        return [err]
    seen = {}

    def storage():
        return flat.data.untyped_storage().nbytes()

    # the checker's module hooks, registered after the learner's: what the unit holds at each point
    unit.register_forward_pre_hook(lambda m, a: seen.__setitem__("forward", (storage(), flat.data.clone() if storage() else None)))
    unit.register_forward_hook(lambda m, a, out: seen.__setitem__("after forward", storage()))
    unit.register_full_backward_pre_hook(lambda m, g: seen.__setitem__("backward", storage()))
    problems = []
    (x, y), want = batches[0], reference[0]
    with CommLedger() as ledger:
        model.loss(model(x), y).backward()
    size, values = seen.get("forward", (0, None))
    if size < nbytes:
        problems.append(f"when the unit's forward ran, its buffer held {size} of {nbytes} bytes: gather before forward "
                        "(resize the storage back, then all_gather_single into flat.data.data)")
    elif not torch.allclose(values, full_values, rtol=0, atol=0):
        problems.append("the unit's forward saw parameters that are not the full ones: all-gather every rank's shard")
    if seen.get("after forward", 0):
        problems.append(f"after its forward the unit still held {seen['after forward']} bytes of full parameters: free them "
                        "(flat.data.untyped_storage().resize_(0))")
    if seen.get("backward", 0) < nbytes:
        problems.append("the unit's backward began without its full parameters: gather them again before backward "
                        "(register_full_backward_pre_hook)")
    if storage():
        problems.append(f"after backward the unit still holds {storage()} bytes of full parameters: free them once its "
                        "gradients are reduce-scattered")
    unit_params = list(unit.parameters())
    if any(p.grad is not None for p in unit_params):
        problems.append("after backward the unit's full gradients are still held: set them to None once reduce-scattered")
    summed = torch.zeros(flat.padded, dtype=torch.float64, device=shard.device)
    summed[:flat.numel] = torch.cat([want[names[p]].reshape(-1) for p in unit_params]) * n
    if not torch.allclose(grad_shard, flat.chunk(rank, summed), rtol=1e-10, atol=1e-12):
        if torch.allclose(grad_shard, flat.chunk(rank, summed) / n, rtol=1e-10, atol=1e-12):
            problems.append("grad_shard holds the average: keep the sum over the ranks (the step divides by N)")
        else:
            problems.append(f"grad_shard is off by up to {(grad_shard - flat.chunk(rank, summed)).abs().max().item():.3g} from "
                            f"chunk {rank} of the gradient summed over the ranks")
    gathers, scatters = ledger.calls.get("all_gather", 0), ledger.calls.get("reduce_scatter", 0)
    if (gathers, scatters) != (2, 1):
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


def _try_accumulate_and_clip(fn, max_norm, k):
    import torch.distributed as dist

    rank, n, numel = dist.get_rank(), dist.get_world_size(), 4096
    # K micro-batch gradients of this rank (each of its micro-batch's mean loss), flat and padded
    micro = [_inputs(1000 * i + rank, numel, torch.float64) for i in range(k)]
    everyone = [[_inputs(1000 * i + r, numel, torch.float64) for i in range(k)] for r in range(n)]
    mean = torch.stack([torch.stack(g).sum(0) for g in everyone]).sum(0) / (n * k)  # the step's gradient
    norm = mean.norm().item()
    scale = min(1.0, max_norm / (norm + 1e-6))                      # clip_grad_norm_'s rule
    a, b = chunk_bounds(numel, n, rank)
    want, unclipped = mean[a:b] * scale, mean[a:b]
    with CommLedger() as ledger:
        out = fn([g.clone() for g in micro], max_norm)
    got_norm = None
    if isinstance(out, tuple) and len(out) == 2:
        out, got_norm = out
    local_norm = unclipped.norm().item()
    return {"got": out.cpu() if isinstance(out, torch.Tensor) else out, "got_norm": got_norm,
            "want": want.cpu(), "unclipped": unclipped.cpu(), "norm": norm, "local_norm": local_norm,
            "by_op": dict(ledger.by_op), "calls": dict(ledger.calls), "bounds": (a, b)}


def check_accumulate_and_clip(fn, world_size: int = 4, max_norm: float = 0.5, micro_batches: int = 3) -> Verdict:
    """Exercise (chapter 12): `fn(micro_grads, max_norm) -> (grad_shard, norm)`. `micro_grads` are
    this rank's flat gradients of K micro-batches (each of its micro-batch's mean loss). Return
    this rank's chunk of the step's gradient - the mean over ranks and micro-batches - clipped as
    torch.nn.utils.clip_grad_norm_ would clip the whole model's gradient on one process, and the
    norm before clipping. Communicate only what is needed: gradient shards, and one number each."""
    title = "accumulation and global-norm clipping over shards"
    pool = _pool(world_size)
    res, err = _run(pool, _try_accumulate_and_clip, fn, max_norm, micro_batches, timeout=60)
    if err:
        return Verdict(title, [err])
    problems = []
    for rank, r in enumerate(res):
        got = r["got"]
        if not isinstance(got, torch.Tensor) or got.shape != r["want"].shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            problems.append(f"rank {rank}: returned {shape}; expected this rank's chunk, elements "
                            f"{r['bounds'][0]}..{r['bounds'][1] - 1} ({r['want'].numel()} elements)")
            continue
        close = lambda t: torch.allclose(got, t, rtol=1e-10, atol=1e-13)  # noqa: E731
        summed = isinstance(r["got_norm"], (int, float, torch.Tensor)) and any(
            abs(float(r["got_norm"]) - f * r["norm"]) <= 1e-9 * f * r["norm"]
            for f in {micro_batches, world_size, world_size * micro_batches} - {1})
        if close(r["want"]) and not summed:
            pass
        elif summed:  # (clipped, a sum comes out close to the mean: the norm tells them apart)
            problems.append(f"rank {rank}: a sum where the step needs the mean: divide by N = {world_size} ranks "
                            f"x K = {micro_batches} micro-batches (before the norm is taken)")
            continue
        elif close(r["unclipped"]):
            problems.append(f"rank {rank}: the gradient is not clipped (its global norm is {r['norm']:.4g} > {max_norm})")
        elif close(r["unclipped"] * min(1.0, max_norm / (r["local_norm"] + 1e-6))):
            problems.append(f"rank {rank}: clipped by the norm of its own shard ({r['local_norm']:.4g}), not the whole "
                            f"model's ({r['norm']:.4g}): all-reduce each rank's sum of squares, then take the root")
        elif close(r["want"] * micro_batches) or close(r["want"] * world_size) or close(r["want"] * world_size * micro_batches):
            problems.append(f"rank {rank}: a sum where the step needs the mean: divide by N = {world_size} ranks "
                            f"x K = {micro_batches} micro-batches (before the norm is taken)")
        else:
            problems += _compare("the clipped shard", rank, got, r["want"], torch.float64)
        if r["got_norm"] is None or abs(float(r["got_norm"]) - r["norm"]) > 1e-9 * r["norm"]:
            problems.append(f"rank {rank}: returned norm {r['got_norm']}; the whole model's gradient norm before "
                            f"clipping is {r['norm']:.10g}")
        big = {op: b for op, b in r["by_op"].items() if op not in ("reduce_scatter", "all_reduce")}
        if big:
            problems.append(f"rank {rank} called {', '.join(big)}: nothing needs gathering - each rank clips its own "
                            "shard, with a norm made of one number from each rank")
        if r["by_op"].get("all_reduce", 0) > 64:
            problems.append(f"rank {rank} all-reduced {r['by_op']['all_reduce']} bytes: the norm needs one number from "
                            "each rank (its sum of squares), not its gradient")
    return Verdict(title, problems, [f"checked on {world_size} ranks, {micro_batches} micro-batches of 4096 float64 "
                                     f"gradients each, max_norm {max_norm}, against clip_grad_norm_'s rule"])
