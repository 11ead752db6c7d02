"""One rank's watched step, from a traced RankReport: laid on the machine's clock, so that a figure
can put every rank on one time axis (chapter 14), and the full parameters a ZeRO-3 rank holds
after each of its hooks (chapters 10 and 11).

Plumbing, not a lesson: a traced RankReport (zeronb.train.RankReport, run with trace=True) already
holds the events, the memory held at each and the timeline, each counted from the step's start;
this adds the clock reading the step began at (`timeline_origin`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WatchedStep:
    t0: float        # the clock reading when the step began (0 where the times count from the step: a GPU)
    shards: int      # bytes of parameters, gradients and optimizer state held between steps: the shards
    memory: list     # (time, bytes held) at each event the stage told its observers of
    events: list     # (what, unit, start, end): the timeline's collectives and computations

    @property
    def peak_bytes(self) -> int:
        return max(nbytes for _, nbytes in self.memory)


def watched_step(rank) -> WatchedStep:
    """A traced RankReport's last step on the machine's clock. The ranks of one machine share that
    clock, so their steps can be drawn on one axis; on a GPU each rank's times count from its own step."""
    if rank.events is None or rank.memory_trace is None or rank.timeline is None:
        raise ValueError("watched_step needs a traced run: RunConfig(..., trace=True)")
    if [k for _, k, _ in rank.events] != [k for _, k, _ in rank.memory_trace]:
        raise ValueError("the events and the memory trace do not name the same events in the same order")
    origin = rank.timeline_origin or 0.0
    return WatchedStep(t0=origin, shards=rank.held_bytes,
                       memory=[(origin + t, sum(held.values()))
                               for (_, _, t), (_, _, held) in zip(rank.events, rank.memory_trace)],
                       events=[(what, unit, origin + s, origin + e) for what, unit, s, e in rank.timeline])


# --- the parameters a ZeRO-3 rank holds after each of its hooks ---------------------------------------

def zero3_parameters(notes) -> list:
    """ZeRO-3's memory trace (MemoryTrace.notes) as the bytes of parameters held once each of its
    hooks has run: [(label, bytes)], labels "forward u" (gathered, about to compute), "after
    forward u", "backward u" and "after backward u" (reduce-scattered and freed)."""
    out, previous = [], None
    for event, unit, held in notes:
        if event in ("forward", "forward done", "backward"):
            out.append((f"{event.replace('forward done', 'after forward')} {unit}", held["params"]))
        elif event == "freed" and previous == "forward done":
            out[-1] = (f"after forward {unit}", held["params"])  # (the forward hook freed the unit)
        elif event == "freed":
            out.append((f"after backward {unit}", held["params"]))
        previous = event
    return out


def gathered(notes, shard: int) -> list:
    """The full parameters a ZeRO-3 rank has gathered after each hook: zero3_parameters(notes) less
    `shard`, the bytes of its own shards (what it holds between steps, RankReport.bytes["params"]):
    [(label, bytes)]."""
    return [(label, held - shard) for label, held in zero3_parameters(notes)]


def peak_gathered(notes, shard: int) -> int:
    """The most bytes of full parameters alive at once during the step: the peak of gathered()."""
    return max((nbytes for _, nbytes in gathered(notes, shard)), default=0)
