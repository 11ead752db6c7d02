"""What every checker shares: the verdict it returns, running the learner's code on the ranks with a
crash or a hang turned into a verdict line instead of an exception, and naming a mistake in one line.

A checker grades the method its exercise asks for, not only the values: which collectives and how
many (the ledger counts the calls a rank made), to which peer each send went, what was held when.
Where ranks make the same mistake it is said once, with the ranks it happened on."""
from __future__ import annotations

import re

import torch

from ...memory import reachable_tensors, tensor_bytes
from ...pool.cluster import Cluster, start
from ...pool.errors import RankError, RankTimeout
from ...runtime.backend import device

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}


class Verdict:
    """The result of a check: `ok`, and the lines that explain it (shown by print and in Jupyter)."""

    def __init__(self, title: str, problems: list[str], notes: list[str] = ()):
        self.title, self.problems, self.notes = title, _unique(problems), list(notes)

    @property
    def ok(self) -> bool:
        return not self.problems

    def __bool__(self):
        return self.ok

    def __str__(self):
        if self.ok:
            head = f"✓ {self.title}: correct"
        else:
            head = f"✗ {self.title}: {len(self.problems)} problem(s)"
        return "\n".join([head] + [f"  - {p}" for p in self.problems[:12]]
                         + ([f"  ... and {len(self.problems) - 12} more"] if len(self.problems) > 12 else [])
                         + [f"  {n}" for n in self.notes])

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))

    def __repr__(self):
        return str(self)


def _unique(lines) -> list[str]:
    return list(dict.fromkeys(lines))


def by_rank(found: dict[int, list[str]], world_size: int) -> list[str]:
    """Problem lines from each rank's, a mistake said once with the ranks it happened on: lines that
    differ only in their numbers (a rank's own chunk, its peers) are one mistake, shown as the first
    rank's ("on every rank, e.g. rank 0: ...")."""
    groups: dict[str, list] = {}
    for r in sorted(found):
        for line in found[r]:
            groups.setdefault(re.sub(r"-?\d+(\.\d+)?(e[+-]?\d+)?", "#", line), []).append((r, line))
    out = []
    for seen in groups.values():
        rs, lines = sorted({r for r, _ in seen}), {line for _, line in seen}
        alike = len(lines) > 1
        if len(rs) == world_size and world_size > 1:
            where = "on every rank" + (f", e.g. rank {rs[0]}" if alike else "")
        elif len(rs) == 1:
            where = f"on rank {rs[0]}"
        else:
            where = f"on ranks {', '.join(map(str, rs))}" + (f", e.g. rank {rs[0]}" if alike else "")
        out.append(f"{where}: {seen[0][1]}")
    return out


def _pool(world_size):
    return start(world_size, verbose=False)


def each_pool(world_size: int, also: int | None):
    """The pools to check on, each opened only when the one before it is done with."""
    sizes = [world_size] + ([also] if also and also != world_size else [])
    for n in sizes:
        if n == world_size:
            yield _pool(n)
        else:
            with Cluster(world_size=n, verbose=False) as other:
                yield other


DEADLOCK_HINT = "does every rank post its receive while the others send (batch_isend_irecv)?"


def _run(pool, fn, *args, timeout=10, hint=DEADLOCK_HINT):
    """Run on the ranks; turn a crash or a hang into a verdict line instead of an exception. The
    collectives' exercises move a few KiB, done in milliseconds even on a busy machine: 10 s without
    an answer is a deadlock (the engines' exercises, which train, allow longer). `hint`: what to ask
    the learner about a deadlock."""
    try:
        return pool.run(fn, *args, timeout=timeout, echo=False), None
    except RankTimeout as e:
        where: dict[str, list[int]] = {}
        for r, stack in sorted(e.stacks.items()):
            frames = re.findall(r", in (\w+)", stack)
            where.setdefault(frames[-1] if frames else "?", []).append(r)
        blocked = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} in {frame}()"
                            for frame, rs in where.items())
        return None, f"your function did not finish within {timeout:g} s, a deadlock ({blocked}): {hint}"
    except RankError as e:
        r = e.failed[0]
        last = [ln for ln in e.tracebacks[r].strip().splitlines() if ln.strip()][-1]
        return None, f"rank {r} raised: {last}"


def close(got: torch.Tensor, want: torch.Tensor, dtype) -> bool:
    tol = TOLERANCE.get(dtype, 1e-12)
    return got.shape == want.shape and bool(
        ((got.double() - want.double()).abs() <= tol * max(1.0, want.abs().max().item() if want.numel() else 0)).all())


def what_is_wrong(name: str, got, want: torch.Tensor, dtype, chunks=None, known=()) -> str | None:
    """One line naming what is wrong with `got` (None when it matches `want`), in this order: not a
    tensor or the wrong shape; values no computation made (uninitialised memory); one of the `known`
    mistakes, (tensor it would give, what to say); every value the same multiple of the right one;
    else which chunks are wrong, with the first wrong element."""
    if not isinstance(got, torch.Tensor):
        return f"{name} is a {type(got).__name__}, expected a tensor of {want.numel()} elements"
    if got.shape != want.shape:
        return f"{name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    got, want = got.detach().cpu(), want.detach().cpu()
    if close(got, want, dtype):
        return None
    flat, right = got.reshape(-1).double(), want.reshape(-1).double()
    scale = max(1.0, right.abs().max().item())
    garbage = ~torch.isfinite(flat) | (flat.abs() > 1e6 * scale)
    if garbage.any():
        i = int(garbage.nonzero()[0])
        where = next((f"chunk {c}" for c, (a, b) in enumerate(chunks or []) if a <= i < b), f"element {i}")
        return (f"{name}: values like {flat[i].item():.2g} are uninitialised memory: {where} was never received "
                "or written")
    for tensor, message in known:
        if tensor is not None and close(got, tensor.cpu(), dtype):
            return f"{name}: {message}"
    k = float(flat @ right / (right @ right)) if right.abs().sum() > 0 else 0.0
    if abs(k - 1) > 1e-6 and close(got, want * k, dtype):
        return f"{name}: every value is {k:.4g} x the right one"
    if chunks:
        wrong = [c for c, (a, b) in enumerate(chunks) if not close(got.reshape(-1)[a:b], want.reshape(-1)[a:b], dtype)]
        a = chunks[wrong[0]][0]
        i = a + int(((flat[a:] - right[a:]).abs() > TOLERANCE.get(dtype, 1e-12) * scale).nonzero()[0])
        return (f"{name}: chunk{'s' if len(wrong) > 1 else ''} {', '.join(map(str, wrong))} of {len(chunks)} wrong "
                f"(element {i} is {flat[i].item():.6g}, expected {right[i].item():.6g})")
    bad = (flat - right).abs() > TOLERANCE.get(dtype, 1e-12) * scale
    i = int(bad.nonzero()[0])
    return (f"{name}: {int(bad.sum())} of {flat.numel()} elements wrong (element {i} is {flat[i].item():.6g}, "
            f"expected {right[i].item():.6g})")


def collectives_made(calls: dict, allowed: dict, what: str) -> str | None:
    """One line if the calls a rank made (the ledger's `calls`: op -> count) are not `allowed`
    (op -> the count the method makes); `what` names the method."""
    extra = sorted(op for op in calls if op not in allowed)
    if extra:
        return f"you called {', '.join(extra)}: {what}"
    missing = sorted(op for op in allowed if calls.get(op, 0) != allowed[op])
    if missing:
        return "; ".join(f"{calls.get(op, 0)} {op} call(s) where the method makes {allowed[op]}" for op in missing) + \
            f": {what}"
    return None


def _compare(name, rank, got, want, dtype, chunks=None):
    """Problems comparing one rank's result with the expected tensor (one line at most)."""
    line = what_is_wrong(name, got, want, dtype, chunks)
    return [] if line is None else [f"rank {rank}: {line}"]


def _inputs(rank, numel, dtype):
    """Inside a rank: rank `rank`'s test tensor, on this rank's device (the same values on any)."""
    g = torch.Generator().manual_seed(7919 * (rank + 1) + numel)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(device=device(), dtype=dtype)


def registered_hooks(modules) -> list:
    """Every hook function registered on `modules` and on their own parameters (module hooks, tensor
    hooks, post-accumulate-grad hooks): take them before and after the learner's code runs, and the
    new ones are the learner's."""
    hooks = []
    for m in modules:
        for d in (m._forward_pre_hooks, m._forward_hooks, m._backward_pre_hooks, m._backward_hooks):
            hooks += list(d.values())
        for p in m.parameters(recurse=False):
            for d in (getattr(p, "_post_accumulate_grad_hooks", None), p._backward_hooks):
                hooks += list((d or {}).values())
    return hooks


def kept_alive(roots, allowed=()) -> int:
    """Inside a rank: bytes of the tensors reachable from `roots` (the learner's hooks and the function
    it returned: what their closures hold) beyond the storages of `allowed` (the parameters, their
    gradients, the buffers the exercise handed it): a list of flattened gradients, a cache of gathered
    parameters, which no check of `.grad` or of a buffer sees. Swept from outside
    (zeronb.memory.reachable_tensors)."""
    ok = {t.untyped_storage().data_ptr() for t in allowed if t is not None}
    return tensor_bytes([t for t in reachable_tensors(*roots) if t.untyped_storage().data_ptr() not in ok])
