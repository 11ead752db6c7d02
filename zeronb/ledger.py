"""Counting the bytes a rank sends, per collective, and the trace of each ring step.

    with CommLedger() as ledger:          # inside a rank
        dist.all_reduce(t)
        ring_all_reduce(u)
    ledger.bytes_sent, ledger.by_op       # {"all_reduce": ..., "ring_all_reduce": ...}
    ledger.events                         # one event per ring step (send and receive sides)

How it counts. A CommLedger is a TorchDispatchMode: every torch.distributed call reaches the
dispatcher as a c10d operator (c10d.allreduce_, c10d._allgather_base_, c10d.send, ...), however the
caller imported it, and the ledger sees it there.
- Point-to-point sends (c10d.send) count the bytes really sent. The ring collectives of
  zeronb.collectives are made of these, so they count what they really move.
- A built-in collective is one call into a library (gloo, NCCL) that chooses its own algorithm;
  the ledger counts what a ring needs to send for it, with the factors nccl-tests uses for bus
  bandwidth: all-reduce 2(N-1)/N*S, reduce-scatter and all-gather (N-1)/N*S (S the full tensor),
  broadcast and reduce S. With equal chunks that is 2(N-1)*chunk and (N-1)*chunk bytes, chunk =
  ceil(S/N), the shard rule of zeronb.shards: exact when N divides the size.
  (gloo's own reduce-scatter happens to run as a full all-reduce - twice the bytes - which is why
  the ledger counts the logical volume and not the wire.)
"""
from __future__ import annotations

import contextvars
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .shards import chunk_size

_scope = contextvars.ContextVar("zeronb_ledger_scope", default=None)   # name of the op being built
_muted = contextvars.ContextVar("zeronb_ledger_muted", default=False)  # bookkeeping traffic
_active: list = []  # ledgers open in this process, innermost last


def _nbytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _first_tensor(tensors):
    return tensors if isinstance(tensors, torch.Tensor) else _first_tensor(tensors[0])


def _group_size(args) -> int:
    for a in args:
        if not isinstance(a, (torch.Tensor, list, tuple)) and hasattr(a, "size") and callable(a.size):
            try:
                return int(a.size())
            except Exception:
                pass
    return dist.get_world_size()


def ring_bytes(op: str, nbytes: int, world_size: int, element_size: int = 1) -> int:
    """Bytes one rank sends for collective `op` on a tensor of `nbytes` (the full size), by a ring
    with equal chunks. The one place for these factors: the ledger, the benchmarks and the book's
    formulas all call it."""
    n = world_size
    numel = nbytes // element_size
    chunk = chunk_size(numel, n) * element_size
    if op == "all_reduce":
        return 2 * (n - 1) * chunk
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) * chunk
    if op in ("broadcast", "reduce"):
        return nbytes if n > 1 else 0
    raise ValueError(f"no ring volume defined for {op!r}")


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw, as nccl-tests defines it: 2(N-1)/N for all-reduce, (N-1)/N for reduce-scatter
    and all-gather, 1 for broadcast and reduce."""
    n = world_size
    return {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n,
            "broadcast": 1.0, "reduce": 1.0}[op]


# c10d operator -> (name in by_op, how to find the full tensor size S from its arguments)
_COLLECTIVES = {
    "allreduce_": ("all_reduce", lambda a: a[0]),
    "allreduce_coalesced_": ("all_reduce", lambda a: a[0]),
    "_allgather_base_": ("all_gather", lambda a: a[0]),             # (output, input, ...)
    "allgather_": ("all_gather", lambda a: a[0]),                   # (list of list of outputs, inputs, ...)
    "allgather_into_tensor_coalesced_": ("all_gather", lambda a: a[0]),
    "_reduce_scatter_base_": ("reduce_scatter", lambda a: a[1]),    # (output, input, ...)
    "reduce_scatter_": ("reduce_scatter", lambda a: a[1]),          # (outputs, list of list of inputs, ...)
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", lambda a: a[1]),
    "broadcast_": ("broadcast", lambda a: a[0]),
    "reduce_": ("reduce", lambda a: a[0]),
}


class CommLedger(TorchDispatchMode):
    """Counts the bytes this rank sends while the context is open (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.by_op: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.events: list[dict] = []

    @property
    def bytes_sent(self) -> int:
        return sum(self.by_op.values())

    def __enter__(self):
        _active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _active.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, _, opname = func._schema.name.partition("::")
        if namespace == "c10d" and not _muted.get():
            self._count(opname, args)
        return func(*args, **kwargs)

    def _count(self, opname: str, args) -> None:
        scope = _scope.get()
        if opname == "send":
            name, nbytes = scope or "send", _nbytes(args[0])
        elif opname in _COLLECTIVES:
            name, full = _COLLECTIVES[opname]
            t = full(args)
            elem = _first_tensor(t).element_size()
            nbytes = ring_bytes(name, _nbytes(t), _group_size(args), elem)
            name = scope or name
        else:
            return  # receives, barriers, ...: this rank sends nothing (to count)
        self.by_op[name] += nbytes
        self.calls[name] += 1

    def record(self, **event) -> None:
        self.events.append(event)

    def summary(self) -> dict:
        """Plain data to send back to the notebook."""
        return {"bytes_sent": self.bytes_sent, "by_op": dict(self.by_op), "calls": dict(self.calls),
                "events": list(self.events)}


class scope:
    """`with scope("ring_all_reduce"):` - the sends inside are counted under that name."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self._token = _scope.set(self.name)

    def __exit__(self, *exc):
        _scope.reset(self._token)


class muted:
    """`with muted():` - traffic that is bookkeeping, not the algorithm (e.g. checking sizes)."""

    def __enter__(self):
        self._token = _muted.set(True)

    def __exit__(self, *exc):
        _muted.reset(self._token)


def recording() -> bool:
    """Whether any ledger is open (so that tracing costs nothing otherwise)."""
    return bool(_active)


def record(**event) -> None:
    """Add an event to every open ledger (the ring collectives call this once per step)."""
    for ledger in _active:
        ledger.record(**event)


def now(device=None) -> float:
    """Seconds on this rank's clock, for a trace. For work on a GPU pass its device: the clock is
    read once the work queued on it so far has finished (CUDA calls return before the data moves),
    so that a trace shows when the work ran, not when it was launched."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
