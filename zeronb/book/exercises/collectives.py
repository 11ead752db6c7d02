"""Checkers for the exercises on collectives and their bytes: all-reduce from reduce-scatter and
all-gather (chapter 3), the ring all-gather (chapter 4), the ZeRO-1 step (chapter 8) and ZeRO-3's
bytes per step (chapter 10). Each grades the method its exercise asks for: the collectives a rank
called and how often (the ledger), the peers of its sends, what it handed to the all-gather; and
on a second world size where a hard-coded N would go unseen."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ...ledger import CommLedger
from ...models import Config, make_model
from ...pool.errors import RankError
from ...shards import all_bounds, bounds, chunk_bounds, chunk_size
from ...train.runner import run
from ...train.runs import RunConfig
from .checking import Verdict, _inputs, _run, by_rank, collectives_made, each_pool, what_is_wrong


class Handed(TorchDispatchMode):
    """Inside a rank: a copy of what this rank handed to each collective ({op: [tensors]}), to grade
    *what* was communicated (the updated parameters, or the gradient?), not only how much."""

    OPS = {"_allgather_base_": ("all_gather", 1), "_reduce_scatter_base_": ("reduce_scatter", 1),
           "allreduce_": ("all_reduce", 0)}

    def __init__(self):
        super().__init__()
        self.inputs: dict[str, list] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.partition("::")[2]
        if func._schema.name.startswith("c10d::") and name in self.OPS:
            op, i = self.OPS[name]
            t = args[i][0] if isinstance(args[i], (list, tuple)) else args[i]
            self.inputs.setdefault(op, []).append(t.detach().clone().cpu())
        return func(*args, **(kwargs or {}))


def _returned(got):
    return got.detach().cpu() if isinstance(got, torch.Tensor) else got


# --- chapter 3: all-reduce from reduce-scatter and all-gather --------------------------------------

def _try_all_reduce(fn, numel, dtype):
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    x = _inputs(rank, numel, dtype)
    want = x.clone()
    dist.all_reduce(want)
    with CommLedger() as ledger:
        got = fn(x.clone())
    a, b = bounds(numel, n, rank)
    only_mine = x.clone()
    only_mine[a:b] = want[a:b]
    known = [(want / n, "the average where an all-reduce gives the sum: do not divide by N"),
             (only_mine, "only this rank's own chunk is summed, the rest is its input: all-gather the summed "
                         "chunks into the whole tensor"),
             (x, "this rank's own input, unchanged: nothing was summed")]
    problem = what_is_wrong("the result", _returned(got), want, dtype, all_bounds(numel, n), known)
    method = collectives_made(dict(ledger.calls), {"reduce_scatter": 1, "all_gather": 1},
                              "build it from one reduce_scatter_single and one all_gather_single")
    handed = (ledger.elements.get("reduce_scatter"), ledger.elements.get("all_gather"))
    if not method and handed != (numel, numel):
        method = (f"the reduce-scatter was handed {handed[0]} elements and the all-gather filled {handed[1]}, of the "
                  f"tensor's {numel}: reduce-scatter the whole tensor, all-gather the summed shards back into its size")
    return [p for p in (method, problem) if p]


def check_all_reduce(fn, world_size: int = 4, sizes=(12, 4092), dtype=torch.float32, also: int | None = 3) -> Verdict:
    """Exercise (chapter 3): `fn(tensor) -> tensor`, the all-reduce (sum) built from one
    reduce_scatter_single and one all_gather_single. Checked on `world_size` ranks and on `also`
    (sizes divide by both), against dist.all_reduce, with the collectives each rank called."""
    title = "all-reduce = reduce-scatter + all-gather"
    problems = []
    for pool in each_pool(world_size, also):
        for numel in sizes:
            res, err = _run(pool, _try_all_reduce, fn, numel, dtype)
            if err:
                return Verdict(title, [f"on {pool.world_size} ranks, {numel} elements: {err}"])
            problems += [f"on {pool.world_size} ranks, {numel} elements, {p}"
                         for p in by_rank(dict(enumerate(res)), pool.world_size)]
            if problems:  # (the same mistake again at the next size says nothing new)
                break
        if problems:
            break
    return Verdict(title, problems, [f"checked on {' and '.join(map(str, _sizes(world_size, also)))} ranks, sizes "
                                     f"{list(sizes)}, against dist.all_reduce, and the collectives each rank called"])


def _sizes(world_size, also):
    return [world_size] + ([also] if also and also != world_size else [])


# --- chapter 4: the ring all-gather from send and receive ------------------------------------------

def _try_ring_all_gather(fn, numel, dtype):
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    full = _inputs(0, numel, dtype)  # the same tensor everywhere: rank r holds its slice of it
    a, b = bounds(numel, n, rank)
    with CommLedger() as ledger:
        got = fn(full[a:b].clone(), numel)
    got = _returned(got)
    chunks = all_bounds(numel, n)
    problems = []
    collectives = sorted(op for op in ledger.calls if op != "send")
    if collectives:
        problems.append(f"you called {', '.join(collectives)}: write the ring with sends and receives only "
                        "(dist.P2POp with dist.batch_isend_irecv)")
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    others = sorted(set(ledger.sent_to) - {nxt})
    if others:
        problems.append(f"sent to rank(s) {', '.join(map(str, others))}: on a ring each rank sends only to the next "
                        f"one, (r+1) mod N, and receives only from the previous one")
    elif ledger.received_from and set(ledger.received_from) != {prv}:
        problems.append(f"received from rank(s) {', '.join(map(str, sorted(set(ledger.received_from) - {prv})))}: "
                        "on a ring each rank receives only from the previous one, (r-1) mod N")
    chunk_bytes = chunk_size(numel, n) * full.element_size()
    sends, sent = ledger.calls.get("send", 0), ledger.bytes_sent
    if not collectives and sent != (n - 1) * chunk_bytes:
        problems.append(f"{sends} send(s) of {sent} bytes in all; the ring takes N-1 = {n - 1} steps and sends one "
                        f"chunk ({chunk_bytes} bytes) at each: {(n - 1) * chunk_bytes} bytes")
    elif not collectives and sends != n - 1:
        problems.append(f"the right bytes, in {sends} sends: the ring takes N-1 = {n - 1} steps, one chunk, one send "
                        "each")
    wrong = what_is_wrong("the result", got, full.cpu(), dtype, chunks)
    if wrong and isinstance(got, torch.Tensor) and got.shape == full.shape:
        # a chunk that holds another chunk's values: the wrong one was forwarded or stored
        for c, (ca, cb) in enumerate(chunks):
            if torch.equal(got[ca:cb], full[ca:cb].cpu()):
                continue
            src = next((d for d, (da, db) in enumerate(chunks) if d != c and torch.equal(got[ca:cb], full[da:db].cpu())),
                       None)
            if src is not None:
                wrong = (f"the result: chunk {c} holds chunk {src}'s values: at step s send chunk (r-s) mod N (what "
                         "arrived at the step before) and store what arrives as chunk (r-s-1) mod N")
            break
    return problems + ([wrong] if wrong else [])


def check_ring_all_gather(fn, world_size: int = 4, sizes=(12, 4092), dtype=torch.float32, also: int | None = 3) -> Verdict:
    """Exercise (chapter 4): `fn(shard, numel) -> full tensor`, a ring all-gather written with
    point-to-point sends and receives only: N-1 steps, each rank sending to the next rank and
    receiving from the previous one, one chunk per step, (N-1)/N of the tensor in all."""
    title = "ring all-gather"
    problems = []
    for pool in each_pool(world_size, also):
        for numel in sizes:
            res, err = _run(pool, _try_ring_all_gather, fn, numel, dtype)
            if err:
                return Verdict(title, [f"on {pool.world_size} ranks, {numel} elements: {err}"])
            problems += [f"on {pool.world_size} ranks, {numel} elements, {p}"
                         for p in by_rank(dict(enumerate(res)), pool.world_size)]
            if problems:  # (the same mistake again at the next size says nothing new)
                break
        if problems:
            break
    return Verdict(title, problems, [f"checked on {' and '.join(map(str, _sizes(world_size, also)))} ranks, sizes "
                                     f"{list(sizes)}: the result, the collectives called, the peer and bytes of "
                                     "every send"])


# --- chapter 8: the ZeRO-1 step --------------------------------------------------------------------

def _try_zero1_step(fn, numel, lr):
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    params = _inputs(100, numel, torch.float64)           # replicated parameters
    grads = _inputs(rank, numel, torch.float64)           # each rank's own gradient
    total = torch.stack([_inputs(r, numel, torch.float64) for r in range(n)]).sum(0)
    mean = total / n
    want = params - lr * mean                             # one SGD step on the averaged gradient
    a, b = chunk_bounds(numel, n, rank)
    with CommLedger() as ledger, Handed() as handed:
        got = fn(params.clone(), grads.clone(), lr)
    got = _returned(got)
    only_mine = params.clone()
    only_mine[a:b] = want[a:b]
    known = [(params - lr * total, f"the update is N = {n} times too large: the reduce-scatter sums, divide the "
                                   "gradients by N"),
             (params - lr * total / 4, "divided by 4: divide by N = dist.get_world_size(), which is "
                                       f"{n} here") if n != 4 else (None, ""),
             (only_mine, "only this rank's own chunk is updated, the rest are the old parameters: all-gather the "
                         "updated chunks"),
             (params, "the parameters did not change")]
    problems = []
    if "all_reduce" in ledger.calls:
        problems.append("you all-reduced: ZeRO-1 reduce-scatters the gradients (each rank receives only its chunk), "
                        "updates that chunk and all-gathers the parameters")
    else:
        method = collectives_made(dict(ledger.calls), {"reduce_scatter": 1, "all_gather": 1},
                                  "one reduce-scatter of the gradients, one all-gather of the updated chunks")
        if method:
            problems.append(method)
    wrong = what_is_wrong("the new parameters", got, want, torch.float64, all_bounds(numel, n), known)
    gathered = handed.inputs.get("all_gather", [])
    if not problems and not wrong and gathered:  # right values: was it the updated parameters that travelled?
        mine = gathered[0].double().reshape(-1)
        if mine.numel() != b - a or not torch.allclose(mine, want[a:b].cpu(), rtol=1e-9, atol=1e-12):
            like = lambda t: mine.numel() == b - a and torch.allclose(mine, t.cpu(), rtol=1e-9, atol=1e-12)  # noqa: E731
            what = ("the gradient" if like(mean[a:b]) or like(total[a:b]) else
                    "the update, lr x the gradient" if like(lr * mean[a:b]) else "something else")
            problems.append(f"you all-gathered {what}: ZeRO-1 updates this rank's chunk of the parameters and "
                            "all-gathers the updated parameters themselves")
    return problems + ([wrong] if wrong else [])


def check_zero1_step(fn, world_size: int = 4, numel: int = 96, lr: float = 0.1, also: int | None = 3) -> Verdict:
    """Exercise (chapter 8): `fn(flat_params, flat_grads, lr) -> new flat_params`, one ZeRO-1 step
    with plain SGD: reduce-scatter the gradients (and average), update this rank's chunk only,
    all-gather the chunks. `numel` divides evenly by both world sizes. Checked: the new parameters
    against SGD on the averaged gradient, one reduce-scatter and one all-gather per rank, and what
    each rank all-gathered (its updated chunk, not a gradient)."""
    title = "ZeRO-1 step"
    problems = []
    for pool in each_pool(world_size, also):
        res, err = _run(pool, _try_zero1_step, fn, numel, lr)
        if err:
            return Verdict(title, [f"on {pool.world_size} ranks: {err}"])
        problems += [f"on {pool.world_size} ranks, {p}" for p in by_rank(dict(enumerate(res)), pool.world_size)]
        if problems:
            break
    return Verdict(title, problems, [f"checked on {' and '.join(map(str, _sizes(world_size, also)))} ranks against SGD "
                                     "on the averaged gradient, with the collectives each rank called and what it "
                                     "all-gathered"])


# --- chapter 10: ZeRO-3's traffic --------------------------------------------------------------------

def _zero3_step_bytes(pool, precision: str = "float32") -> int:
    """The bytes rank 0 of zeronb's ZeRO-3 was credited for one step of the GPT on `pool`."""
    report = run(RunConfig(stage=3, model="gpt", precision=precision, steps=2, global_batch=12, timeout=300),
                 pool).ranks[0]
    return sum(report.sent_bytes_per_step.values())


def _zero3_mistakes(units, n, b):
    """What plausible wrong formulas give, by what they forgot."""
    padded = [(n - 1) * -(-u // n) * b for u in units]
    exact = [(n - 1) * u * b // n for u in units]
    whole = [u * b for u in units]
    right = 3 * sum(padded) - padded[-1]
    mistakes = {}
    for got, why in ((3 * sum(padded), "the last unit is gathered once, not twice: it is never released between its "
                                        "forward and its backward"),
                     (2 * sum(padded) - padded[-1], "no reduce-scatter of the gradients: each unit's gradients are "
                                                    "reduce-scattered once per step"),
                     (3 * sum(exact) - exact[-1], "no padding: each unit's flat buffer is padded to a multiple of N, "
                                                  "so a collective moves (N-1) chunks of ceil(u/N) elements"),
                     (3 * sum(whole) - whole[-1], "the whole unit per collective: a ring sends (N-1)/N of it"),
                     (3 * sum(exact), "3(N-1)/N of the parameters: count each unit's calls (padded, the last unit "
                                      "gathered once)"),
                     (right * 4 // b, "the bytes of 4-byte elements: multiply by element_size")):
        if got != right:
            mistakes.setdefault(got, why)
    return right, mistakes


def check_zero3_bytes(fn, world_size: int = 4, also: int | None = 3) -> Verdict:
    """Exercise (chapter 10): `fn(unit_numels, world_size, element_size) -> bytes` that one rank of
    zeronb's ZeRO-3 sends per training step (the last unit is not gathered a second time).
    Checked against the ledger's count of a real step on the GPT model, on `world_size` ranks and on
    `also` (where the units need padding)."""
    title = "ZeRO-3 bytes per step"
    units = [sum(p.numel() for p in u.parameters()) for u in make_model(Config(kind="gpt")).units()]
    sizes = _sizes(world_size, also)
    runs = [(n, "float32", 4) for n in sizes] + [(world_size, "float64", 8)]  # (and a second element size)
    answers = {}
    for n, _, b in runs:  # the learner's formula first: no ranks are started for one that raises
        try:
            answers[n, b] = fn(units, n, b)
        except Exception as e:  # the learner's own code, run here in the notebook
            return Verdict(title, [f"your function raised {type(e).__name__}: {e}"])
    problems = []
    for pool in each_pool(world_size, also):
        n = pool.world_size
        for precision, b in [(p, b) for m, p, b in runs if m == n]:
            try:
                measured = _zero3_step_bytes(pool, precision)
            except RankError as e:
                return Verdict(title, [f"the reference run failed: {e}"])
            got = answers[n, b]
            if got == measured:
                continue
            right, mistakes = _zero3_mistakes(units, n, b)
            why = mistakes.get(got, "") if right == measured else ""
            problems.append(f"on {n} ranks (units of {units} elements, {precision}, {b} bytes each) your formula gives "
                            f"{got} bytes; the ledger credited {measured}" + (f": {why}" if why else ""))
            break
        if problems:
            break
    return Verdict(title, problems, [f"checked on {' and '.join(map(str, sizes))} ranks in float32, and in float64, "
                                     "against the ledger's credits for a real step of zeronb's ZeRO-3"])
