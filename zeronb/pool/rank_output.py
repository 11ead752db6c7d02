"""What the ranks print: each rank's stdout and stderr pipes, read as the bytes come, cut into
calls at the end marker, and shown grouped by rank (deterministic, so nbval can compare it) or
live, line by line."""
from __future__ import annotations

import os
import sys
from multiprocessing.connection import wait

from .messages import strip_markers

STDOUT, STDERR = 1, 2


class RankOutput:
    """The notebook's end of one rank's two output pipes."""

    def __init__(self, rank: int, stdout_fd: int, stderr_fd: int):
        self.rank = rank
        self.stream_of = {stdout_fd: STDOUT, stderr_fd: STDERR}
        self.open_fds = set(self.stream_of)
        self.reset()

    def reset(self) -> None:
        """Forget what was read (at the start of a call)."""
        self.buf = {STDOUT: b"", STDERR: b""}   # bytes read and not yet handed out
        self.printed = {STDOUT: 0, STDERR: 0}   # live mode: how much of buf was shown already

    def read(self, fd: int, live: bool = False) -> None:
        """Read what one pipe holds now (it is ready); with `live`, print its complete lines."""
        data = os.read(fd, 1 << 16)
        if not data:
            self.open_fds.discard(fd)
            return
        stream = self.stream_of[fd]
        self.buf[stream] += data
        if live:  # the complete lines that arrived, never the end marker
            end = self.buf[stream].rfind(b"\n") + 1
            out = sys.stdout if stream == STDOUT else sys.stderr
            for line in strip_markers(self.buf[stream][self.printed[stream]:end]).splitlines():
                print(f"[rank {self.rank}] {line.decode(errors='replace')}", file=out, flush=True)
            self.printed[stream] = max(self.printed[stream], end)

    def drain(self, until_eof: bool = False) -> None:
        """Read whatever the pipes hold now without blocking (or all of it, once the rank exited)."""
        while self.open_fds:
            ready = wait(list(self.open_fds), timeout=0.5 if until_eof else 0)
            if not ready:
                return
            for fd in ready:
                self.read(fd)

    def complete(self, marker: bytes) -> bool:
        """Whether both pipes have reached the end of the call (or closed)."""
        return not self.open_fds or (marker in self.buf[STDOUT] and marker in self.buf[STDERR])

    def take(self, marker: bytes) -> tuple[str, str]:
        """(stdout, stderr) of the call that `marker` ends; what came after it stays for the next."""
        texts = []
        for stream in (STDOUT, STDERR):
            data = self.buf[stream]
            cut = data.find(marker)
            mine, rest = (data[:cut], data[cut + len(marker):]) if cut >= 0 else (data, b"")
            self.buf[stream] = rest
            texts.append(strip_markers(mine).decode(errors="replace"))
        return texts[0], texts[1]

    def stderr_text(self) -> str:
        return self.buf[STDERR].decode(errors="replace")


def print_grouped(stdout: list, stderr: list) -> None:
    """Each rank's output in rank order, each line prefixed by its rank: deterministic, so a
    notebook shows the same output every run (and nbval can compare it)."""
    for r, text in enumerate(stdout):
        for line in text.splitlines():
            print(f"[rank {r}] {line}")
    sys.stdout.flush()
    for r, text in enumerate(stderr):
        for line in text.splitlines():
            print(f"[rank {r}] {line}", file=sys.stderr)
    sys.stderr.flush()
