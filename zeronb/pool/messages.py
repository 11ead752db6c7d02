"""What the notebook and a rank say to each other, and how a call's output is marked as complete.

Over the control channel (an authenticated multiprocessing connection), each a named record:

    rank -> notebook   Hello(rank, pid)                       once, on connecting
    notebook -> rank   Call(kind, call_id, payload)           "call": a pickled (fn, args, kwargs);
                                                              "cell": (source, filename) of %%ranks;
                                                              "regroup": join a new process group;
                                                              "ping": say you are there (after a
                                                              call failed); "exit": stop
    rank -> notebook   Reply(status, call_id, value, group_alive)
                       status "ok" (value: the pickled result), "error" (value: the exception
                       chain as plain data), "unpicklable" (value: why), "ready" (after joining a
                       group, value: facts about the rank; or the answer to a ping)

A rank's stdout and stderr are pipes of their own. After each call the rank writes `end_marker`
to both, so the notebook knows when it holds all of a call's output.
"""
from __future__ import annotations

import re
from typing import Any, NamedTuple


class Hello(NamedTuple):
    rank: int
    pid: int


class Call(NamedTuple):
    kind: str
    call_id: int
    payload: Any = None


class Reply(NamedTuple):
    status: str
    call_id: int
    value: Any = None
    group_alive: bool = True  # False: the call destroyed the process group (the pool makes a new one)

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "ready")


def end_marker(call_id: int) -> bytes:
    """Written to a rank's stdout and stderr after call `call_id` (-1: the rank is exiting)."""
    return b"\x1ezeronb-end:%d\x1e\n" % call_id


_MARKER = re.compile(rb"\x1ezeronb-end:-?\d+\x1e\n")


def strip_markers(data: bytes) -> bytes:
    return _MARKER.sub(b"", data)


# The frame of the rank's main loop in a faulthandler dump: a dump is complete once it is there,
# and the user's frames are the ones above it.
WORKER_LOOP_FRAME = re.compile(r'_worker\.py", line \d+ in main$', re.M)
