"""Checkers for the exercises that build the stages: the learner's hooks run inside real training
steps on the ranks - bucketed DDP (chapter 7), ZeRO-2's reduce-scatter hooks (chapter 9); and what they
share with ZeRO-3's unit (chapter 10, units.py): the MLP and its reference gradients, the learner's call.
Each grades the method as well as the values: the collectives called, what was held when, whether
backward went on while a bucket was in flight, the parameters a layer computed with.
"""
from __future__ import annotations

import torch

from ...ledger import CommLedger
from ...memory import tensor_bytes
from ...models import Config, local_batch, make_model
from ...runtime.backend import device
from ...runtime.compat import default_store
from ...zero.buckets import Bucket
from .checking import Verdict, _run, by_rank, collectives_made, each_pool, kept_alive, registered_hooks, what_is_wrong

# The MLP the engines' exercises train: its layers (2145, 4290, 4290 and 1056 elements) do not all
# divide by 4, so their flat buffers are padded, as real ones are; 12 rows divide over 4 ranks and 3.
MLP = Config(kind="mlp", hidden=65, global_batch=12)
HOLD_S = 5.0  # how long the held rank waits for the others' backward (bucketed DDP): seconds, not ms

# Each runs the learner's code on every rank inside training steps of the small MLP (float64), beside
# a plain copy of the model whose gradients are all-reduced the obvious way: the reference. The
# checker's own hooks, registered after the learner's, watch *when* things happen (ZeRO-2's weighs
# memory from tensor hooks instead, which run before any post-accumulate-grad hook: see there).

def _mlp_and_reference(steps: int = 2, local: list | None = None):
    """Inside a rank: the MLP, a plain copy of it, and for each step this rank's batch and the
    reference gradients (averaged over the ranks), by parameter name; `local`, if given, gets this
    rank's own gradients of each step (before any averaging)."""
    import torch.distributed as dist

    cfg, dev = MLP, device()
    rank, n = dist.get_rank(), dist.get_world_size()
    model, plain = make_model(cfg, torch.float64, dev), make_model(cfg, torch.float64, dev)
    batches, reference = [], []
    for step in range(steps):
        x, y = local_batch(cfg, step, rank, n, torch.float64, dev)
        plain.zero_grad(set_to_none=True)
        plain.loss(plain(x), y).backward()
        grads = {}
        if local is not None:
            local.append({name: p.grad.clone() for name, p in plain.named_parameters()})
        for name, p in plain.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g)
            grads[name] = g / n
        batches.append((x, y))
        reference.append(grads)
    return model, batches, reference


def _verdict_from_ranks(title, try_on_rank, fn, world_size, what, *args, also=None) -> Verdict:
    """Run `try_on_rank(fn, *args)` on the ranks (each returns its list of problems), on `world_size`
    ranks and then on `also` if given, and say what was found."""
    problems = []
    for pool in each_pool(world_size, also):
        res, err = _run(pool, try_on_rank, fn, *args, timeout=60,
                        hint="does every rank call the same collectives, in the same order, on tensors of the same size?")
        if err:
            return Verdict(title, [err])
        where = f"on {pool.world_size} ranks, " if also else ""
        problems += [where + p for p in by_rank(dict(enumerate(res)), pool.world_size)]
        if problems:
            break
    sizes = " and ".join(map(str, [world_size] + ([also] if also and also != world_size else [])))
    return Verdict(title, problems, [f"checked on {sizes} ranks, {what}"])


def _call_learner(what, fn, *args):
    """The learner's function, with its exception turned into a problem line."""
    try:
        return fn(*args), None
    except Exception as e:
        return None, f"{what} raised {type(e).__name__}: {e}"


def _bucket_layouts(model) -> dict:
    """The buckets the checker hands the learner: one layer each, last layer first (as the exercise
    says), and buckets that cut across layers (3, 2 and 3 parameters): a solution must not rely on a
    bucket being one weight and one bias, or on which of them lands last."""
    backward = [p for layer in reversed(model.layers) for p in layer.parameters()]
    return {"one layer each": [list(layer.parameters()) for layer in reversed(model.layers)],
            "across layers": [backward[:3], backward[3:5], backward[5:]]}


def _try_bucketed_ddp(fn, token, layout):
    import datetime

    import torch.distributed as dist

    model, batches, reference = _mlp_and_reference()
    rank, n = dist.get_rank(), dist.get_world_size()
    names = {p: name for name, p in model.named_parameters()}
    buckets = _bucket_layouts(model)[layout]
    before = registered_hooks(model.modules())
    finish, err = _call_learner("my_bucketed_ddp(buckets)", fn, buckets)
    learners = [h for h in registered_hooks(model.modules()) if not any(h is b for b in before)]
    if err:
        return [err]
    if not callable(finish):
        return [f"my_bucketed_ddp should return a function (finish) that waits for the all-reduces, not {type(finish).__name__}"]
    problems = []
    # When: the checker's hooks fire after the learner's on each parameter, so when a bucket's last
    # gradient has arrived its all-reduce should have been issued already (not after backward).
    seen = {}

    def watch(p):
        bucket = next(i for i, b in enumerate(buckets) if any(q is p for q in b))
        pending[bucket].discard(p)
        if not pending[bucket]:
            seen[bucket] = ledger.calls.get("all_reduce", 0), len(seen)
        if ledger.calls.get("all_reduce", 0) > len(seen):  # more sent than complete: one went out too soon
            early.append(bucket)

    # Overlap: the last rank holds its backward back, before its first gradient, until every other
    # rank's backward has returned. An all-reduce needs every rank, so the others' all-reduces cannot
    # finish before it starts: their backward returns only if it went on while their buckets were in
    # flight. One that waits for its all-reduce inside a hook waits for the held rank, which waits
    # for it: the hold times out and says so. (A tensor hook runs before any post-accumulate hook.)
    store, held = default_store(), n - 1
    hold = {"step": None, "timed_out": False}

    def hold_back(grad):
        if rank == held and n > 1 and hold["step"] is not None:
            step, hold["step"] = hold["step"], None
            try:
                store.wait([f"{token}/{step}/{q}" for q in range(n) if q != held], datetime.timedelta(seconds=HOLD_S))
            except Exception:  # (a timeout: DistStoreError, or RuntimeError on older torch)
                hold["timed_out"] = True

    for b in buckets:
        for p in b:
            p.register_post_accumulate_grad_hook(watch)
            p.register_hook(hold_back)
    for step, ((x, y), want) in enumerate(zip(batches, reference)):
        pending = [set(b) for b in buckets]
        seen.clear()
        early = []
        hold["step"] = step
        model.zero_grad(set_to_none=True)
        label = f"step {step + 1}"
        with CommLedger() as ledger:
            _, err = _call_learner("backward (your hooks)", lambda: model.loss(model(x), y).backward())
            store.set(f"{token}/{step}/{rank}", "backward returned")
            if err:
                return problems + [f"{label}: {err}" + (" - in the second backward: is what each bucket waits for "
                                                        "reset after the bucket is sent?" if step else "")]
            issued_in_backward = ledger.calls.get("all_reduce", 0)
            _, err = _call_learner("finish()", finish)
        if err:
            return problems + [f"{label}: {err}"]
        # every rank learns from the held one whether the hold timed out, and all stop together
        if rank == held:
            store.set(f"{token}/{step}/hold", "timed out" if hold["timed_out"] else "released")
        if n > 1 and store.get(f"{token}/{step}/hold") == b"timed out":
            return problems + [f"{label}: backward waited for its all-reduces: with rank {held} held back, the other "
                               f"ranks' backward did not return within {HOLD_S:g} s. Issue each bucket's all-reduce "
                               "with async_op=True, let backward go on, and wait in finish()"]
        method = collectives_made(dict(ledger.calls), {"all_reduce": len(buckets)},
                                  "one all-reduce per bucket: flatten the bucket's gradients into one tensor")
        if method:
            problems.append(f"{label}: {method}")
        elif early:
            return problems + [f"{label} ({layout}): a bucket's all-reduce went out before all its gradients had "
                               "landed: count the gradients each bucket still waits for, and send it when the last "
                               "one lands (whichever parameter that is)"]
        kept = kept_alive(learners + [finish], [p for p in model.parameters()] + [p.grad for p in model.parameters()])
        if kept:
            problems.append(f"{label}: after finish() your code still holds {kept} bytes of tensors (the flattened "
                            "buckets of a step?): let them go once their values are back in .grad")
        if issued_in_backward == 0:
            problems.append(f"{label}: no all-reduce was issued during backward"
                            + (" (the second backward: reset what each bucket waits for, after it is sent)" if step else
                               " (register_post_accumulate_grad_hook on each parameter; all-reduce a bucket when its last gradient arrives)"))
        else:
            for bucket, (count, order) in sorted(seen.items(), key=lambda kv: kv[1][1]):
                if count < order + 1:
                    problems.append(f"{label}: bucket {bucket} ({', '.join(names[p] for p in buckets[bucket])}) was "
                                    "complete, but its all-reduce had not been issued: send a bucket as soon as its "
                                    "last gradient arrives")
                    break
        for p in model.parameters():
            name = names[p]
            if p.grad is None:
                problems.append(f"{label}: {name} has no gradient after finish()")
                break
            known = [(want[name] * n, f"the sum over the ranks: divide by N = {n} for the average")]
            if n != 4:
                known.append((want[name] * n / 4, f"divided by 4: divide by N = dist.get_world_size(), {n} here"))
            wrong = what_is_wrong(f"{label}: {name}'s gradient", p.grad, want[name], torch.float64, known=known)
            if wrong:
                problems.append(wrong if "divide" in wrong else
                                wrong + " (did finish() wait for the work and copy the result back into .grad?)")
                break
        if problems:
            return problems
    return problems


def check_bucketed_ddp(fn, world_size: int = 4, also: int | None = 3) -> Verdict:
    """Exercise (chapter 7): `fn(buckets) -> finish`. `buckets` lists the MLP's parameters one
    layer per bucket, last layer first. Register hooks so that each bucket is all-reduced (one
    collective, async) as soon as backward has produced all its gradients; `finish()` waits for
    them and leaves the *averaged* gradient in every parameter's .grad. Checked over two
    training steps against all-reducing each gradient after backward: the gradients, one all-reduce
    per bucket, each issued when its bucket completes and not before, backward going on while they
    are in flight (one rank is held back until the others' backward has returned), nothing kept
    after finish(); with one layer per bucket and with buckets cut across layers, on `world_size`
    ranks and on `also`."""
    import uuid

    what = ("two steps of the MLP in float64, buckets of one layer and across layers: gradients, one all-reduce "
            "per bucket, issued when it completes, backward going on while they are in flight")
    for layout in ("one layer each", "across layers"):
        verdict = _verdict_from_ranks("bucketed DDP", _try_bucketed_ddp, fn, world_size, what, uuid.uuid4().hex, layout,
                                      also=also)
        if not verdict.ok:
            return verdict
    return verdict


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
    before = registered_hooks(model.modules())
    _, err = _call_learner("my_zero2_hooks(buckets, grad_shards)", fn, buckets, grad_shards)
    if err:
        return [err]
    learners = [h for h in registered_hooks(model.modules()) if not any(h is b for b in before)]
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
    others = sorted(op for op in ledger.calls if op != "reduce_scatter")
    if others:
        problems.append(f"you called {', '.join(others)}: ZeRO-2 reduce-scatters each bucket, every rank receiving "
                        "only its chunk of the sum (an all-reduce brings the whole sum to every rank)")
    elif calls != 2 * len(buckets):
        hint = ("more than one per bucket: a bucket sent before all its gradients had landed, or in pieces? Count "
                "the gradients it still waits for, send the whole bucket when the last one lands, and reset the "
                "count for the next backward" if calls > 2 * len(buckets) else
                "one per bucket per backward, from its hook (reduce_scatter_single of the flat, padded gradients)"
                + ("; in the second backward too: reset what each bucket waits for once it is sent"
                   if calls == len(buckets) else ""))
        problems.append(f"{calls} reduce-scatter calls in two backwards of {len(buckets)} buckets: {hint}")
    held = [names[p] for p in model.parameters() if p.grad is not None]
    kept = kept_alive(learners, list(model.parameters()) + [b.data for b in buckets] + grad_shards)
    if kept and not held:
        problems.append(f"after backward your hooks still hold {kept} bytes of tensors (flattened gradients, or the "
                        "gradients they set to None?): keep nothing of a bucket once it is reduce-scattered")
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
