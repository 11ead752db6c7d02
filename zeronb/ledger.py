"""Counting the bytes a rank sends: per collective (logical), on the wire (the OS's count), and
the trace of each ring step.

    with CommLedger(wire=True) as ledger: # inside a rank
        dist.all_reduce(t)
        ring_all_reduce(u)
    ledger.bytes_sent, ledger.by_op       # logical: {"all_reduce": ..., "ring_all_reduce": ...}
    ledger.calls, ledger.elements         # per op: how many calls, how many elements they were handed
    ledger.sent_to, ledger.received_from  # point-to-point: bytes per peer (its rank in the op's group)
    ledger.payloads                       # with payloads=True: a copy of what each send carried
    ledger.wire_bytes                     # what this rank's gloo connections really sent (TCP_INFO)
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
  That is a *logical* count: credited by formula, not observed.
- The wire count is observed. `WireMeter` (or `CommLedger(wire=True)`) reads the kernel's own
  counter of bytes sent (TCP_INFO's tcpi_bytes_sent less retransmissions, Linux 4.19+) on each of this rank's gloo
  connections before and after, so it sees what gloo really did: its headers, and its
  reduce-scatter, which PyTorch's gloo process group runs as a full all-reduce (twice the logical
  bytes; ProcessGroupGloo::reduce_scatter in torch/csrc/distributed/c10d/ProcessGroupGloo.cpp).
  It counts gloo over TCP only: NCCL moves GPU data over NVLink, PCIe or InfiniBand, where the
  kernel counts nothing.
"""
from __future__ import annotations

import contextvars
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .runtime.compat import group_size_of
from .runtime.links import split_by_node
from .runtime.sockets import wire_counters
from .shards import chunk_size

_scope = contextvars.ContextVar("zeronb_ledger_scope", default=None)   # name of the op being built
_muted = contextvars.ContextVar("zeronb_ledger_muted", default=False)  # bookkeeping traffic
_active: list = []  # ledgers open in this process, innermost last


def _nbytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _numel(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel()
    return sum(_numel(t) for t in tensors)


def _first_tensor(tensors):
    return tensors if isinstance(tensors, torch.Tensor) else _first_tensor(tensors[0])


def _group_size(args) -> int:
    """The size of the process group a c10d operator runs in (it arrives boxed, as a ScriptObject)."""
    for a in args:
        if isinstance(a, torch.ScriptObject):
            size = group_size_of(a)
            if size is not None:
                return size
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


class WireMeter:
    """Bytes this rank sent to other ranks while the context was open, as the operating system
    counted them on its TCP connections (gloo's): payload and gloo's own message headers.

        with WireMeter() as wire:
            dist.all_reduce(t)
        wire.bytes, wire.by_connection, wire.by_node

    `by_node`, in a pool on several nodes (zeronb.runtime.links): {"within": bytes to ranks on this rank's node,
    "across": bytes to ranks on other nodes}; None otherwise.
    """

    def __enter__(self):
        self._before = wire_counters()
        self.bytes, self.by_connection, self.by_node = None, {}, None
        return self

    def __exit__(self, *exc):
        after = wire_counters()
        self.by_connection = {k: v - self._before.get(k, 0) for k, v in after.items()}
        self.bytes = sum(self.by_connection.values())
        self.by_node = split_by_node(self.by_connection)


class CommLedger(TorchDispatchMode):
    """Counts the bytes this rank sends while the context is open (see the module docstring):
    logically, per collective, always; on the wire too with `wire=True` (`wire_bytes`)."""

    def __init__(self, wire: bool = False, payloads: bool = False):
        super().__init__()
        self.payloads: list[dict] = [] if payloads else None  # {"dst", "values"} of each send, in order
        self.by_op: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.elements: dict[str, int] = defaultdict(int)  # handed to each call (a collective's full size)
        self.events: list[dict] = []
        self.sent_to: dict[int, int] = defaultdict(int)        # point-to-point bytes by peer, as the
        self.received_from: dict[int, int] = defaultdict(int)  # op names it (a rank of the op's group)
        self._wire = WireMeter() if wire else None

    @property
    def bytes_sent(self) -> int:
        """Logical bytes: what the algorithm sends (credited by formula for built-in collectives)."""
        return sum(self.by_op.values())

    @property
    def wire_bytes(self) -> int | None:
        """Bytes the OS counted on this rank's connections to other ranks (None without wire=True)."""
        return self._wire.bytes if self._wire is not None else None

    @property
    def wire_by_node(self) -> dict | None:
        """On several nodes: {"within", "across"} bytes of `wire_bytes` (None otherwise)."""
        return self._wire.by_node if self._wire is not None else None

    def __enter__(self):
        _active.append(self)
        if self._wire is not None:
            self._wire.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        _active.remove(self)
        if self._wire is not None:
            self._wire.__exit__(*exc)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, _, opname = func._schema.name.partition("::")
        if namespace == "c10d" and not _muted.get():
            self._count(opname, args)
        return func(*args, **kwargs)

    def _count(self, opname: str, args) -> None:
        scope = _scope.get()
        if opname in ("send", "recv_"):  # (tensors, group, peer, tag)
            peers = self.sent_to if opname == "send" else self.received_from
            peers[args[2]] += _nbytes(args[0])
            if opname == "send" and self.payloads is not None:  # what the send carries, as it is posted
                self.payloads.append({"dst": args[2], "values": [t.detach().cpu().clone() for t in args[0]]})
        if opname == "send":
            name, nbytes, numel = scope or "send", _nbytes(args[0]), _numel(args[0])
        elif opname in _COLLECTIVES:
            name, full = _COLLECTIVES[opname]
            t = full(args)
            elem = _first_tensor(t).element_size()
            nbytes, numel = ring_bytes(name, _nbytes(t), _group_size(args), elem), _numel(t)
            name = scope or name
        else:
            return  # receives, barriers, ...: this rank sends nothing (to count)
        self.by_op[name] += nbytes
        self.calls[name] += 1
        self.elements[name] += numel

    def record(self, **event) -> None:
        self.events.append(event)

    def summary(self) -> dict:
        """Plain data to send back to the notebook."""
        return {"bytes_sent": self.bytes_sent, "by_op": dict(self.by_op), "calls": dict(self.calls),
                "elements": dict(self.elements), "sent_to": dict(self.sent_to),
                "received_from": dict(self.received_from), "payloads": self.payloads,
                "wire_bytes": self.wire_bytes, "wire_by_node": self.wire_by_node, "events": list(self.events)}


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
    """Add an event to every open ledger."""
    for ledger in _active:
        ledger.record(**event)


class TracedLink:
    """A ring's link (zeronb.collectives.ring.Link), watched from outside: each step of the ring is
    recorded as a send and a receive event in every open ledger - who sent which chunk to whom, how
    many bytes, from the step's first send to the arrival of its last segment, and whether the step
    before was still arriving when this one began, asked of the receives themselves
    (`is_completed`), not read from the order of the code (chapter 4's pictures)."""

    def __init__(self, link, op: str, me: int):
        self.link, self.op, self.me = link, op, me
        self.segments = link.segments
        self.started, self.steps_in_phase, self.overlapped = {}, {}, {}

    def post(self, k, send_step=None, recv_step=None) -> None:
        i = send_step
        if i is not None and i not in self.started:  # step i's first segment is about to go out
            step = self.link.steps[i]
            previous = [w for (j, _), w in self.link.recvs.items() if j == i - 1]  # not yet waited for
            self.started[i] = now(step.send.device)
            self.overlapped[i] = None if i == 0 else any(not w.is_completed() for w in previous)
        self.link.post(k, send_step=send_step, recv_step=recv_step)

    def received(self, i, k) -> None:
        self.link.received(i, k)
        if k == len(self.segments) - 1:  # the step's last segment has arrived
            step = self.link.steps[i]
            in_phase = self.steps_in_phase.get(step.phase, 0)  # steps count from 0 in each phase
            self.steps_in_phase[step.phase] = in_phase + 1
            common = dict(op=self.op, phase=step.phase, step=in_phase, bytes=step.recv.numel() * step.recv.element_size(),
                          start=self.started[i], end=now(step.recv.device), previous_still_arriving=self.overlapped[i])
            record(kind="send", src=self.me, dst=self.link.nxt, chunk=step.send_chunk, **common)
            record(kind="recv", src=self.link.prv, dst=self.me, chunk=step.recv_chunk, **common)

    def sent(self, i, k) -> None:
        self.link.sent(i, k)

    def all_sent(self) -> None:
        self.link.all_sent()


def traced_link(link, op: str, me: int):
    """The ring's link, traced when a ledger is open; else the link itself (tracing then costs
    nothing). `me`: this rank's global rank."""
    return TracedLink(link, op, me) if recording() else link


def now(device=None) -> float:
    """Seconds on this rank's clock, for a trace. For work on a GPU pass its device: the clock is
    read once the work queued on it so far has finished (CUDA calls return before the data moves),
    so that a trace shows when the work ran, not when it was launched."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
