"""Watching a stage from outside: timelines, memory and gradients, recorded by observers.

Each observer is called as `observer(stage, event, where)` at the points below, and nothing else
is done for them: without observers nothing is timed, walked or recorded, and with them the
algorithm runs exactly as it would without. The stages' own hooks tell nobody: the step's outline
does (Stage.train_step, and FlatStage.update for the optimizer step), the buckets and units tell
what changes in their state (Bucket.changed), and the observers' own module hooks tell a unit's
forward and backward (FlatStage.watch_units, registered whether or not there are observers yet,
since they can be given to a stage at any time; without them a hook does nothing). An observer is any callable; the classes
here are the ones the chapters and the train CLI use.

Every stage (zeronb.zero.stage.Stage.train_step):
    "forward pass", i          micro-batch i's forward is about to run
    "backward pass", i         its loss is computed; backward is about to run
    "backward pass done", i    its backward is done (the hooks below have fired)
    "optimizer step", grads    the averaged gradients, one tensor per shard the optimizer updates
    "step done", None
    "step failed", None        the step raised: an observer holding something open lets it go

Inside backward and the step, as a bucket or unit changes (`where` a parameter, a bucket or a unit):
    "gradient ready", p                   DDP, ZeRO-2, ZeRO-3: p's gradient has landed
    "all-reduce", bucket                  DDP: issued; `bucket.work` is in flight
    "all-reduce done", bucket             DDP: waited for
    "reduce-scatter", bucket/unit         begins (`bucket.comm` holds the full gradients)
    "reduce-scatter done", bucket/unit
    "all-gather", unit                    ZeRO-3: issued; `unit.work` is in flight
    "gathered", unit/bucket               waited for: the full parameters are here
    "forward", unit / "forward done", unit        ZeRO-3: the unit's forward (observers' module hooks)
    "backward", unit                      ZeRO-3: the unit's backward begins (an observers' module hook)
    "backward done", unit                 ZeRO-3: the unit's last gradient has landed
    "freed", unit                         ZeRO-3: the full parameters are dropped
"""
from __future__ import annotations

import contextlib
import time

import torch

from .. import memory
from ..ledger import CommLedger
from .buckets import Bucket
from .zero3 import Unit


def key(stage, where):
    """A plain name for what an event is about: a unit's index, a bucket's or a parameter's name,
    a micro-batch's index."""
    if isinstance(where, torch.Tensor):
        return stage.names.get(where, "?")
    if isinstance(where, Unit):
        return where.index
    if isinstance(where, Bucket):
        return where.name
    return where if isinstance(where, (int, str)) else None  # (the optimizer's gradients: not kept)


class Timeline:
    """When each event happened on this rank, and when each collective in flight completed.

    On the CPU a stamp is time.perf_counter() at the call. On a GPU a stamp is a CUDA event recorded
    on the current stream: it marks when the GPU reaches that point of the queued work, not when
    Python got there. Nothing is synchronised during the step: the stamps are read afterwards.

    When a collective completed is asked of the collective itself, never read from the order of the
    code. An all-gather is *issued* at its "all-gather" event, and may move its bytes any time until
    the stage waits for it ("gathered"). At every event in between, on the CPU, the timeline asks
    it whether it has completed (`work.is_completed()`, a query that waits for nothing), so that a
    gather that completes while the rank does something else is seen complete at the first event
    after it did: its span ends there. One that had not completed when the stage came to wait for
    it - the stage *waited* - ends when the wait returned, and gets a "wait" span besides, from the
    last event before the wait to its return: time the rank spent waiting for it. (A backend that
    moved no byte until the wait would show every gather waited for.) On a GPU the completion is a
    CUDA event recorded on a stream of the timeline's own that waits for the collective (so the
    stage's streams never wait for the timeline), and the stage waited if that event comes after
    the last event before the wait on the compute stream. A DDP all-reduce's end is a callback on
    its future (or the stage's wait, if that came first).

    `records()`: [(event, key, seconds since the step began)], in the order of the calls.
    `spans()`: [(what, key, start, end)] - "forward" / "backward" of a unit, "all-gather (forward)"
    or "(backward)" from its issue to its completion, "wait" for an all-gather (above),
    "reduce-scatter", "all-reduce" of a bucket."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._side = torch.cuda.Stream(self.device) if self.cuda else None
        self.reset()

    def reset(self) -> None:
        self._marks, self._ends, self._futures, self._phase = [], [], [], "forward"
        self._gathers, self._in_flight = [], []  # every all-gather of the step; those not yet complete

    def _stamp(self, stream=None):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def __call__(self, stage, event, where):
        if event == "forward pass" and where == 0:
            self.reset()  # a new step: the timeline describes the latest step
        if event in ("forward pass", "backward pass"):
            self._phase = event.split()[0]
        k = key(stage, where)
        name = f"{event} ({self._phase})" if event == "all-gather" else event
        self._marks.append((name, k, self._stamp()))
        i = len(self._marks) - 1
        if not self.cuda:  # every gather in flight: has it completed by now?
            for g in [g for g in self._in_flight if _completed(g["work"])]:
                g["complete"] = i
                self._in_flight.remove(g)
        if event == "all-gather" and where.work is not None:  # (a Unit in flight)
            gather = {"name": name, "key": k, "issued": i, "complete": None, "gathered": None,
                      "work": where.work, "end": None}
            self._gathers.append(gather)
            self._in_flight.append(gather)
            if self.cuda:
                self._when_done(gather, where.work)
        elif event == "gathered":
            gather = next((g for g in self._gathers if g["key"] == k and g["gathered"] is None), None)
            if gather is not None:
                gather["gathered"] = i
                gather["work"] = None  # (the step's works are not kept past it)
                if gather in self._in_flight:  # never seen complete before the wait: complete now
                    gather["complete"] = i
                    self._in_flight.remove(gather)
        elif event == "all-reduce" and where.work is not None:  # (a Bucket in flight: DDP)
            self._when_reduced(name, k, where.work)

    def _when_done(self, gather, work):
        """On a GPU: an event on the timeline's own stream, once that stream has waited for `work`."""
        with torch.cuda.stream(self._side):
            work.wait()  # this stream waits for the collective; the CPU does not
            gather["end"] = self._stamp(self._side)

    def _when_reduced(self, name, k, work):
        if self.cuda:
            with torch.cuda.stream(self._side):
                work.wait()
                self._ends.append((name, k, self._stamp(self._side)))
            return
        try:
            future = work.get_future()
        except RuntimeError:  # a backend without futures: the end is when the stage waited
            return
        ends = self._ends  # this step's list, even if the callback runs after a reset
        self._futures.append(future.then(lambda _: ends.append((name, k, time.perf_counter()))))

    @property
    def origin(self) -> float | None:
        """The clock's reading at the step's first mark, which the times count from: on the CPU
        time.perf_counter(), one clock for every process of a machine; None on a GPU."""
        return self._marks[0][2] if self._marks and not self.cuda else None

    def _seconds(self, stamps):
        """Stamps (perf_counter readings or CUDA events) as seconds since the first mark of the step."""
        if not self._marks:
            return []
        t0 = self._marks[0][2]
        if self.cuda:
            t0.synchronize()
            for e in stamps:
                e.synchronize()
            return [t0.elapsed_time(e) / 1e3 for e in stamps]
        return [t - t0 for t in stamps]

    def records(self) -> list:
        times = self._seconds([t for *_, t in self._marks])
        return [(w, k, t) for (w, k, _), t in zip(self._marks, times)]

    def _gather_spans(self, marks) -> list:
        """Each all-gather from its issue to its completion, and a "wait" where the stage waited for it."""
        out = []
        for g in self._gathers:
            if g["gathered"] is None:  # (never waited for within the step: not drawn)
                continue
            issued, gathered = marks[g["issued"]][2], marks[g["gathered"]][2]
            before_wait = marks[g["gathered"] - 1][2]  # the last event before the stage's wait
            if self.cuda:
                end = self._seconds([g["end"]])[0]
                waited = end > before_wait
            else:
                end = marks[g["complete"]][2]
                waited = g["complete"] == g["gathered"]
            out.append((g["name"], g["key"], issued, min(end, gathered)))
            if waited:
                out.append(("wait", g["key"], before_wait, min(end, gathered) if self.cuda else gathered))
        return out

    def spans(self) -> list:
        torch.futures.wait_all(self._futures)  # every end callback has run
        marks = self.records()
        begun, out = {}, []
        for what, k, t in marks:
            if what in ("forward", "backward", "reduce-scatter"):
                begun[what, k] = t
            elif what.endswith(" done") and (what[:-5], k) in begun:
                out.append((what[:-5], k, begun.pop((what[:-5], k)), t))
        out += self._gather_spans(marks)
        # an all-reduce runs from its issue to its completion; it was complete, at the latest, when the
        # stage's wait for it returned (a completion callback may run a little after the waiter wakes)
        issued, waited = {}, {}  # (collective, key) -> times, oldest first
        for what, k, t in marks:
            if what == "all-reduce":
                issued.setdefault((what, k), []).append(t)
                waited.setdefault((what, k), []).append(None)
            elif what == "all-reduce done":
                for (w, key_), times in waited.items():
                    if key_ == k and None in times:
                        times[times.index(None)] = t
                        break
        completed = {}
        ends = self._ends
        for (what, k, t), s in zip(ends, self._seconds([t for *_, t in ends])):
            completed.setdefault((what, k), []).append(s)
        for (what, k), starts in issued.items():
            done = completed.get((what, k), [])
            for i, start in enumerate(starts):
                ends_i = [t for t in (done[i] if i < len(done) else None, waited[what, k][i]) if t is not None]
                if ends_i:
                    out.append((what, k, start, min(ends_i)))
        return sorted(out, key=lambda s: (s[2], s[3]))


def _completed(work) -> bool:
    """Whether a collective's work has completed, asked without waiting. (Under a dispatch mode, such
    as a CommLedger, a collective returns its work boxed: unboxed here.)"""
    if not hasattr(work, "is_completed"):
        work = torch._C._distributed_c10d.Work.unbox(work)
    return work.is_completed()


class MemoryTrace:
    """What the stage holds - bytes of parameters, gradients and optimizer state, each storage
    counted once (zeronb.memory.measure) - at each event: [(event, key, {"params", "grads",
    "optimizer"})]. The storage of the tensors the stage holds, not the allocator's view."""

    def __init__(self, events=None):
        self.events = None if events is None else set(events)
        self.notes = []

    def __call__(self, stage, event, where):
        if event == "forward pass" and where == 0:
            self.notes = []
        if self.events is None or event in self.events:
            self.notes.append((event, key(stage, where), memory.measure(**stage.state_tensors())))

    def peak(self, part: str) -> int:
        return max(held[part] for _, _, held in self.notes)


class StepMemory:
    """What the train CLI reports of a step's memory: the activations autograd saved in the last
    micro-batch's forward (zeronb.memory.saved_activations, parameters left out), and the gradient
    bytes the stage held after each micro-batch's backward (what accumulation costs)."""

    def __init__(self):
        self.activation_bytes, self.grad_bytes_after_micro_batch = None, []
        self._counting = contextlib.ExitStack()

    def __call__(self, stage, event, where):
        if event == "forward pass":
            if where == 0:
                self.grad_bytes_after_micro_batch = []
            self._saved = self._counting.enter_context(memory.saved_activations(exclude=stage.model.parameters))
        elif event == "backward pass":
            self._counting.close()  # forward only: what backward will need
            self.activation_bytes = self._saved["bytes"]
        elif event == "backward pass done":
            self.grad_bytes_after_micro_batch.append(memory.tensor_bytes(stage.state_tensors()["grads"]))
        elif event == "step failed":
            self._counting.close()


class PhaseTraffic:
    """The bytes each phase of the step sent: forward, backward (to the end of the last
    micro-batch's backward, the stage's own end-of-backward communication included) and the
    optimizer step. `phases`: {phase: {"sent": {op: bytes}, "calls": {op: count}, "elements": {op: count},
    "wire": bytes or None}} - a zeronb.ledger.CommLedger per phase, counting on the wire too with `wire`
    ("elements": of the tensors the calls were handed, full size: what a credit alone cannot tell apart)."""

    def __init__(self, wire: bool = False):
        self.wire, self.phases = wire, {}
        self._open = contextlib.ExitStack()

    def _begin(self, phase):
        self._open.close()
        self._ledger = self._open.enter_context(CommLedger(wire=self.wire))
        self._phase = phase

    def _end(self):
        self._open.close()
        entry = self.phases.setdefault(self._phase, {"sent": {}, "calls": {}, "elements": {},
                                                      "wire": 0 if self.wire else None})
        for op, nbytes in self._ledger.by_op.items():
            entry["sent"][op] = entry["sent"].get(op, 0) + nbytes
            entry["calls"][op] = entry["calls"].get(op, 0) + self._ledger.calls[op]
            entry["elements"][op] = entry["elements"].get(op, 0) + self._ledger.elements[op]
        if self.wire:
            entry["wire"] += self._ledger.wire_bytes

    def __call__(self, stage, event, where):
        if event == "forward pass":
            if where == 0:
                self.phases = {}
            self._begin("forward")
        elif event == "backward pass":
            self._end()
            self._begin("backward")
        elif event == "backward pass done":
            self._end()
            if stage.last_micro_batch:
                self._begin("step")
        elif event == "step done":
            self._end()
        elif event == "step failed":
            self._open.close()


class Gradients:
    """The averaged gradients the optimizer stepped with, as pieces of the parameters:
    {name: (start, stop, values)} (Stage.shard_pieces), for comparing with one process."""

    def __init__(self):
        self.pieces = None

    def __call__(self, stage, event, where):
        if event == "optimizer step":
            self.pieces = {n: (a, b, v.detach().clone()) for n, (a, b, v) in stage.shard_pieces(where).items()}
