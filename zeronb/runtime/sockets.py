"""This rank's TCP connections as the kernel lists them: which are open (gloo's, to the other
ranks), how many bytes the kernel has sent on each (TCP_INFO), and how fast it may send (pacing,
the socket option SO_MAX_PACING_RATE). Linux only; no privileges needed.

gloo opens its connections in C++ whenever a process group is made, so a rank finds them where the
kernel lists them, /proc/self/fd. Imports nothing from zeronb.
"""
from __future__ import annotations

import os
import socket
import struct
import time

SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # Linux: include/uapi/asm-generic/socket.h
# Connections that are not between ranks, by their peer's port: the rendezvous store's (MASTER_PORT,
# as torchrun sets it) and any the rank's launcher lists in OTHER_PORTS_ENV (comma-separated).
OTHER_PORTS_ENV = "ZERONB_OTHER_PORTS"

def connections() -> dict:
    """{(local address, peer address): fd} for this process's connected TCP sockets, except those to
    the rendezvous store and those the launcher named (peer ports MASTER_PORT, OTHER_PORTS_ENV)."""
    named = os.environ.get(OTHER_PORTS_ENV, "").split(",") + [os.environ.get("MASTER_PORT", "")]
    skip = {int(port) for port in named if port}
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(name)))  # a copy: family and type read from the fd
        except OSError:
            continue
        with s:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                peer, local = s.getpeername()[:2], s.getsockname()[:2]
            except OSError:  # listening, or not connected
                continue
            if peer[1] not in skip:
                out[(local, peer)] = int(name)
    return out


UNPACED = 2**32 - 1  # ~0U: the kernel's "no limit"


def set_pacing(fd: int, rate: int) -> None:
    """Pace the socket behind `fd`: at most `rate` bytes per second sent on it (UNPACED: no limit)."""
    with socket.socket(fileno=os.dup(fd)) as s:
        s.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("I" if rate <= UNPACED else "Q", rate))


# struct tcp_info (include/uapi/linux/tcp.h): byte offsets of the counters read here
_TCPI_NOTSENT_BYTES, _TCPI_BYTES_SENT, _TCPI_BYTES_RETRANS, _TCP_INFO_LEN = 144, 200, 208, 232


def _tcp_info(fd: int) -> bytes:
    with socket.socket(fileno=os.dup(fd)) as s:
        return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)


def wire_counters(drain_s: float = 1.0) -> dict:
    """{connection: bytes the kernel has sent on it so far}, for this rank's connections to other
    ranks: tcpi_bytes_sent less tcpi_bytes_retrans, each byte once even when TCP had to send it
    again (which happens on a busy machine's loopback too). Bytes still queued in a send buffer
    are waited for (up to `drain_s`), so that a count taken right after a call includes
    everything the call handed to the kernel."""
    if not hasattr(socket, "TCP_INFO"):
        raise RuntimeError("counting bytes on the wire needs Linux's TCP_INFO; this system has none")
    conns = connections()
    deadline = time.monotonic() + drain_s
    while True:
        infos = {}
        for key, fd in conns.items():
            try:
                infos[key] = _tcp_info(fd)
            except OSError:  # closed meanwhile
                pass
        queued = sum(struct.unpack_from("I", i, _TCPI_NOTSENT_BYTES)[0] for i in infos.values())
        if not queued or time.monotonic() > deadline:
            return {key: struct.unpack_from("Q", i, _TCPI_BYTES_SENT)[0] - struct.unpack_from("Q", i, _TCPI_BYTES_RETRANS)[0]
                    for key, i in infos.items()}
        time.sleep(0.001)
