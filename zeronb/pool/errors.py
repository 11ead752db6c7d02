"""What the notebook shows when ranks fail: `RankError`, `RankTimeout`, and the text inside them.

A failure on the ranks is told as the reader would want it from one process: which ranks failed
and how (an exception, a signal, the clock), each failing rank's traceback pointing at the
notebook's own cells, and where each rank still running was blocked (usually in a collective,
waiting for the rank that failed).
"""
from __future__ import annotations

import linecache
import os
import re
import signal

from .messages import WORKER_LOOP_FRAME


class RankError(RuntimeError):
    """One or more ranks failed during a call. The message has each failed rank's traceback and the
    stack of every rank that was still running; the same parts are attributes."""

    def __init__(self, message, *, failed=(), blocked=(), tracebacks=None, stacks=None, exit_codes=None,
                 stdout=None, stderr=None):
        super().__init__(message)
        self.failed = list(failed)            # ranks that raised or died
        self.blocked = list(blocked)          # ranks still running when the call was given up
        self.tracebacks = tracebacks or {}    # rank -> formatted remote traceback
        self.stacks = stacks or {}            # rank -> where a still-running rank was blocked
        self.exit_codes = exit_codes or {}    # rank -> exit status of a rank whose process ended
        self.stdout = stdout or []            # what each rank printed during the call
        self.stderr = stderr or []

    def _render_traceback_(self):
        # IPython shows this instead of the notebook-side traceback, which is only zeronb's plumbing.
        return [f"{type(self).__name__}: {self}"]


class RankTimeout(RankError, TimeoutError):
    """A call ran past its timeout; the message shows where each running rank was blocked."""



def _cell_name(filename: str) -> str | None:
    """'Cell In[5]' for code that came from a notebook cell, as IPython names it."""
    m = re.fullmatch(r"<%%ranks In\[(\d+)\]>", filename)
    if m:
        return f"Cell In[{m.group(1)}]"
    try:
        from IPython import get_ipython

        ip = get_ipython()
        n = ip.compile._filename_map.get(filename) if ip is not None else None
        if n is not None:
            return f"Cell In[{n}]"
    except Exception:
        pass
    return None


def _format_frame(filename: str, lineno: int, name: str, line: str = "") -> str:
    # The rank has no copy of the notebook's cells; this process does (IPython keeps them in linecache).
    line = (linecache.getline(filename, lineno) or line).strip()
    cell = _cell_name(filename)
    where = f"  {cell}, line {lineno}, in {name}" if cell else f'  File "{_short_path(filename)}", line {lineno}, in {name}'
    return where + (f"\n    {line}" if line else "")


def _short_path(filename: str) -> str:
    """`.../site-packages/torch/distributed/x.py` rather than the full path of the environment."""
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in filename:
            return "..." + os.sep + filename.split(marker, 1)[1]
    return filename


def _format_chain(chain: list) -> str:
    parts = []
    for i, exc in enumerate(chain):
        if exc["frames"]:
            parts.append("Traceback (most recent call last):")
            parts.extend(_format_frame(*f) for f in exc["frames"])
        parts.append(exc["message"])
        if i + 1 < len(chain):  # the newer exception's "link" says how this older one relates to it
            parts.append("")
            parts.append("The above exception was the direct cause of the following exception:"
                         if chain[i + 1]["link"] == "cause" else
                         "During handling of the above exception, another exception occurred:")
            parts.append("")
    return "\n".join(parts)


_FAULT_FRAME = re.compile(r'^\s*File "(.*)", line (\d+) in (.*)$')


def format_stack_dump(dump: str) -> str:
    """Turn faulthandler's dump of a rank into a traceback-style stack of its main thread, starting
    at the user's code (the frames of zeronb's own worker loop are dropped)."""
    threads = [t for t in re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump.strip()) if t.strip()]
    main = next((t for t in threads if WORKER_LOOP_FRAME.search(t)),
                threads[-1] if threads else "")
    frames = []
    for line in main.splitlines()[1:]:
        m = _FAULT_FRAME.match(line)
        if m:
            frames.append((m.group(1), int(m.group(2)), m.group(3)))
    frames.reverse()  # faulthandler prints most recent first; tracebacks read the other way
    ours = [i for i, f in enumerate(frames) if f[0].endswith("_worker.py")]
    if ours:  # start below zeronb's worker loop, at the user's function
        frames = frames[ours[-1] + 1:]
    if not frames:
        return "  (no Python frames: the rank was in C code or had just finished)"
    return "\n".join(_format_frame(f, n, name) for f, n, name in frames)


def signal_name(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def join_ranks(ranks) -> str:
    return ", ".join(map(str, ranks))


def _first_line(text: str) -> str:
    """The line of a traceback that says what happened: its last non-empty one."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "failed"


def shorten(text: str, n: int = 160) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."


def call_failure(errors: dict, died: dict, still: list, stacks: dict, orphaned: set, timeout: float,
                 stdout: list, stderr: list, exited: dict | None = None) -> RankError:
    """The exception for a call that failed: `errors` maps a rank to its error Reply, `died` to its
    exit status, `still` lists the ranks that were still running (their `stacks` show where), `exited`
    maps a rank that replied and then exited to its exit status."""
    exited = exited or {}
    tracebacks = {}
    for r, rep in sorted(errors.items()):
        tracebacks[r] = (_format_chain(rep.value) if rep.status == "error" else
                         f"TypeError: returned a value that cannot be sent back to the notebook ({rep.value})")
    said = {r: _first_line(text) for r, text in tracebacks.items()}  # what each raised, in one line
    for r, code in sorted(exited.items()):
        tracebacks[r] = tracebacks.get(r, "it replied") + f"\n(then the rank process {signal_name(code)})"
    for r, code in sorted(died.items()):
        err = stderr[r].strip()
        tracebacks[r] = f"the rank process {signal_name(code)}" + (
            " when the helper process that forked it exited (ranks die with it)" if r in orphaned else "") + (
            f"; its last output on stderr:\n{err[-4000:]}" if err else "")
    failed = sorted(set(errors) | set(died) | set(exited))
    timed_out = not failed

    parts = []
    if timed_out:
        parts.append(f"the call ran past its timeout of {timeout:g} s; rank(s) {join_ranks(still)} still running "
                     "(a deadlock? a collective that not every rank called? Pass timeout=... for long work)")
    else:
        raised = sorted(errors)
        if died:
            parts.append(f"rank(s) {join_ranks(sorted(died))} died ("
                         + "; ".join(f"rank {r} {signal_name(c)}" for r, c in sorted(died.items())) + ")"
                         + (" because the helper process that forked them exited" if orphaned else ""))
        if raised:
            parts.append(f"rank(s) {join_ranks(raised)} raised ("
                         + "; ".join(f"rank {r}: {shorten(said[r])}" for r in raised) + ")"
                         + (" - in a collective, most likely because of the rank that died" if died else ""))
        if exited:
            parts.append(f"rank(s) {join_ranks(sorted(exited))} then exited ("
                         + "; ".join(f"rank {r} {signal_name(c)}" for r, c in sorted(exited.items())) + ")")
        if still:
            parts.append(f"rank(s) {join_ranks(still)} were still running, blocked (shown below), and were stopped")
        parts = ["; ".join(parts)]
    # the ranks that died first: the others' errors are usually a consequence; ranks with the
    # same traceback are shown once
    shown: dict[str, list] = {}
    for r in sorted(died) + sorted(set(errors) | set(exited)):
        shown.setdefault(tracebacks[r], []).append(r)
    for text, ranks in shown.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {join_ranks(ranks)} (the same error)"
        parts.append(f"\n--- {who} ---\n{text}")
    for r in still:
        parts.append(f"\n--- rank {r}: still running, blocked here (most recent call last) ---\n"
                     f"{stacks.get(r, '  (stack not available)')}")
    if still or died or exited:
        parts.append("\nThe ranks were stopped; they restart on the next call (per-rank state is lost).")
    exc_type = RankTimeout if timed_out else RankError
    return exc_type("\n".join(parts), failed=failed, blocked=still, tracebacks=tracebacks, stacks=stacks,
                    exit_codes={**died, **exited}, stdout=stdout, stderr=stderr)
