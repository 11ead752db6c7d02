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


RIGHT = {
    "check_all_reduce": all_reduce,
    "check_ring_all_gather": ring_all_gather,
    "check_zero1_step": zero1_step,
    "check_zero3_bytes": zero3_bytes,
}

WRONG = {
    "check_all_reduce": [
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
        Wrong("the DDP step", "method", zero1_ddp_step, "you all-reduced: ZeRO-1 reduce-scatters the gradients"),
        Wrong("all-gathers the gradient, updates everything", "what is communicated", zero1_gathers_the_gradient,
              "you all-gathered the gradient"),
        Wrong("no average", "values", zero1_no_average, "the update is N = 4 times too large"),
        Wrong("divides by 4", "world size", zero1_divides_by_four, "divided by 4"),
        Wrong("forgot the all-gather", "method", zero1_forgot_the_gather, "0 all_gather call(s)"),
    ],
    "check_zero3_bytes": [
        Wrong("3(N-1)/N Psi b", "formula", zero3_bytes_naive, "ledger credited"),
        Wrong("no padding", "padding", zero3_bytes_no_padding, "no padding"),
        Wrong("the last unit gathered twice", "calls", zero3_bytes_last_unit_twice, "the last unit is gathered once"),
        Wrong("no reduce-scatter", "calls", zero3_bytes_no_reduce_scatter, "no reduce-scatter"),
    ],
}
