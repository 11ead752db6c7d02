"""Solutions to the chapters' exercises, right and wrong: each wrong one is a plausible mistake a
learner makes from the instructions alone, and names the line its checker must answer with.

    RIGHT[checker]                     a solution the checker must accept
    WRONG[checker] = [Wrong(...), ...] at least three, one per property the checker grades

Functions here run on the ranks (pickled by reference: the ranks import this module)."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist


class Wrong(NamedTuple):
    name: str                 # the mistake, in a few words
    property: str             # what the checker grades that it breaks: values, method, peers, memory, overlap, ...
    solution: Callable
    says: str                 # a line of the checker's verdict must contain this
    kwargs: dict = {}         # arguments to the checker (e.g. a shorter run)


def _compat():
    from zeronb.runtime import compat
    return compat


# --- chapter 3: all-reduce from reduce-scatter and all-gather ----------------------------------------

def all_reduce(t):
    c = _compat()
    shard = t.new_empty(t.numel() // dist.get_world_size())
    c.reduce_scatter_single(shard, t)
    out = torch.empty_like(t)
    c.all_gather_single(out, shard)
    return out


def all_reduce_builtin(t):  # the issue's: right values, no reduce-scatter at all
    t = t.clone()
    dist.all_reduce(t)
    return t


def all_reduce_forgot_the_gather(t):  # returns the reduced shard in place, the rest its own input
    shard = t.new_empty(t.numel() // dist.get_world_size())
    _compat().reduce_scatter_single(shard, t)
    out, n = t.clone(), shard.numel()
    out[dist.get_rank() * n:(dist.get_rank() + 1) * n] = shard
    return out


def all_reduce_averaged(t):
    return all_reduce(t) / dist.get_world_size()


def all_reduce_four_ranks(t):  # the chunk size of 4 ranks, hard-coded
    c = _compat()
    shard = t.new_empty(t.numel() // 4)
    c.reduce_scatter_single(shard, t[:shard.numel() * dist.get_world_size()].contiguous())
    out = torch.empty_like(t)
    c.all_gather_single(out[:shard.numel() * dist.get_world_size()], shard)
    return out


def all_reduce_by_sends(t):  # every rank sends its tensor to every other and adds what arrives
    r, n = dist.get_rank(), dist.get_world_size()
    out = t.clone()
    for k in range(1, n):
        incoming = torch.empty_like(t)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, (r + k) % n),
                                         dist.P2POp(dist.irecv, incoming, (r - k) % n)]):
            w.wait()
        out += incoming
    return out


# --- chapter 4: the ring all-gather --------------------------------------------------------------------

def _ring_steps(shard, numel, chunk_to_send, peer_of_step=None):
    r, n = dist.get_rank(), dist.get_world_size()
    c = numel // n
    out = shard.new_empty(numel)
    out[r * c:(r + 1) * c] = shard
    for s in range(n - 1):
        send_c, recv_c = chunk_to_send(r, s, n), (r - s - 1) % n
        nxt, prv = peer_of_step(r, s, n) if peer_of_step else ((r + 1) % n, (r - 1) % n)
        ops = [dist.P2POp(dist.isend, out[send_c * c:(send_c + 1) * c], nxt),
               dist.P2POp(dist.irecv, out[recv_c * c:(recv_c + 1) * c], prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    return out


def ring_all_gather(shard, numel):
    return _ring_steps(shard, numel, lambda r, s, n: (r - s) % n)


def ring_gather_with_the_collective(shard, numel):  # right result, but not a ring of sends
    out = shard.new_empty(numel)
    _compat().all_gather_single(out, shard)
    return out


def ring_forwards_its_own_chunk(shard, numel):  # always sends chunk r: the wrong chunk travels
    return _ring_steps(shard, numel, lambda r, s, n: r)


def ring_sends_to_everyone(shard, numel):  # direct exchange: its shard straight to every rank, same bytes
    r, n = dist.get_rank(), dist.get_world_size()
    c = numel // n
    out = shard.new_empty(numel)
    out[r * c:(r + 1) * c] = shard
    ops = []
    for k in range(1, n):
        ops += [dist.P2POp(dist.isend, shard, (r + k) % n),
                dist.P2POp(dist.irecv, out[(r - k) % n * c:((r - k) % n + 1) * c], (r - k) % n)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return out


def ring_whole_tensor_each_step(shard, numel):  # right result, (N-1) x the whole tensor sent
    r, n = dist.get_rank(), dist.get_world_size()
    out = ring_all_gather(shard, numel)
    for _ in range(n - 1):
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, out.clone(), (r + 1) % n),
                                         dist.P2POp(dist.irecv, torch.empty_like(out), (r - 1) % n)]):
            w.wait()
    return out


def ring_send_first(shard, numel):  # chapter 4's deadlock
    r, n = dist.get_rank(), dist.get_world_size()
    dist.send(shard, (r + 1) % n)
    dist.recv(shard, (r - 1) % n)
    return shard


def ring_four_ranks(shard, numel):  # the chunk indices of 4 ranks, hard-coded
    return _ring_steps(shard, numel, lambda r, s, n: (r - s) % 4 % n)


def ring_uninitialised(shard, numel):  # one step short: the last chunk never arrives
    r, n = dist.get_rank(), dist.get_world_size()
    c = numel // n
    out = torch.full((numel,), 6.8e34, dtype=shard.dtype, device=shard.device)  # what empty() may hold
    out[r * c:(r + 1) * c] = shard
    for s in range(n - 2):
        send_c, recv_c = (r - s) % n, (r - s - 1) % n
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, out[send_c * c:(send_c + 1) * c], (r + 1) % n),
                                         dist.P2POp(dist.irecv, out[recv_c * c:(recv_c + 1) * c], (r - 1) % n)]):
            w.wait()
    return out


# --- chapter 8: the ZeRO-1 step --------------------------------------------------------------------------

def zero1_step(params, grads, lr):
    c = _compat()
    n, r = dist.get_world_size(), dist.get_rank()
    shard = params.new_empty(params.numel() // n)
    c.reduce_scatter_single(shard, grads / n)
    k = shard.numel()
    c.all_gather_single(params, params[r * k:(r + 1) * k] - lr * shard)
    return params


def zero1_ddp_step(params, grads, lr):  # the issue's: the DDP step the exercise exists to replace
    g = grads / dist.get_world_size()
    dist.all_reduce(g)
    return params - lr * g


def zero1_no_average(params, grads, lr):
    c = _compat()
    n, r = dist.get_world_size(), dist.get_rank()
    shard = params.new_empty(params.numel() // n)
    c.reduce_scatter_single(shard, grads)
    k = shard.numel()
    c.all_gather_single(params, params[r * k:(r + 1) * k] - lr * shard)
    return params


def zero1_gathers_the_gradient(params, grads, lr):  # right values: gathers the gradient, updates everything
    c = _compat()
    n = dist.get_world_size()
    shard = params.new_empty(params.numel() // n)
    c.reduce_scatter_single(shard, grads / n)
    full = torch.empty_like(params)
    c.all_gather_single(full, shard)
    return params - lr * full


def zero1_divides_by_four(params, grads, lr):
    c = _compat()
    n, r = dist.get_world_size(), dist.get_rank()
    shard = params.new_empty(params.numel() // n)
    c.reduce_scatter_single(shard, grads / 4)
    k = shard.numel()
    c.all_gather_single(params, params[r * k:(r + 1) * k] - lr * shard)
    return params


def zero1_forgot_the_gather(params, grads, lr):
    n, r = dist.get_world_size(), dist.get_rank()
    shard = params.new_empty(params.numel() // n)
    _compat().reduce_scatter_single(shard, grads / n)
    k = shard.numel()
    params[r * k:(r + 1) * k] -= lr * shard
    return params


# --- chapter 10: ZeRO-3's bytes per step -----------------------------------------------------------------

def _per_collective(units, n, b):
    return [(n - 1) * -(-u // n) * b for u in units]


def zero3_bytes(units, n, b):
    per = _per_collective(units, n, b)
    return 3 * sum(per) - per[-1]


def zero3_bytes_naive(units, n, b):  # the paper's 3 x (N-1)/N Psi
    return 3 * (n - 1) * sum(units) * b // n


def zero3_bytes_no_padding(units, n, b):
    per = [(n - 1) * u * b // n for u in units]
    return 3 * sum(per) - per[-1]


def zero3_bytes_last_unit_twice(units, n, b):
    return 3 * sum(_per_collective(units, n, b))


def zero3_bytes_no_reduce_scatter(units, n, b):
    per = _per_collective(units, n, b)
    return 2 * sum(per) - per[-1]


# --- chapter 7: bucketed DDP --------------------------------------------------------------------------------

def bucketed_ddp(average=True, reset=True, in_hooks=True, per_parameter=False, wait_in_hook=False):
    """The right hooks by default; each argument makes one mistake."""
    def my_bucketed_ddp(buckets):
        works, pending = [], {}
        owner = {p: i for i, b in enumerate(buckets) for p in b}

        def send(params):
            groups = [[q] for q in params] if per_parameter else [params]
            for group in groups:
                flat = torch.cat([q.grad.reshape(-1) for q in group])
                if wait_in_hook == "sync":     # the issue's: a blocking all-reduce inside the hook
                    dist.all_reduce(flat)
                    works.append((group, flat, None))
                    continue
                work = dist.all_reduce(flat, async_op=True)
                if wait_in_hook:               # async, but waited for at once
                    work.wait()
                works.append((group, flat, work))

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
                if work is not None:
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


# --- chapter 9: ZeRO-2's reduce-scatter hooks ---------------------------------------------------------------

def zero2_hooks(add=True, free="each", wait=True, send="each", collective="reduce_scatter"):
    """ZeRO-2's hooks, right by default. The wrong ones, one per property the checker names: the shards
    (add=False: each reduce-scatter overwrites the shard), the calls (wait=False: a bucket is sent
    whenever one of its gradients lands), the memory (free=None: never freed; free="at the end": every
    bucket reduce-scattered in time, but the full gradients freed only once the last is done;
    send="at the end": every bucket sent and freed, but only once the last is complete), the method
    (collective="all_reduce": the whole sum to every rank, then its chunk kept)."""
    def my_zero2_hooks(buckets, grad_shards):
        from zeronb.runtime.compat import reduce_scatter_single

        pending = [set(b.params) for b in buckets]
        owner = {p: i for i, b in enumerate(buckets) for p in b.params}
        done = set()

        def send_bucket(i):
            if collective == "all_reduce":
                flat = buckets[i].flatten_grads().clone()
                dist.all_reduce(flat)
                out = buckets[i].chunk(dist.get_rank(), flat).clone()
            else:
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


# --- chapter 10: one ZeRO-3 unit --------------------------------------------------------------------------

def zero3_unit(free_after_forward=True, average=False, backward_gather="shards", collective="reduce_scatter",
               padded=True):
    """The right hooks by default. backward_gather="zeros": the issue's, a buffer of zeros before backward
    (a Linear's weight gradient does not depend on its weights: only what flows back through it shows it)."""
    def my_zero3_unit(unit, flat, shard, grad_shard):
        from zeronb.runtime.compat import all_gather_single, reduce_scatter_single

        size = flat.padded if padded else flat.numel
        nbytes, storage, pending = size * flat.data.element_size(), flat.data.untyped_storage(), set()

        def gather(what="shards"):
            storage.resize_(nbytes)
            if what == "zeros":
                flat.data.data.zero_()
            else:
                all_gather_single(flat.data.data, shard)

        def forward_pre(module, args):
            gather()
            pending.update(flat.params)

        def ready(p):
            pending.discard(p)
            if pending:
                return
            if collective == "all_reduce":
                full = flat.flatten_grads().clone()
                dist.all_reduce(full)
                out = flat.chunk(dist.get_rank(), full)
            else:
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
        unit.register_full_backward_pre_hook(lambda m, g: gather(backward_gather))
        for p in flat.params:
            p.register_post_accumulate_grad_hook(ready)
    return my_zero3_unit


def zero3_unit_nothing(unit, flat, shard, grad_shard):  # registers no hook: forward meets a freed buffer
    return None


# --- chapter 12: accumulation and global-norm clipping -------------------------------------------------------

def accumulate_and_clip(scope="global", mean=True, gather=False, divisor=None):
    def my_accumulate_and_clip(micro_grads, max_norm):
        from zeronb.runtime.compat import all_gather_single, reduce_scatter_single

        n, k = dist.get_world_size(), len(micro_grads)
        shard = micro_grads[0].new_zeros(micro_grads[0].numel() // n)
        for g in micro_grads:
            part = torch.empty_like(shard)
            reduce_scatter_single(part, g)
            shard += part
        if mean:
            shard /= (divisor or n) * k
        if gather:  # the whole gradient on every rank, to take its norm: correct, and wasteful
            full = shard.new_empty(shard.numel() * n)
            all_gather_single(full, shard)
            norm = full.norm().item()
        elif scope == "all-reduce the shard":  # right norm from the whole shard, all-reduced: wasteful
            full = micro_grads[0].new_zeros(micro_grads[0].numel())
            full[dist.get_rank() * shard.numel():(dist.get_rank() + 1) * shard.numel()] = shard
            dist.all_reduce(full)
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


# --- chapter 13: two nodes of two ranks; bytes across nodes counted by the OS --------------------------------

def hierarchical_all_reduce(t):
    from zeronb.runtime.groups import node_groups

    c = _compat()
    within, across = node_groups()
    shard = t.new_empty(t.numel() // dist.get_world_size(within))
    c.reduce_scatter_single(shard, t, group=within)
    dist.all_reduce(shard, group=across)
    c.all_gather_single(t, shard, group=within)
    return t


def hierarchical_whole_tensor_across(t):  # the right sum, but the whole tensor crosses the slow link
    from zeronb.runtime.groups import node_groups

    within, across = node_groups()
    dist.all_reduce(t, group=within)
    dist.all_reduce(t, group=across)
    return t


def hierarchical_flat(t):  # one flat all-reduce: half its ring's edges cross the nodes
    dist.all_reduce(t)
    return t


def hierarchical_skip_the_gather(t):
    from zeronb.runtime.groups import node_groups

    within, across = node_groups()
    shard = t.new_empty(t.numel() // 2)
    _compat().reduce_scatter_single(shard, t, group=within)
    dist.all_reduce(shard, group=across)
    return torch.cat([shard, shard])


def hsdp_gradient(grad):
    from zeronb.runtime.groups import node_groups

    within, across = node_groups()
    shard = grad.new_empty(grad.numel() // dist.get_world_size(within))
    _compat().reduce_scatter_single(shard, grad, group=within)
    dist.all_reduce(shard, group=across)
    return shard / dist.get_world_size()


def hsdp_average_within_only(grad):
    from zeronb.runtime.groups import node_groups

    return hsdp_gradient(grad) * dist.get_world_size() / dist.get_world_size(node_groups()[0])


def hsdp_sum(grad):
    return hsdp_gradient(grad) * dist.get_world_size()


def hsdp_all_reduce_then_slice(grad):  # right shard, the whole gradient sent across
    g = 2
    dist.all_reduce(grad)
    c = grad.numel() // g
    i = dist.get_rank() % g
    return grad[i * c:(i + 1) * c] / dist.get_world_size()


def hsdp_all_reduce_within(grad):  # right values and bytes across; twice the bytes within the node
    from zeronb.runtime.groups import node_groups

    within, across = node_groups()
    g = dist.get_world_size(within)
    dist.all_reduce(grad, group=within)
    c, i = grad.numel() // g, dist.get_rank(within)
    shard = grad[i * c:(i + 1) * c].contiguous()
    dist.all_reduce(shard, group=across)
    return shard / dist.get_world_size()


# --- found by a newcomer writing wrong solutions from the instructions alone (each stands for a class) -----

def all_reduce_gather_everything(t):  # a token reduce-scatter, then every rank's whole tensor gathered and summed
    c = _compat()
    n = dist.get_world_size()
    c.reduce_scatter_single(torch.empty(1, dtype=t.dtype, device=t.device), torch.zeros(n, dtype=t.dtype, device=t.device))
    everything = torch.empty(n * t.numel(), dtype=t.dtype, device=t.device)
    c.all_gather_single(everything, t.contiguous())
    return everything.view(n, -1).sum(0).view_as(t)


def bucketed_ddp_fires_on_first_param(buckets):  # sends a bucket when its first parameter's gradient lands
    works, first = [], {b[0]: i for i, b in enumerate(buckets)}

    def ready(p):
        if p in first:
            i = first[p]
            flat = torch.cat([q.grad.reshape(-1) if q.grad is not None else torch.zeros(q.numel(), dtype=p.dtype)
                              for q in buckets[i]])
            works.append((buckets[i], flat, dist.all_reduce(flat, async_op=True)))

    for b in buckets:
        for p in b:
            p.register_post_accumulate_grad_hook(ready)

    def finish():
        for bucket, flat, work in works:
            work.wait()
            flat /= dist.get_world_size()
            offset = 0
            for q in bucket:
                if q.grad is None:
                    q.grad = torch.zeros_like(q)
                q.grad.copy_(flat[offset:offset + q.numel()].view_as(q))
                offset += q.numel()
        works.clear()
    return finish


def bucketed_ddp_divides_by_four(buckets):
    finish = bucketed_ddp()(buckets)
    n = dist.get_world_size()

    def finish_over_four():  # the notebook's finish, then rescaled as if it had divided by 4
        finish()
        for b in buckets:
            for q in b:
                q.grad.mul_(n / 4)
    return finish_over_four


def bucketed_ddp_keeps_its_flats(buckets):
    finish, kept = bucketed_ddp()(buckets), []

    def finish_keeping():  # keeps a copy of every bucket's averaged gradients, step after step
        finish()
        kept.extend(torch.cat([q.grad.reshape(-1) for q in b]) for b in buckets)
    return finish_keeping


def zero1_gathers_the_update(params, grads, lr):  # all-gathers lr x the gradient: right values
    c = _compat()
    n = dist.get_world_size()
    shard = params.new_empty(params.numel() // n)
    c.reduce_scatter_single(shard, grads / n)
    update = torch.empty_like(params)
    c.all_gather_single(update, (lr * shard).contiguous())
    return params - update


def zero2_keeps_flats(buckets, grad_shards):  # the right hooks, each bucket's flat gradients kept in a list
    from zeronb.runtime.compat import reduce_scatter_single

    owner = {p: i for i, b in enumerate(buckets) for p in b.params}
    waiting, kept = [set(b.params) for b in buckets], []

    def ready(p):
        i = owner[p]
        waiting[i].discard(p)
        if waiting[i]:
            return
        flat = buckets[i].flatten_grads()
        kept.append(flat)
        out = torch.empty_like(grad_shards[i])
        reduce_scatter_single(out, flat)
        grad_shards[i] += out
        for q in buckets[i].params:
            q.grad = None
        waiting[i] = set(buckets[i].params)

    for b in buckets:
        for p in b.params:
            p.register_post_accumulate_grad_hook(ready)


def zero3_bytes_float32_only(units, n, b):  # the element size written in as 4
    per = _per_collective(units, n, 4)
    return 3 * sum(per) - per[-1]


def zero3_unit_caches(unit, flat, shard, grad_shard):  # the right hooks, and a copy of every gather kept
    cache = []
    zero3_unit()(unit, flat, shard, grad_shard)
    unit.register_forward_pre_hook(lambda m, a: cache.append(flat.data.detach().clone()))


def accumulate_and_clip_scales_up(micro_grads, max_norm):  # max_norm / norm without min(1, ...)
    n, k = dist.get_world_size(), len(micro_grads)
    shard = micro_grads[0].new_zeros(micro_grads[0].numel() // n)
    for g in micro_grads:
        part = torch.empty_like(shard)
        _compat().reduce_scatter_single(part, g)
        shard += part
    shard /= n * k
    squares = shard.pow(2).sum().reshape(1)
    dist.all_reduce(squares)
    norm = squares.sqrt().item()
    return shard * (max_norm / (norm + 1e-6)), norm


def hierarchical_node_of_two(t):  # the node size written in as 2
    from zeronb.runtime.groups import node_groups

    c = _compat()
    within, across = node_groups()
    shard = t.new_empty(t.numel() // 2)
    c.reduce_scatter_single(shard, t, group=within)
    dist.all_reduce(shard, group=across)
    c.all_gather_single(t, shard, group=within)
    return t


def hsdp_divides_by_four(grad):
    return hsdp_gradient(grad) * dist.get_world_size() / 4


RIGHT = {
    "check_all_reduce": all_reduce,
    "check_ring_all_gather": ring_all_gather,
    "check_zero1_step": zero1_step,
    "check_zero3_bytes": zero3_bytes,
    "check_bucketed_ddp": bucketed_ddp(),
    "check_zero2_hooks": zero2_hooks(),
    "check_zero3_unit": zero3_unit(),
    "check_accumulate_and_clip": accumulate_and_clip(),
    "check_hierarchical_all_reduce": hierarchical_all_reduce,
    "check_hsdp_gradient": hsdp_gradient,
}

WRONG = {
    "check_all_reduce": [
        Wrong("a token reduce-scatter, the whole tensor gathered", "what is handed", all_reduce_gather_everything,
              "reduce-scatter the whole tensor"),
        Wrong("dist.all_reduce itself", "method", all_reduce_builtin, "you called all_reduce"),
        Wrong("point-to-point sends", "method", all_reduce_by_sends, "you called send"),
        Wrong("forgot the all-gather", "values", all_reduce_forgot_the_gather,
              "only this rank's own chunk is summed"),
        Wrong("averaged", "values", all_reduce_averaged, "the average where an all-reduce gives the sum"),
        Wrong("chunks of 4 ranks, hard-coded", "world size", all_reduce_four_ranks, "on 3 ranks"),
    ],
    "check_ring_all_gather": [
        Wrong("the built-in all-gather", "method", ring_gather_with_the_collective, "you called all_gather"),
        Wrong("its shard straight to every rank", "peers", ring_sends_to_everyone,
              "on a ring each rank sends only to the next one"),
        Wrong("the whole tensor at each step", "bytes", ring_whole_tensor_each_step,
              "the ring takes N-1 = 3 steps and sends one chunk"),
        Wrong("forwards its own chunk at every step", "values", ring_forwards_its_own_chunk,
              "holds chunk"),
        Wrong("one step short", "values", ring_uninitialised, "are uninitialised memory"),
        Wrong("chunk indices of 4 ranks", "world size", ring_four_ranks, "on 3 ranks"),
        Wrong("sends before it receives", "deadlock", ring_send_first, "deadlock", {"sizes": (12,), "also": None}),
    ],
    "check_zero1_step": [
        Wrong("all-gathers the update", "what is communicated", zero1_gathers_the_update, "you all-gathered the update"),
        Wrong("the DDP step", "method", zero1_ddp_step, "you all-reduced: ZeRO-1 reduce-scatters the gradients"),
        Wrong("all-gathers the gradient, updates everything", "what is communicated", zero1_gathers_the_gradient,
              "you all-gathered the gradient"),
        Wrong("no average", "values", zero1_no_average, "the update is N = 4 times too large"),
        Wrong("divides by 4", "world size", zero1_divides_by_four, "divided by 4"),
        Wrong("forgot the all-gather", "method", zero1_forgot_the_gather, "0 all_gather call(s)"),
    ],
    "check_zero3_bytes": [
        Wrong("the element size written in as 4", "element size", zero3_bytes_float32_only,
              "the bytes of 4-byte elements"),
        Wrong("3(N-1)/N Psi b", "formula", zero3_bytes_naive, "ledger credited"),
        Wrong("no padding", "padding", zero3_bytes_no_padding, "no padding"),
        Wrong("the last unit gathered twice", "calls", zero3_bytes_last_unit_twice, "the last unit is gathered once"),
        Wrong("no reduce-scatter", "calls", zero3_bytes_no_reduce_scatter, "no reduce-scatter"),
    ],
    "check_bucketed_ddp": [
        Wrong("sends a bucket when its first gradient lands", "when", bucketed_ddp_fires_on_first_param,
              "went out before all its gradients had landed"),
        Wrong("divides by 4", "world size", bucketed_ddp_divides_by_four, "on 3 ranks"),
        Wrong("keeps every step's averaged buckets", "memory", bucketed_ddp_keeps_its_flats,
              "after finish() your code still holds"),
        Wrong("a blocking all-reduce in the hook", "overlap", bucketed_ddp(wait_in_hook="sync"),
              "backward waited for its all-reduces"),
        Wrong("async, but waited for in the hook", "overlap", bucketed_ddp(wait_in_hook=True),
              "backward waited for its all-reduces"),
        Wrong("all-reduced after backward", "when", bucketed_ddp(in_hooks=False), "no all-reduce was issued during backward"),
        Wrong("one all-reduce per parameter", "calls", bucketed_ddp(per_parameter=True),
              "8 all_reduce call(s) where the method makes 4"),
        Wrong("the sum, not the average", "values", bucketed_ddp(average=False), "the sum over the ranks: divide by N = 4"),
        Wrong("what a bucket waits for is not reset", "second step", bucketed_ddp(reset=False),
              "step 2: backward (your hooks) raised"),
    ],
    "check_zero2_hooks": [
        Wrong("keeps each bucket's flat gradients", "memory kept", zero2_keeps_flats, "your hooks still hold"),
        Wrong("overwrites the shard", "values", zero2_hooks(add=False),
              "holds the last backward's sum only: add each reduce-scatter"),
        Wrong("sends a bucket at every gradient", "calls", zero2_hooks(wait=False),
              "more than one per bucket"),
        Wrong("all-reduces the bucket and keeps its chunk", "method", zero2_hooks(collective="all_reduce"),
              "you called all_reduce: ZeRO-2 reduce-scatters each bucket"),
        Wrong("never frees the full gradients", "memory", zero2_hooks(free=None), "full gradients are still held"),
        Wrong("frees them all when backward ends", "memory", zero2_hooks(free="at the end"),
              "ZeRO-1's full gradient buffer. Free a bucket's gradients (p.grad = None) right after its reduce-scatter"),
        Wrong("sends every bucket when the last completes", "memory", zero2_hooks(send="at the end"),
              "not yet reduce-scattered"),
    ],
    "check_zero3_unit": [
        Wrong("keeps a copy of every gather", "memory kept", zero3_unit_caches, "your hooks still hold"),
        Wrong("gathers zeros before backward", "values seen", zero3_unit(backward_gather="zeros"),
              "the unit's backward saw parameters that are not the full ones"),
        Wrong("keeps the parameters after forward", "memory", zero3_unit(free_after_forward=False),
              "after its forward the unit still held"),
        Wrong("the average in grad_shard", "values", zero3_unit(average=True), "grad_shard holds the average"),
        Wrong("all-reduces the gradients", "method", zero3_unit(collective="all_reduce"), "you called all_reduce"),
        Wrong("the buffer resized without its padding", "padding", zero3_unit(padded=False),
              "your hooks) raised RuntimeError"),
        Wrong("registers nothing", "gather", zero3_unit_nothing, "its buffer held 0 of 34336 bytes: gather before forward"),
    ],
    "check_accumulate_and_clip": [
        Wrong("scales up a gradient below max_norm", "values", accumulate_and_clip_scales_up, "scaled up"),
        Wrong("clipped by its own shard's norm", "values", accumulate_and_clip(scope="local"),
              "clipped by the norm of this rank's own shard"),
        Wrong("not clipped", "values", accumulate_and_clip(scope="none"), "not clipped"),
        Wrong("a sum, not the mean", "values", accumulate_and_clip(mean=False), "a sum where the step needs the mean"),
        Wrong("gathers the gradient for its norm", "method", accumulate_and_clip(gather=True),
              "you called all_gather: nothing needs gathering"),
        Wrong("all-reduces the gradient for its norm", "method", accumulate_and_clip(scope="all-reduce the shard"),
              "the norm needs one number from each rank"),
        Wrong("divides by 4 ranks", "world size", accumulate_and_clip(divisor=4), "on 3 ranks"),
    ],
    "check_hierarchical_all_reduce": [
        Wrong("the node size written in as 2", "node size", hierarchical_node_of_two, "on 2 nodes x 3 ranks"),
        Wrong("the whole tensor across nodes", "bytes across", hierarchical_whole_tensor_across, "bytes across nodes"),
        Wrong("one flat all-reduce", "method", hierarchical_flat, "0 reduce_scatter call(s)"),
        Wrong("skips the all-gather", "values", hierarchical_skip_the_gather, "the result"),
    ],
    "check_hsdp_gradient": [
        Wrong("divides by 4", "world size", hsdp_divides_by_four, "on 2 nodes x 3 ranks"),
        Wrong("averaged within the node only", "values", hsdp_average_within_only, "2 x the average"),
        Wrong("the sum", "values", hsdp_sum, "4 x the average"),
        Wrong("all-reduces the whole gradient, then slices", "bytes across", hsdp_all_reduce_then_slice,
              "bytes across nodes"),
        Wrong("all-reduces within the node, then slices", "method", hsdp_all_reduce_within, "0 reduce_scatter call(s)"),
    ],
}
