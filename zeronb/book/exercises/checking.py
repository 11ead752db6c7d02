"""What every checker shares: the verdict it returns, and running the learner's code on the ranks
with a crash or a hang turned into a verdict line instead of an exception."""
from __future__ import annotations

import torch

from ...pool.cluster import start
from ...pool.errors import RankError, RankTimeout
from ...runtime.backend import device

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}


class Verdict:
    """The result of a check: `ok`, and the lines that explain it (shown by print and in Jupyter)."""

    def __init__(self, title: str, problems: list[str], notes: list[str] = ()):
        self.title, self.problems, self.notes = title, problems, list(notes)

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


def _pool(world_size):
    return start(world_size, verbose=False)


def _run(pool, fn, *args, timeout=10):
    """Run on the ranks; turn a crash or a hang into a verdict line instead of an exception. The
    collectives' exercises move a few KiB, done in milliseconds even on a busy machine: 10 s without
    an answer is a deadlock (the engines' exercises, which train, allow longer)."""
    try:
        return pool.run(fn, *args, timeout=timeout, echo=False), None
    except RankTimeout as e:
        where = "; ".join(f"rank {r} was in: {s.strip().splitlines()[-2].strip() if s.strip() else '?'}"
                          for r, s in sorted(e.stacks.items()))
        return None, (f"your function did not finish within {timeout:g} s - a deadlock? ({where}). "
                      "Does every rank post its receive while the others send (batch_isend_irecv)?")
    except RankError as e:
        r = e.failed[0]
        last = [ln for ln in e.tracebacks[r].strip().splitlines() if ln.strip()][-1]
        return None, f"rank {r} raised: {last}"


def _compare(name, rank, got, want, dtype, chunks=None):
    """Problems comparing one rank's result with the expected tensor, chunk by chunk if given."""
    if not isinstance(got, torch.Tensor):
        return [f"rank {rank}: {name} returned {type(got).__name__}, expected a tensor"]
    if got.shape != want.shape:
        return [f"rank {rank}: {name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"]
    tol = TOLERANCE.get(dtype, 0.0)
    bad = ((got.double() - want.double()).abs() > tol * max(1.0, want.abs().max().item())).reshape(-1)
    if not bad.any():
        return []
    out = []
    if chunks:
        for c, (a, b) in enumerate(chunks):
            if bad[a:b].any():
                i = a + int(bad[a:b].nonzero()[0])
                out.append(f"rank {rank}, chunk {c} (elements {a}..{b - 1}): element {i} is "
                           f"{got.reshape(-1)[i].item():.6g}, expected {want.reshape(-1)[i].item():.6g}")
    else:
        i = int(bad.nonzero()[0])
        out.append(f"rank {rank}: {int(bad.sum())} element(s) wrong; element {i} is "
                   f"{got.reshape(-1)[i].item():.6g}, expected {want.reshape(-1)[i].item():.6g}")
    return out


def _inputs(rank, numel, dtype):
    """Inside a rank: rank `rank`'s test tensor, on this rank's device (the same values on any)."""
    g = torch.Generator().manual_seed(7919 * (rank + 1) + numel)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(device=device(), dtype=dtype)
