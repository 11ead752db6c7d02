"""One rank's watched step laid on the machine's clock, so that a figure can put every rank on one
time axis: what the rank held at each event, and its timeline's intervals (chapter 14).

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
