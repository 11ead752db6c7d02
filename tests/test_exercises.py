"""The exercise checkers accept a right answer and say precisely what is wrong with a wrong one."""
import pytest
import torch
import torch.distributed as dist

import zeronb
from zeronb.book import exercises
from wrong_worlds import solutions


@pytest.fixture(scope="module", autouse=True)
def pool():
    zeronb.start(4, backend="gloo", verbose=False)
    yield
    zeronb.shutdown()


CHECKERS = ["check_all_reduce", "check_ring_all_gather", "check_zero1_step", "check_zero3_bytes"]


@pytest.mark.parametrize("checker", CHECKERS)
def test_checker_accepts_a_right_solution(checker):
    v = getattr(exercises, checker)(solutions.RIGHT[checker])
    assert v.ok, str(v)


@pytest.mark.parametrize("checker,wrong", [(c, w) for c in CHECKERS for w in solutions.WRONG[c]],
                         ids=lambda x: x if isinstance(x, str) else x.name.replace(" ", "-"))
def test_checker_names_the_mistake(checker, wrong):
    v = getattr(exercises, checker)(wrong.solution, **wrong.kwargs)
    assert not v.ok and wrong.says in str(v), str(v)
    assert len(v.problems) <= 3, str(v)  # the mistake in a line or two, not a line per element


# --- the exercises that build the engines: a solution passes; each typical mistake is named -----------

def bucketed_ddp(average=True, reset=True, in_hooks=True, per_parameter=False):
    def my_bucketed_ddp(buckets):
        works, pending = [], {}
        owner = {p: i for i, b in enumerate(buckets) for p in b}

        def send(params):
            groups = [[q] for q in params] if per_parameter else [params]
            for group in groups:
                flat = torch.cat([q.grad.reshape(-1) for q in group])
                works.append((group, flat, dist.all_reduce(flat, async_op=True)))

        def ready(p):
            i = owner[p]
            pending[i].discard(p)
            if not pending[i]:
                send(buckets[i])
                if reset:
                    pending[i] = set(buckets[i])

        for i, b in enumerate(buckets):
            pending[i] = set(b)
            for p in b:
                if in_hooks:
                    p.register_post_accumulate_grad_hook(ready)

        def finish():
            if not in_hooks:
                for b in buckets:
                    send(b)
            for params, flat, work in works:
                work.wait()
                if average:
                    flat /= dist.get_world_size()
                offset = 0
                for q in params:
                    q.grad.copy_(flat[offset:offset + q.numel()].view_as(q))
                    offset += q.numel()
            works.clear()

        return finish
    return my_bucketed_ddp


def test_bucketed_ddp_checker():
    v = exercises.check_bucketed_ddp(bucketed_ddp())
    assert v.ok, str(v)
    mistakes = {"no all-reduce was issued during backward": bucketed_ddp(in_hooks=False),
                "holds the sum over the ranks: divide by N = 4": bucketed_ddp(average=False),
                "step 2: backward (your hooks) raised": bucketed_ddp(reset=False),
                "all-reduce calls for 4 buckets: one per bucket": bucketed_ddp(per_parameter=True)}
    for message, fn in mistakes.items():
        v = exercises.check_bucketed_ddp(fn)
        assert not v.ok and message in str(v), (message, str(v))
    v = exercises.check_bucketed_ddp(lambda buckets: None)
    assert "should return a function (finish)" in str(v)


def zero2_hooks(add=True, free="each", wait=True, send="each"):
    """ZeRO-2's hooks, right by default. The wrong ones, one per property the checker names: the shards
    (add=False: each reduce-scatter overwrites the shard), the calls (wait=False: a bucket is sent
    whenever one of its gradients lands), the memory (free=None: never freed; free="at the end": every
    bucket reduce-scattered in time, but the full gradients freed only once the last is done;
    send="at the end": every bucket sent and freed, but only once the last is complete)."""
    def my_zero2_hooks(buckets, grad_shards):
        from zeronb.runtime.compat import reduce_scatter_single

        pending = [set(b.params) for b in buckets]
        owner = {p: i for i, b in enumerate(buckets) for p in b.params}
        done = set()

        def send_bucket(i):
            out = torch.empty_like(grad_shards[i])
            reduce_scatter_single(out, buckets[i].flatten_grads())
            if add:
                grad_shards[i] += out
            else:
                grad_shards[i].copy_(out)
            if free == "each":
                for q in buckets[i].params:
                    q.grad = None

        def ready(p):
            i = owner[p]
            pending[i].discard(p)
            if pending[i] and wait:
                return
            pending[i] = set(buckets[i].params)
            done.add(i)
            if send == "each":
                send_bucket(i)
            elif len(done) == len(buckets):
                for j in range(len(buckets)):
                    send_bucket(j)
            if len(done) == len(buckets):
                if free == "at the end":
                    for b in buckets:
                        for q in b.params:
                            q.grad = None
                done.clear()

        for b in buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(ready)
    return my_zero2_hooks


def test_zero2_hooks_checker():
    v = exercises.check_zero2_hooks(zero2_hooks())
    assert v.ok, str(v)
    # shards: the second backward must add to the first
    v = exercises.check_zero2_hooks(zero2_hooks(add=False))
    assert not v.ok and "holds the last backward's sum only: add each reduce-scatter" in str(v), str(v)
    # calls: sent before the bucket is complete (the shards come out right: the pieces add up)
    v = exercises.check_zero2_hooks(zero2_hooks(wait=False))
    assert not v.ok and "16 reduce-scatter calls in two backwards of 4 buckets: more than one per bucket" in str(v), str(v)
    assert not any("shard" in p or "alive" in p for p in v.problems), str(v)
    # memory: never freed
    v = exercises.check_zero2_hooks(zero2_hooks(free=None))
    assert not v.ok and "full gradients are still held" in str(v), str(v)
    # memory: every bucket reduce-scattered in its hook, all the full gradients freed at the end of
    # backward only (ZeRO-1's peak); nothing is left after backward, so only the weighing at each
    # bucket's completion sees it
    v = exercises.check_zero2_hooks(zero2_hooks(free="at the end"))
    assert not v.ok, str(v)
    assert ("when bucket layer0 was complete, the full gradients of bucket(s) layer3, layer2, layer1, complete before "
            "it, were still alive: 91776 bytes of full gradients at once, all of them (91776), ZeRO-1's full gradient buffer. Free a "
            "bucket's gradients (p.grad = None) right after its reduce-scatter") in str(v), str(v)
    assert not any("calls" in p or "shard" in p for p in v.problems), str(v)
    # memory: every bucket sent and freed, but only once the last one is complete (ZeRO-1's pattern)
    v = exercises.check_zero2_hooks(zero2_hooks(send="at the end"))
    assert not v.ok and ("complete before it, were still alive, not yet reduce-scattered: 91776 bytes of full "
                         "gradients at once, all of them (91776), ZeRO-1's full gradient buffer. Reduce-scatter each bucket from "
                         "its hook as soon as its last gradient lands") in str(v), str(v)


def zero3_unit(free_after_forward=True, average=False):
    def my_zero3_unit(unit, flat, shard, grad_shard):
        from zeronb.runtime.compat import all_gather_single, reduce_scatter_single

        nbytes, storage, pending = flat.padded * flat.data.element_size(), flat.data.untyped_storage(), set()

        def gather():
            storage.resize_(nbytes)
            all_gather_single(flat.data.data, shard)

        def forward_pre(module, args):
            gather()
            pending.update(flat.params)

        def ready(p):
            pending.discard(p)
            if pending:
                return
            out = torch.empty_like(grad_shard)
            reduce_scatter_single(out, flat.flatten_grads())
            grad_shard.add_(out / dist.get_world_size() if average else out)
            for q in flat.params:
                q.grad = None
            storage.resize_(0)

        def free_after(module, args, out):  # (returns None: a forward hook's return value replaces the output)
            storage.resize_(0)

        unit.register_forward_pre_hook(forward_pre)
        if free_after_forward:
            unit.register_forward_hook(free_after)
        unit.register_full_backward_pre_hook(lambda m, g: gather())
        for p in flat.params:
            p.register_post_accumulate_grad_hook(ready)
    return my_zero3_unit


def test_zero3_unit_checker():
    v = exercises.check_zero3_unit(zero3_unit())
    assert v.ok, str(v)
    v = exercises.check_zero3_unit(zero3_unit(free_after_forward=False))
    assert not v.ok and "after its forward the unit still held" in str(v) and "1 reduce-scatter" not in str(v), str(v)
    v = exercises.check_zero3_unit(zero3_unit(average=True))
    assert not v.ok and "grad_shard holds the average" in str(v), str(v)
    v = exercises.check_zero3_unit(lambda unit, flat, shard, grad_shard: None)  # nothing gathers
    assert not v.ok and "raised" in str(v), str(v)


def accumulate_and_clip(scope="global", mean=True, gather=False):
    def my_accumulate_and_clip(micro_grads, max_norm):
        from zeronb.runtime.compat import all_gather_single, reduce_scatter_single

        n, k = dist.get_world_size(), len(micro_grads)
        shard = micro_grads[0].new_zeros(micro_grads[0].numel() // n)
        for g in micro_grads:
            part = torch.empty_like(shard)
            reduce_scatter_single(part, g)
            shard += part
        if mean:
            shard /= n * k
        if gather:  # the whole gradient on every rank, to take its norm: correct, and wasteful
            full = shard.new_empty(shard.numel() * n)
            all_gather_single(full, shard)
            norm = full.norm().item()
        else:
            squares = shard.pow(2).sum().reshape(1)
            if scope == "global":
                dist.all_reduce(squares)
            norm = squares.sqrt().item()
        if scope != "none":
            shard *= min(1.0, max_norm / (norm + 1e-6))
        return shard, norm
    return my_accumulate_and_clip


def test_accumulate_and_clip_checker():
    v = exercises.check_accumulate_and_clip(accumulate_and_clip())
    assert v.ok, str(v)
    mistakes = {"clipped by the norm of its own shard": accumulate_and_clip(scope="local"),
                "the gradient is not clipped": accumulate_and_clip(scope="none"),
                "a sum where the step needs the mean": accumulate_and_clip(mean=False),
                "called all_gather: nothing needs gathering": accumulate_and_clip(gather=True)}
    for message, fn in mistakes.items():
        v = exercises.check_accumulate_and_clip(fn)
        assert not v.ok and message in str(v), (message, str(v))


# --- chapter 13: two nodes of two ranks; bytes across nodes counted by the OS ----------------------

def hierarchical_all_reduce(t):
    from zeronb.runtime.compat import all_gather_single, reduce_scatter_single
    from zeronb.runtime.groups import node_groups

    within, across = node_groups()
    shard = t.new_empty(t.numel() // dist.get_world_size(within))
    reduce_scatter_single(shard, t, group=within)
    dist.all_reduce(shard, group=across)
    all_gather_single(t, shard, group=within)
    return t


def whole_tensor_across(t):  # the right sum, but the whole tensor crosses the slow link
    from zeronb.runtime.groups import node_groups

    within, across = node_groups()
    dist.all_reduce(t, group=within)
    dist.all_reduce(t, group=across)
    return t


def test_hierarchical_all_reduce_checker():
    assert exercises.check_hierarchical_all_reduce(hierarchical_all_reduce).ok
    v = exercises.check_hierarchical_all_reduce(whole_tensor_across, sizes=(65536,))
    assert not v.ok and "bytes across nodes" in str(v) and "the result" not in str(v)
    v = exercises.check_hierarchical_all_reduce(lambda t: dist.all_reduce(t) or t, sizes=(65536,))
    assert not v.ok and str(v).count("bytes across nodes;") == 2  # gloo's flat ring: two of its four edges cross

    def skip_the_gather(t):
        from zeronb.runtime.compat import reduce_scatter_single
        from zeronb.runtime.groups import node_groups

        within, across = node_groups()
        shard = t.new_empty(t.numel() // 2)
        reduce_scatter_single(shard, t, group=within)
        dist.all_reduce(shard, group=across)
        return torch.cat([shard, shard])

    v = exercises.check_hierarchical_all_reduce(skip_the_gather, sizes=(8,))
    assert not v.ok and "chunk 1" in str(v)


def hsdp_gradient(grad):
    from zeronb.runtime.compat import reduce_scatter_single
    from zeronb.runtime.groups import node_groups

    within, across = node_groups()
    shard = grad.new_empty(grad.numel() // dist.get_world_size(within))
    reduce_scatter_single(shard, grad, group=within)
    dist.all_reduce(shard, group=across)
    return shard / dist.get_world_size()


def test_hsdp_gradient_checker():
    assert exercises.check_hsdp_gradient(hsdp_gradient).ok

    def average_within_only(grad):
        from zeronb.runtime.groups import node_groups

        return hsdp_gradient(grad) * dist.get_world_size() / dist.get_world_size(node_groups()[0])

    v = exercises.check_hsdp_gradient(average_within_only)
    assert not v.ok and "2 x the average" in str(v)

    def all_reduce_then_slice(grad):  # right shard, the whole gradient sent across
        g = 2
        dist.all_reduce(grad)
        c = grad.numel() // g
        i = dist.get_rank() % g
        return grad[i * c:(i + 1) * c] / dist.get_world_size()

    v = exercises.check_hsdp_gradient(all_reduce_then_slice)
    assert not v.ok and "bytes across nodes" in str(v) and "the average" not in str(v)
