"""Waiting for one call on the ranks: the replies, the output, deaths and the clock, in one loop,
so that a failure anywhere surfaces at once.

- An exception on a rank: the others get GRACE seconds to finish; those still running then are
  blocked (usually in a collective, waiting for the failed rank).
- A rank that dies (killed, segfault): its exit status, and its last output.
- A rank that reported an error and then exited: its exit status too. A rank that raised is meant
  to stay alive, waiting for the next call; the pool asks each one (a ping, which a live rank answers
  at once and a rank that exited cannot: its end of the control channel is closed).
- The deadline: whoever is still running.
"""
from __future__ import annotations

import pickle
import subprocess
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from .launch import Rank
from .messages import Call, end_marker

GRACE = 1.0  # seconds the other ranks get to finish after one rank failed
PING_TIMEOUT = 5.0  # seconds a rank that raised gets to answer "are you still there?" (it answers at once)
PING = -2           # the call id of that question


@dataclass
class Outcome:
    """What became of a call: each rank replied, died, or was still running at the end."""
    replies: dict = field(default_factory=dict)   # rank -> Reply
    died: dict = field(default_factory=dict)      # rank -> exit status
    exited: dict = field(default_factory=dict)    # rank -> exit status of a rank that replied, then exited
    still: list = field(default_factory=list)     # ranks still running when the wait ended
    stdout: list = field(default_factory=list)    # what each rank printed during the call
    stderr: list = field(default_factory=list)

    @property
    def errors(self) -> dict:
        return {r: rep for r, rep in self.replies.items() if not rep.ok}

    @property
    def complete(self) -> bool:
        """Every rank replied (well or not) and is still there: the process group is intact."""
        return not self.died and not self.still and not self.exited


def wait_for(ranks: list[Rank], call_id: int, deadline: float, live: bool = False) -> Outcome:
    """Wait until every rank has replied to `call_id` and written all of that call's output, a
    rank died or failed (then GRACE more seconds for the others), or `deadline` (time.monotonic)."""
    marker = end_marker(call_id)
    out = Outcome()
    first_failure = None
    by_conn = {rk.conn: rk for rk in ranks}
    by_fd = {fd: rk for rk in ranks for fd in rk.output.stream_of}

    def failed_now():
        nonlocal first_failure
        if first_failure is None:
            first_failure = time.monotonic()

    while True:
        pending = [rk for rk in ranks if rk.rank not in out.replies and rk.rank not in out.died]
        writing = [rk for rk in ranks if rk.rank in out.replies and not rk.output.complete(marker)]
        now = time.monotonic()
        if (not pending and not writing) or now > deadline:
            break
        if first_failure is not None and pending and now > first_failure + GRACE:
            break  # the rest are blocked: stop waiting for them
        limit = deadline if first_failure is None else min(deadline, first_failure + GRACE)
        objs = [rk.conn for rk in pending] + [fd for rk in ranks for fd in rk.output.open_fds]
        for obj in wait(objs, timeout=max(0.0, min(limit - now, 0.25))):
            if isinstance(obj, int):
                by_fd[obj].output.read(obj, live=live)
                continue
            rk = by_conn[obj]
            try:
                reply = obj.recv()
                if reply.call_id == PING:  # a late answer to an earlier ping (see _gone)
                    continue
                out.replies[rk.rank] = reply
                if not reply.ok:
                    failed_now()
            except (EOFError, OSError):  # the connection closed: the rank is gone
                out.died[rk.rank] = _exit_status(rk)
                failed_now()
        for rk in pending:  # a rank that exited before its control channel noticed
            if rk.rank not in out.died and not rk.alive() and not rk.conn.poll():
                out.died[rk.rank] = _exit_status(rk)
                failed_now()
    out.still = [rk.rank for rk in ranks if rk.rank not in out.replies and rk.rank not in out.died]
    for rk in ranks:  # raised and reported: still there, or exited since?
        if rk.rank in out.replies and not out.replies[rk.rank].ok and _gone(rk):
            out.exited[rk.rank] = _exit_status(rk)
    for rk in ranks:
        stdout, stderr = rk.output.take(marker)
        out.stdout.append(stdout)
        out.stderr.append(stderr)
    return out


def _gone(rk: Rank) -> bool:
    """Whether a rank that replied has exited since: it is pinged, and a rank waiting for its next call
    answers at once, while the end of the control channel of a rank whose process ended is closed
    (the ping cannot be sent, or the answer is the end of the stream). No answer within PING_TIMEOUT:
    still there, busy (not called gone)."""
    try:
        rk.conn.send_bytes(pickle.dumps(Call("ping", PING)))
        if not rk.conn.poll(PING_TIMEOUT):
            return False
        rk.conn.recv()
    except (EOFError, OSError):
        return True
    return False


def _exit_status(rk: Rank) -> int:
    try:
        code = rk.proc.wait(2)
    except subprocess.TimeoutExpired:
        code = None
    rk.output.drain(until_eof=True)
    return code if code is not None else -9
