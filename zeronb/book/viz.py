"""Figures of a ring collective, drawn from the trace that the ranks recorded while running it.

    def fn():                                     # on every rank
        with zeronb.ledger.CommLedger() as L:
            ring_all_reduce(x)
        return L.summary()

    summaries = zeronb.run(fn)                    # one summary per rank
    snaps = ring_state(summaries, world_size=4)   # what each rank holds after each step (plain data)
    ring_figures(summaries)                       # every step, side by side
    ring_animation(summaries)                     # the same steps as an animation (HTML)
    timeline(summaries)                           # when each step was in flight (send to receive), per rank

Nothing here knows the ring algorithm. `ring_state` replays the trace: it starts every rank with
its own data and applies the transfers that the ranks *say* they made (each trace event names the
sender, the receiver and the chunk), so the pictures show what the run did, and a wrong index in
zeronb.collectives would show up as a wrong picture (and fail tests/test_viz.py).

The model, per rank and per chunk, is the set of ranks whose contribution that rank's copy of the
chunk contains:
- reduce-scatter: every rank starts with {itself} in every chunk. When rank d receives chunk c from
  rank s at a step, d's chunk c becomes d's set | s's set *as they were before the step* (all the
  sends of a step happen at once). A chunk is complete when its set holds all N ranks.
- all-gather: a received chunk replaces the receiver's copy (s's set, no addition). Inside a ring
  all-reduce it continues from the reduce-scatter's result; a stand-alone all-gather starts with
  each rank's own shard complete (it is the final value of that chunk) and the other chunks empty.
"""
from __future__ import annotations

import textwrap
from collections import defaultdict

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle
from matplotlib.path import Path

PHASES = ("reduce-scatter", "all-gather")
PHASE_COLORS = {"reduce-scatter": "#d62728", "all-gather": "#6a3d9a"}  # arrows and timeline bars
COMPLETE_COLOR = "#31a354"   # a chunk that holds the contribution of every rank
EMPTY_EDGE = "#9e9e9e"
OP_NAMES = {"ring_all_reduce": "ring all-reduce", "ring_reduce_scatter": "ring reduce-scatter",
            "ring_all_gather": "ring all-gather"}


# --- the trace ------------------------------------------------------------------------------------

def trace_events(summaries) -> list[dict]:
    """One flat list of the ring events of every rank, from `zeronb.run`'s list of ledger summaries
    (or a list of per-rank event lists, or an already flat list of events)."""
    out = []
    for item in summaries:
        if isinstance(item, dict) and "events" in item:
            out.extend(item["events"])
        elif isinstance(item, dict):
            out.append(item)
        else:
            out.extend(item)
    return [e for e in out if e.get("phase") in PHASES]


def _passes(events) -> list[dict]:
    """Group events into ring passes (the N-1 steps of one phase of one call).

    A rank records its events in order, so its sends (and its receives) at step 0 start a new pass.
    Every rank calls the same collectives in the same order: pass k of one rank is pass k of all."""
    count = defaultdict(int)  # (recording rank, kind) -> passes seen so far
    passes = defaultdict(lambda: {"events": []})
    for e in events:
        me = e["src"] if e["kind"] == "send" else e["dst"]  # the rank that recorded the event
        if e["step"] == 0:
            count[me, e["kind"]] += 1
        k = count[me, e["kind"]] - 1
        if k < 0:
            raise ValueError(f"rank {me}'s trace starts in the middle of a ring pass ({e})")
        p = passes[k]
        p["events"].append(e)
        for key in ("op", "phase"):
            if p.setdefault(key, e[key]) != e[key]:
                raise ValueError(f"the ranks' traces disagree: pass {k} is {p[key]!r} on one rank and "
                                 f"{e[key]!r} on rank {me}. Did every rank run the same collectives?")
    return [passes[k] for k in sorted(passes)]


def _title(phase, step, steps, op) -> str:
    if step is None:
        return "start: own shards" if op == "ring_all_gather" else "start: own tensors"
    return f"{phase}, step {step + 1} of {steps}"


def _snapshot(call, op, phase, step, n, holds, sends=(), received=()):
    return {
        "call": call, "op": op, "phase": phase, "step": step, "steps": n - 1, "world_size": n,
        "title": _title(phase, step, n - 1, op),
        "holds": [[sorted(h) for h in row] for row in holds],          # holds[rank][chunk] = ranks summed
        "complete": [[len(h) == n for h in row] for row in holds],
        "sends": [dict(s) for s in sends],
        "received": [list(rc) for rc in received],                     # [rank, chunk] updated this step
    }


def ring_state(events, world_size: int) -> list[dict]:
    """Replay a ring trace: a list of snapshots, one before each collective call starts and one
    after every step, each plain data (see the module docstring for the model):

        call, op, phase ("start", "reduce-scatter" or "all-gather"), step (0-based; None at the
        start), steps (N-1), world_size, title ("reduce-scatter, step 2 of 3"),
        holds[rank][chunk]     sorted list of the ranks whose contribution that copy contains
        complete[rank][chunk]  whether it contains all N
        sends                  this step's transfers: src, dst, chunk, bytes, start, end
        received               [rank, chunk] pairs that changed at this step

    `events` is what `trace_events` accepts: the summaries of every rank (all of them: each rank
    records only its own side of each transfer)."""
    n = world_size
    snaps: list[dict] = []
    holds = None
    call = -1
    prev_op = prev_phase = None
    for p in _passes(trace_events(events)):
        op, phase = p["op"], p["phase"]
        continues = (phase == "all-gather" and op == "ring_all_reduce" and prev_op == op
                     and prev_phase == "reduce-scatter")
        if not continues:  # a new collective call: everyone starts from their own data
            call += 1
            if phase == "reduce-scatter":
                holds = [[{r} for _ in range(n)] for r in range(n)]
            else:
                holds = [[set(range(n)) if c == r else set() for c in range(n)] for r in range(n)]
            snaps.append(_snapshot(call, op, "start", None, n, holds))
        by_step = defaultdict(lambda: {"send": [], "recv": []})
        for e in p["events"]:
            by_step[e["step"]][e["kind"]].append(e)
        if sorted(by_step) != list(range(n - 1)):
            raise ValueError(f"a {phase} pass of {op} on {n} ranks has steps {sorted(by_step)}, "
                             f"expected 0..{n - 2}. Is world_size={n} right?")
        for step in range(n - 1):
            recvs = by_step[step]["recv"]
            if sorted(e["dst"] for e in recvs) != list(range(n)):
                raise ValueError(f"{phase} step {step}: receives recorded by ranks "
                                 f"{sorted(e['dst'] for e in recvs)}, expected every rank 0..{n - 1}. "
                                 "Pass the summaries of all ranks.")
            before = [[set(h) for h in row] for row in holds]
            for e in recvs:
                d, s, c = e["dst"], e["src"], e["chunk"]
                holds[d][c] = before[d][c] | before[s][c] if phase == "reduce-scatter" else set(before[s][c])
            sends = sorted(({k: e[k] for k in ("src", "dst", "chunk", "bytes", "start", "end")}
                            for e in by_step[step]["send"]), key=lambda s: s["src"])
            snaps.append(_snapshot(call, op, phase, step, n, holds, sends,
                                   sorted((e["dst"], e["chunk"]) for e in recvs)))
        prev_op, prev_phase = op, phase
    return snaps


def _world_size(summaries) -> int:
    if summaries and all(isinstance(s, dict) and "events" in s for s in summaries):
        return len(summaries)  # one summary per rank
    ranks = {e["src"] for e in trace_events(summaries)} | {e["dst"] for e in trace_events(summaries)}
    return max(ranks) + 1 if ranks else 1


def snapshots(summaries, call: int = 0, world_size: int | None = None) -> list[dict]:
    """The `ring_state` snapshots of collective call number `call` of the trace (0: the first)."""
    n = world_size or _world_size(summaries)
    snaps = [s for s in ring_state(summaries, n) if s["call"] == call]
    if not snaps:
        raise ValueError(f"no ring collective number {call} in this trace (was it recorded under a "
                         "CommLedger on every rank, with more than one rank?)")
    return snaps


# --- one step ----------------------------------------------------------------------------------

def _fill(k: int, n: int):
    """Colour of a chunk that holds the sum of k of the n ranks' contributions."""
    if k == 0:
        return "white"
    if k >= n:
        return COMPLETE_COLOR
    return plt.get_cmap("Blues")(0.12 + 0.5 * (k - 1) / max(1, n - 2))


def legend_handles(n: int, op: str = "ring_all_reduce") -> list:
    """The legend of the ring pictures: what the colours, outlines and arrows mean."""
    handles = []
    if op == "ring_all_gather":
        handles.append(Patch(facecolor="white", edgecolor=EMPTY_EDGE, linestyle="--", label="not received yet"))
        handles.append(Patch(facecolor=COMPLETE_COLOR, edgecolor="0.3", label="final value of the chunk"))
    else:
        for k in range(1, n):
            label = "only its own value (1 of %d ranks)" % n if k == 1 else f"partial sum of {k} of {n} ranks"
            handles.append(Patch(facecolor=_fill(k, n), edgecolor="0.3", label=label))
        handles.append(Patch(facecolor=COMPLETE_COLOR, edgecolor="0.3", label=f"complete: sum of all {n}"))
    handles.append(Patch(facecolor="white", edgecolor="black", linewidth=2.2,
                         label="rank r's own shard (chunk r)"))
    phases = ("all-gather",) if op == "ring_all_gather" else (
        ("reduce-scatter",) if op == "ring_reduce_scatter" else PHASES)
    for ph in phases:
        handles.append(Line2D([], [], color=PHASE_COLORS[ph], lw=2, marker=">", markersize=7,
                              label=f"{ph} send (number = chunk)"))
    handles.append(Line2D([], [], color="black", lw=0, marker="v", markersize=7,
                          label="chunk that changed this step"))
    return handles


def _angle(r: int, n: int) -> float:
    # clockwise from the top, half a step off the vertical: with 4 ranks they sit at the corners
    # and every arrow has a clear path round the outside; with 2, left and right
    return np.pi / 2 + np.pi / n - 2 * np.pi * r / n


def draw_ring_step(ax, snapshot: dict, *, legend: bool = True, title: str | None = None,
                   fontsize: float = 10) -> None:
    """Draw one snapshot of `ring_state` on `ax`: the ranks on a circle, in ring order clockwise,
    each rank as a row of N chunk boxes (chunk 0 on the left) coloured by how many ranks'
    contributions the chunk holds, the owner's shard outlined, and this step's sends as arrows
    round the outside, each labelled with the chunk it carries."""
    n = snapshot["world_size"]
    op = snapshot["op"]
    ax.set_aspect("equal")
    ax.axis("off")
    w = min(0.3, 1.2 / n)                # one chunk box
    h = min(0.24, 0.85 * w)
    # far enough out that neighbouring rows of boxes do not touch
    radius = max(1.3, (n * w + 0.15) / (2 * np.sin(np.pi / n))) if n > 1 else 1.3
    arc = radius + 0.15                  # the arrows run outside the rows of boxes
    reach = arc + 0.35
    ax.set_xlim(-reach, reach)
    ax.set_ylim(-reach, reach + 0.1)

    changed = {tuple(rc) for rc in snapshot["received"]}
    for r in range(n):
        x0, y0 = radius * np.cos(_angle(r, n)), radius * np.sin(_angle(r, n))
        left = x0 - n * w / 2
        top = y0 >= -1e-9  # the upper half (and both ranks of a 2-rank ring)
        for c in range(n):
            k = len(snapshot["holds"][r][c])
            own = c == r
            ax.add_patch(Rectangle((left + c * w, y0 - h / 2), w, h, facecolor=_fill(k, n),
                                   edgecolor="black" if own else (EMPTY_EDGE if k == 0 else "0.35"),
                                   linewidth=0.2 * fontsize if own else 0.7,
                                   linestyle="--" if (k == 0 and not own) else "-", zorder=3 if own else 2))
            ax.text(left + (c + 0.5) * w, y0, str(c), ha="center", va="center", zorder=4,
                    fontsize=fontsize * (0.85 if n <= 4 else 0.7), color="white" if k >= n else "black")
            if (r, c) in changed:  # a marker on the outer side of the box that just changed
                ax.plot(left + (c + 0.5) * w, y0 + (1 if top else -1) * (h / 2 + 0.08),
                        marker="v" if top else "^", color="black", markersize=0.55 * fontsize, zorder=5)
        # the rank's name on the inner side of its boxes, where no arrow passes
        ax.text(0.75 * x0, y0 - h / 2 - 0.05 if top else y0 + h / 2 + 0.05, f"rank {r}", fontsize=fontsize,
                fontweight="bold", ha="center", va="top" if top else "bottom")

    # this step's sends: arrows round the outside, from each sender to the next rank
    gap = min(np.radians(18), 0.22 * 2 * np.pi / n)
    color = PHASE_COLORS.get(snapshot["phase"], "black")
    for s in snapshot["sends"]:
        a0 = _angle(s["src"], n) - gap
        a1 = a0 - 2 * np.pi * ((s["dst"] - s["src"]) % n) / n + 2 * gap
        t = np.linspace(a0, a1, 40)
        path = Path(np.column_stack([arc * np.cos(t), arc * np.sin(t)]))
        ax.add_patch(FancyArrowPatch(path=path, arrowstyle="-|>", mutation_scale=1.4 * fontsize,
                                     color=color, linewidth=0.2 * fontsize, zorder=3))
        mid = (a0 + a1) / 2
        ax.text((arc + 0.16) * np.cos(mid), (arc + 0.16) * np.sin(mid), str(s["chunk"]), color=color,
                ha="center", va="center", fontsize=fontsize, fontweight="bold", zorder=4,
                bbox=dict(boxstyle="circle,pad=0.15", facecolor="white", edgecolor=color, linewidth=1))
    ax.set_title(snapshot["title"] if title is None else title, fontsize=fontsize + 1)
    if legend:
        ax.legend(handles=legend_handles(n, op), loc="upper center", bbox_to_anchor=(0.5, 0.0),
                  ncol=2, fontsize=fontsize * 0.85, frameon=False)


# --- all the steps ----------------------------------------------------------------------------

def ring_figures(summaries, *, call: int = 0, world_size: int | None = None, panel: float = 2.5):
    """Every step of one ring collective of the trace, as small multiples in one figure. For an
    all-reduce the first row is the start and the reduce-scatter, the second the all-gather."""
    snaps = snapshots(summaries, call, world_size)
    n, op = snaps[0]["world_size"], snaps[0]["op"]
    if op == "ring_all_reduce":
        rows = [snaps[:n], snaps[n:]]
    else:
        rows = [snaps]
    cols = max(len(r) for r in rows)
    spare = len(rows) > 1 and len(rows[1]) < cols  # room for the legend in the last row
    fig, axes = plt.subplots(len(rows), cols, figsize=(panel * cols, (panel + 0.2) * len(rows) + (0 if spare else 1.3)),
                             squeeze=False)
    for i, row in enumerate(rows):
        for j in range(cols):
            ax = axes[i][j]
            if j < len(row):
                draw_ring_step(ax, row[j], legend=False, fontsize=9)
            else:
                ax.axis("off")
    handles = legend_handles(n, op)
    if spare:
        axes[-1][-1].legend(handles=handles, loc="center", fontsize=9, frameon=False, title="legend",
                            title_fontsize=10)
    else:
        fig.legend(handles=handles, loc="lower center", ncol=min(4, len(handles)), fontsize=9, frameon=False)
    fig.suptitle(textwrap.fill(f"{OP_NAMES.get(op, op)} on {n} ranks, replayed from the run's own trace: "
                               "what each rank holds after each step", width=int(11 * panel * cols)), fontsize=12)
    fig.tight_layout(rect=(0, 0 if spare else 0.12, 1, 0.95))
    return fig


def ring_animation(summaries, interval: int = 900, *, call: int = 0, world_size: int | None = None,
                   dpi: int = 80):
    """The steps of one ring collective of the trace as an animation, as HTML (a JavaScript
    player with every frame embedded): it plays in Jupyter and in the static HTML book."""
    from IPython.display import HTML
    from matplotlib.animation import FuncAnimation

    snaps = snapshots(summaries, call, world_size)
    n, op = snaps[0]["world_size"], snaps[0]["op"]
    fig, ax = plt.subplots(figsize=(6.4, 6.6), dpi=dpi)
    fig.legend(handles=legend_handles(n, op), loc="lower center", ncol=2, fontsize=9, frameon=False)
    fig.suptitle(f"{OP_NAMES.get(op, op)} on {n} ranks (from the run's trace)", fontsize=12)
    fig.subplots_adjust(left=0.02, right=0.98, top=0.9, bottom=0.25)

    def frame(i):
        ax.clear()
        name = snaps[i]["title"]
        if snaps[i]["step"] is None:  # room for the long version here
            name = "start: every rank has its own shard" if op == "ring_all_gather" else \
                "start: every rank has its own tensor"
        draw_ring_step(ax, snaps[i], legend=False, title=f"{name}   (frame {i + 1} of {len(snaps)})")
        return []

    anim = FuncAnimation(fig, frame, frames=len(snaps), interval=interval, blit=False)
    html = _offline_player(anim.to_jshtml(default_mode="once"))
    plt.close(fig)  # or Jupyter shows the last frame a second time, as a static image
    return HTML(html)


# matplotlib's player draws its buttons with Font Awesome icons loaded from a CDN: without the
# network (an offline copy of the book) the buttons would be blank. Plain characters need nothing.
_BUTTONS = {"fa fa-minus": "&minus;", "fa fa-fast-backward": "|&#9664;&#9664;",
            "fa fa-step-backward": "&#9664;|", "fa fa-play fa-flip-horizontal": "&#9664;",
            "fa fa-pause": "&#10074;&#10074;", "fa fa-play": "&#9654;", "fa fa-step-forward": "|&#9654;",
            "fa fa-fast-forward": "&#9654;&#9654;|", "fa fa-plus": "+"}


def _offline_player(html: str) -> str:
    import re

    html = re.sub(r'<link rel="stylesheet"\s+href="[^"]*font-awesome[^"]*">', "", html)
    for cls, text in _BUTTONS.items():
        html = html.replace(f'<i class="{cls}"></i>', text)
    return html


# --- when things happened ----------------------------------------------------------------------

def timeline(summaries, *, title: str | None = None):
    """Per rank, a bar for each ring step, from when its first send was posted to when its last
    segment had been received (and added), as the rank measured them with time.perf_counter.
    Step s of a phase is drawn on lane s of the rank's row, so that steps that overlap in time
    (the pipeline: a segment is forwarded as soon as it has arrived) show as overlapping bars."""
    events = [e for e in trace_events(summaries) if e["kind"] == "send"]
    if not events:
        raise ValueError("no ring sends in this trace: record a ring collective under a CommLedger")
    t0 = min(e["start"] for e in events)
    n = max(max(e["src"], e["dst"]) for e in events) + 1
    span = (max(e["end"] for e in events) - t0) * 1e3
    lanes = max(e["step"] for e in events) + 1  # step s of a phase on lane s of its rank's row
    fig, ax = plt.subplots(figsize=(8, (0.25 * lanes + 0.25) * n + 2))
    for e in events:
        x, width = (e["start"] - t0) * 1e3, (e["end"] - e["start"]) * 1e3
        lane = (e["step"] + 0.5) / lanes - 0.5
        ax.barh(e["src"] + 0.85 * lane, width, left=x, height=0.85 / lanes, color=PHASE_COLORS[e["phase"]],
                alpha=0.9, edgecolor="white", linewidth=0.6)
        if width > 0.03 * span:
            ax.text(x + width / 2, e["src"] + 0.85 * lane, str(e["step"] + 1), ha="center", va="center",
                    fontsize=8, color="white")
    ops = sorted({OP_NAMES.get(e["op"], e["op"]) for e in events})
    ax.set_title(title or f"{', '.join(ops)} on {n} ranks: each step, from its send to its receive, on each rank\n"
                 "(one lane per step: bars that overlap in time were in flight together)",
                 fontsize=11)
    ax.set_xlabel("time since the first send was posted (ms)")
    ax.set_ylabel("rank (sending to the next rank)")
    ax.set_yticks(range(n))
    ax.set_ylim(n - 0.5, -0.5)  # rank 0 at the top
    ax.set_xlim(0, span * 1.02)
    ax.grid(axis="x", alpha=0.3)
    phases = [ph for ph in PHASES if any(e["phase"] == ph for e in events)]
    ax.legend(handles=[Patch(color=PHASE_COLORS[ph], label=f"{ph} step (number = step)") for ph in phases],
              loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(phases), frameon=False)
    fig.tight_layout()
    return fig
