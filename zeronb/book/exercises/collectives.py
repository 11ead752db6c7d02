"""Checkers for the exercises on collectives and their bytes: all-reduce from reduce-scatter and
all-gather (chapter 3), the ring all-gather (chapter 4), the ZeRO-1 step (chapter 8) and ZeRO-3's
bytes per step (chapter 10)."""
from __future__ import annotations

import torch

from ...ledger import CommLedger
from ...models import Config, make_model
from ...pool.errors import RankError
from ...shards import all_bounds, bounds, chunk_bounds, chunk_size
from ...train.runner import run
from ...train.runs import RunConfig
from .checking import Verdict, _compare, _inputs, _pool, _run

# --- chapter 3: all-reduce from reduce-scatter and all-gather --------------------------------------

def _try_all_reduce(fn, numel, dtype):
    import torch.distributed as dist

    x = _inputs(dist.get_rank(), numel, dtype)
    want = x.clone()
    dist.all_reduce(want)
    got = fn(x.clone())
    return (got.cpu() if isinstance(got, torch.Tensor) else got), want.cpu()


def check_all_reduce(fn, world_size: int = 4, sizes=(8, 12, 4096), dtype=torch.float32) -> Verdict:
    """Exercise (chapter 3): `fn(tensor) -> tensor`, the all-reduce (sum) built from
    reduce_scatter_single and all_gather_single. Sizes divide evenly by the world size."""
    pool, problems = _pool(world_size), []
    for numel in sizes:
        res, err = _run(pool, _try_all_reduce, fn, numel, dtype)
        if err:
            return Verdict("all-reduce = reduce-scatter + all-gather", [f"with {numel} elements: {err}"])
        n = numel // world_size
        chunks = [(r * n, (r + 1) * n) for r in range(world_size)]
        for rank, (got, want) in enumerate(res):
            problems += [f"with {numel} elements, {p}" for p in _compare("the result", rank, got, want, dtype, chunks)]
    return Verdict("all-reduce = reduce-scatter + all-gather", problems,
                   [f"checked on {world_size} ranks, sizes {list(sizes)}, against dist.all_reduce"])


# --- chapter 4: the ring all-gather from send and receive ------------------------------------------

def _try_ring_all_gather(fn, numel, dtype):
    import torch.distributed as dist

    rank = dist.get_rank()
    full = _inputs(0, numel, dtype)  # the same tensor everywhere: rank r holds its slice of it
    a, b = bounds(numel, dist.get_world_size(), rank)
    with CommLedger() as ledger:
        got = fn(full[a:b].clone(), numel)
    return (got.cpu() if isinstance(got, torch.Tensor) else got), full, ledger.bytes_sent, dict(ledger.by_op)


def check_ring_all_gather(fn, world_size: int = 4, sizes=(8, 4096), dtype=torch.float32) -> Verdict:
    """Exercise (chapter 4): `fn(shard, numel) -> full tensor`, a ring all-gather written with
    point-to-point sends and receives only: N-1 steps, (N-1)/N of the tensor sent by each rank."""
    pool, problems = _pool(world_size), []
    for numel in sizes:
        res, err = _run(pool, _try_ring_all_gather, fn, numel, dtype)
        if err:
            return Verdict("ring all-gather", [f"with {numel} elements: {err}"])
        chunks = all_bounds(numel, world_size)
        want_bytes = (world_size - 1) * chunk_size(numel, world_size) * torch.tensor([], dtype=dtype).element_size()
        for rank, (got, want, sent, by_op) in enumerate(res):
            problems += [f"with {numel} elements, {p}" for p in _compare("the result", rank, got, want, dtype, chunks)]
            collectives = sorted(op for op in by_op if op != "send")
            if collectives:
                problems.append(f"rank {rank} called {', '.join(collectives)}: write the ring with sends and "
                                "receives only (dist.isend / dist.irecv / batch_isend_irecv)")
            elif sent != want_bytes:
                problems.append(f"with {numel} elements, rank {rank} sent {sent} bytes; a ring sends "
                                f"(N-1) chunks = {want_bytes} bytes (did you send the whole tensor, or use a collective?)")
    return Verdict("ring all-gather", problems, [f"checked on {world_size} ranks, sizes {list(sizes)}"])


# --- chapter 8: the ZeRO-1 step --------------------------------------------------------------------

def _try_zero1_step(fn, numel, lr):
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    params = _inputs(100, numel, torch.float64)           # replicated parameters
    grads = _inputs(rank, numel, torch.float64)           # each rank's own gradient
    mean = torch.stack([_inputs(r, numel, torch.float64) for r in range(n)]).mean(0)
    want = params - lr * mean                             # one SGD step on the averaged gradient
    a, b = chunk_bounds(numel, n, rank)
    got = fn(params.clone(), grads.clone(), lr)
    return (got if isinstance(got, torch.Tensor) else got), want, (a, b)


def check_zero1_step(fn, world_size: int = 4, numel: int = 64, lr: float = 0.1) -> Verdict:
    """Exercise (chapter 8): `fn(flat_params, flat_grads, lr) -> new flat_params`, one ZeRO-1 step
    with plain SGD: reduce-scatter the gradients (and average), update this rank's chunk only,
    all-gather the chunks. `numel` divides evenly by the world size."""
    pool, problems = _pool(world_size), []
    res, err = _run(pool, _try_zero1_step, fn, numel, lr)
    if err:
        return Verdict("ZeRO-1 step", [err])
    chunks = [res[r][2] for r in range(world_size)]
    for rank, (got, want, _) in enumerate(res):
        problems += _compare("the new parameters", rank, got, want, torch.float64, chunks)
    if not problems and any(not torch.equal(res[0][0], res[r][0]) for r in range(world_size)):
        problems.append("the ranks ended with different parameters: did every rank all-gather?")
    return Verdict("ZeRO-1 step", problems, [f"checked on {world_size} ranks against SGD on the averaged gradient"])


# --- chapter 10: ZeRO-3's traffic --------------------------------------------------------------------

def check_zero3_bytes(fn, world_size: int = 4) -> Verdict:
    """Exercise (chapter 10): `fn(unit_numels, world_size, element_size) -> bytes` that one rank of
    zeronb's ZeRO-3 sends per training step (the last unit is not gathered a second time).
    Checked against the ledger's count of a real step on the GPT model."""
    try:
        report = run(RunConfig(stage=3, model="gpt", precision="float32", steps=2, timeout=300), _pool(world_size)).ranks[0]
    except RankError as e:
        return Verdict("ZeRO-3 bytes per step", [f"the reference run failed: {e}"])

    units = [sum(p.numel() for p in u.parameters()) for u in make_model(Config(kind="gpt")).units()]
    measured = sum(report.sent_bytes_per_step.values())
    try:
        got = fn(units, world_size, 4)
    except Exception as e:  # the learner's own code, run here in the notebook
        return Verdict("ZeRO-3 bytes per step", [f"your function raised {type(e).__name__}: {e}"])
    problems = [] if got == measured else [
        f"your formula gives {got} bytes; the ledger counted {measured} "
        f"({report.sent_bytes_per_step}) on {world_size} ranks with units of {units} elements"]
    return Verdict("ZeRO-3 bytes per step", problems, ["checked against the ledger's credits for a real step of zeronb's ZeRO-3"])
