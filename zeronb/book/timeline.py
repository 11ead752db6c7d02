"""A traced ZeRO-3/FSDP step as a Gantt chart - a row per unit, a bar per event - and what its
intervals say: how long the communication lasted, and how much of it the rank did not wait for.

    spans = report.ranks[0].timeline                   # RunConfig(trace=True): (what, unit, start, end)
    fig, ax = plt.subplots()
    unit_timeline(ax, spans, ["0: embeddings", "1: block", "2: block", "3: head"])
    unit_timeline_legend(fig)                          # the colours, beside the axes

The spans are zeronb.zero.observe.Timeline.spans(): "all-gather (forward)" / "(backward)",
"forward", "backward" and "reduce-scatter" of a unit, and a "wait" where the stage waited for an
all-gather that had not completed, in seconds on the rank's clock. The bars are drawn in ms since
`origin` (`relative_spans` counts them from the step's first
all-gather instead). With `lanes=True` each unit's row has two lanes, communication above
computation, so that a gather issued while the unit computes shows beside its compute bar rather
than on top of it.
"""
from __future__ import annotations

from matplotlib.patches import Patch

COLOURS = {"all-gather (forward)": "#6baed6", "forward": "#31a354", "all-gather (backward)": "#fd8d3c",
           "backward": "#a63603", "reduce-scatter": "#756bb1"}   # one colour per kind of event
COMPUTE = ("forward", "backward")


def unit_timeline(ax, spans, units, *, origin: float = 0.0, colours: dict | None = None, lanes: bool = False,
                  title: str | None = None, xlabel: str = "time since the step began (ms)",
                  ylabel: str | None = "unit") -> list:
    """Draw `spans` [(what, unit, start, end)] on `ax`: unit u's events on row u (`units`: the row
    labels, unit 0 at the top), each a bar from start to end, in ms since `origin` (seconds, the
    spans' clock), coloured by `what` (`colours`, default COLOURS; a kind with no colour, such as a
    "wait", is not drawn). `lanes`: computation in the lower half of each row, communication in the
    upper half. Returns the bars, in the spans' order."""
    colours = COLOURS if colours is None else colours
    bars = []
    for what, unit, start, end in spans:
        if what not in colours:
            continue
        y, height = unit, 0.6
        if lanes:  # y grows downwards: communication on top
            y, height = unit + (0.2 if what in COMPUTE else -0.2), 0.35
        bars.extend(ax.barh(y, (end - start) * 1e3, left=(start - origin) * 1e3, height=height,
                            color=colours[what], edgecolor="white", linewidth=0.5))
    ax.set_yticks(range(len(units)), units)
    ax.set_ylim(len(units) - 0.5, -0.5)  # unit 0 on top
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10)
    return bars


def unit_timeline_legend(target, colours: dict | None = None, **kwargs):
    """The colours of unit_timeline's kinds of event as a legend on `target` (a figure or axes),
    beside it on the right unless `kwargs` say otherwise."""
    colours = COLOURS if colours is None else colours
    options = {"loc": "center left", "bbox_to_anchor": (1.0, 0.5), "fontsize": 8, **kwargs}
    return target.legend(handles=[Patch(color=c, label=w) for w, c in colours.items()], **options)


# --- what a timeline says: how long, and how much of the communication the rank did not wait for ------

def relative_spans(spans, origin: float | None = None) -> list:
    """A Timeline's spans [(what, key, start, end)] with their times counted from `origin` (seconds,
    the spans' clock; by default the earliest start, e.g. a ZeRO-3 step's first all-gather)."""
    if origin is None:
        origin = min((start for _, _, start, _ in spans), default=0.0)
    return [(what, k, start - origin, end - origin) for what, k, start, end in spans]


def covered(intervals) -> float:
    """How long the union of (start, end) intervals lasts (time covered at least once)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def overlap(a, b) -> float:
    """How long some interval of `a` and some interval of `b` run at the same time."""
    return covered(a) + covered(b) - covered(list(a) + list(b))


def spans_of(spans, *kinds) -> list:
    """The (start, end) of those of a Timeline's spans whose name starts with one of `kinds` (all:
    none given)."""
    return [(s, e) for what, _, s, e in spans if not kinds or what.startswith(kinds)]


def waited_for(spans) -> list:
    """The all-gathers of a Timeline's spans that the stage had to wait for: those with a "wait" span
    of their unit that ends when they do (the completion query said "not yet" at every event
    before the stage's wait). [(what, key, start, end)]."""
    waits = {(k, end) for what, k, _, end in spans if what == "wait"}
    return [s for s in spans if s[0].startswith("all-gather") and (s[1], s[3]) in waits]


def hidden_share(spans) -> float:
    """The share of all-gather time (each from its issue to its completion) that the rank did not
    spend waiting for it: the time of the all-gathers that had completed, by a completion query, at
    an event before the stage waited for them, over the time of all of them. A gather the stage had
    to wait for counts as not hidden at all, however long it was in flight before: being in flight
    is not moving bytes (a backend that moved nothing until the wait would show gathers in flight
    all along). What the rank did meanwhile - the previous unit's computation, its reduce-scatter,
    the observers' bookkeeping - the spans do not tell apart."""
    gathers = [s for s in spans if s[0].startswith("all-gather")]
    if not gathers:
        raise ValueError("these spans hold no all-gather: hidden_share is for ZeRO-3/FSDP runs traced with trace=True")
    waited = set(waited_for(spans))
    return covered([(g[2], g[3]) for g in gathers if g not in waited]) / covered([(g[2], g[3]) for g in gathers])
