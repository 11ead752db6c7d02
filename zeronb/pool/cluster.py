"""The rank pool: N real `torch.distributed` ranks that a notebook cell can run functions on.

    cl = zeronb.start(world_size=4)       # starts 4 processes, one process group, once
    res = zeronb.run(fn, x)               # fn(x) on every rank; res[r] is rank r's return value

How it works, in the order things happen:

1. `Cluster` hosts the rendezvous store (a TCPStore on 127.0.0.1, port picked by the OS) and an
   authenticated control channel (multiprocessing.connection with a random key), then has each
   rank forked from the helper process of `forkserver.py`, which has imported torch once: a rank
   is ready in milliseconds, not the seconds of importing torch again. The helper is a fresh
   process, never a fork of the notebook: safe after the notebook used CUDA or OpenMP. Each rank
   runs in a new session, which keeps Jupyter's interrupt from killing idle ranks.
2. Each rank joins the process group once; every later call reuses it, so a call costs
   milliseconds, not the seconds of starting processes.
3. `run` pickles the function by value with cloudpickle (functions, closures and classes defined in
   the notebook work), sends it to every rank and waits - on the replies, on the ranks' output
   pipes and on the clock - in one loop, so that a failure anywhere surfaces at once:
   - an exception on a rank: the others get a moment to finish; those still running are blocked
     (usually in a collective waiting for the failed rank), so their Python stacks are taken and
     the pool is stopped; `RankError` names the ranks and shows both.
   - a rank that dies (killed, segfault): its exit status and last output, in `RankError`.
   - the timeout: `RankTimeout`, with the stack of every rank still running.
   The next call restarts the pool and says that per-rank state was lost.
"""
from __future__ import annotations

import atexit
import os
import pickle
import secrets
import shutil
import sys
import tempfile
import threading
import time
import weakref
from datetime import timedelta
from multiprocessing.connection import Listener

import cloudpickle

from ..runtime import backend as _backend
from . import calls, forkserver, launch
from .errors import call_failure, format_stack_dump, join_ranks, shorten
from .messages import Call
from .rank_output import print_grouped

DEFAULT_TIMEOUT = 120.0  # seconds; generous for teaching. ZERONB_TIMEOUT overrides it (CI sets it lower)
START_TIMEOUT = 120.0    # seconds for the ranks to connect and join the group
MAX_WORLD_SIZE = int(os.environ.get("ZERONB_MAX_WORLD_SIZE", "32"))


class RankResults(list):
    """What `run` returns: `res[r]` is rank r's return value, `res.stdout[r]` what it printed."""

    def __init__(self, values, stdout, stderr, seconds):
        super().__init__(values)
        self.stdout = stdout
        self.stderr = stderr
        self.seconds = seconds  # wall-clock time of the call, as seen by the notebook


def _validate_world_size(world_size) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, not {type(world_size).__name__} ({world_size!r})")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")
    if world_size > MAX_WORLD_SIZE:
        raise ValueError(f"world_size={world_size} would start {world_size} processes on this machine; "
                         f"the limit is {MAX_WORLD_SIZE} (set ZERONB_MAX_WORLD_SIZE to raise it). "
                         "For more ranks, run a script under torchrun on several machines.")
    return world_size


def _check_settings(world_size, backend, nodes, threads, inter=None, intra=None) -> tuple[str, str, dict]:
    """Every check on a pool's settings, before anything starts (or stops): (backend, why, link rates)."""
    _validate_world_size(world_size)
    links = launch.check_links(world_size, nodes, inter, intra)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive int (torch threads per rank), not {threads!r}")
    chosen, why = _backend.choose_backend(world_size, backend)
    if chosen == "nccl" and any(rate is not None for rate in links.values()):
        raise ValueError("inter_node_bandwidth / intra_node_bandwidth pace gloo's TCP connections; NCCL's traffic "
                         "goes over NVLink or PCIe, which no socket option slows. Start the pool with backend='gloo' "
                         "to make the nodes' links real, or without the rates for a topology only")
    return chosen, why, links


def _default_timeout() -> float:
    return float(os.environ.get("ZERONB_TIMEOUT", DEFAULT_TIMEOUT))


class Cluster:
    """A pool of `world_size` rank processes sharing one process group.

    Use `zeronb.start(...)` for the notebook's pool, or this class directly as a context manager:

        with zeronb.Cluster(world_size=2) as c:
            c.run(fn)

    `nodes` simulates several machines on this one: ranks get LOCAL_RANK / GROUP_RANK (the node) as
    torchrun would set them on `nodes` machines of `world_size // nodes` processes each, and the kernel
    paces the links between nodes at `inter_node_bandwidth` ("50MB/s"; zeronb.runtime.links).
    """

    def __init__(self, world_size: int = 2, backend: str = "auto", *, nodes: int = 1,
                 inter_node_bandwidth=None, intra_node_bandwidth=None, threads: int | None = None,
                 verbose: bool = True):
        self.backend, self.why, self.links = _check_settings(world_size, backend, nodes, threads,
                                                             inter_node_bandwidth, intra_node_bandwidth)
        self.world_size, self.nodes, self.requested_backend = world_size, nodes, backend
        self.inter_node_bandwidth, self.intra_node_bandwidth = inter_node_bandwidth, intra_node_bandwidth
        # CPU ranks share the cores: an equal share each (oversubscribed cores make everything slower)
        self.threads, self.verbose = threads or max(1, (os.cpu_count() or 1) // world_size), verbose
        self._ranks: list[launch.Rank] = []
        self._closed = False
        self._dead_reason = None  # why the ranks were stopped; they restart on the next call
        self._call_id = 0
        self._generation = 0      # how many times the ranks rebuilt their group after a call destroyed it
        self._lock = threading.Lock()
        self._start()
        _live_clusters.add(self)

    # -- lifecycle --------------------------------------------------------------------------------

    def _say(self, text: str) -> None:
        if self.verbose:
            print(f"zeronb: {text}", flush=True)

    def _start(self) -> None:
        t0 = time.perf_counter()
        path = forkserver.import_path()
        server = forkserver.helper(dict(os.environ), path, say=self._say)
        server.wait_ready()  # the first pool of a process waits here while the helper imports torch
        self.helper_wait_seconds = time.perf_counter() - t0
        self.helper_pid = server.pid
        self._tmp = tempfile.mkdtemp(prefix="zeronb-")
        key = secrets.token_bytes(32)
        listener = Listener(("127.0.0.1", 0), authkey=key, backlog=self.world_size + 4)
        self._store = launch.loopback_store(self.world_size, timedelta(seconds=START_TIMEOUT))
        self.control_address = listener.address
        envs = launch.rank_environment(os.environ, world_size=self.world_size, nodes=self.nodes,
                                       store_port=self._store.port, control=listener.address,
                                       backend=self.backend, threads=self.threads, path=path, links=self.links)
        try:
            self._ranks = launch.fork_ranks(server, envs, path, key, self._tmp)
            launch.accept(listener, self._ranks, START_TIMEOUT)
            self._await(0, START_TIMEOUT, starting=True)
        except forkserver.HelperGone:
            self._kill()
            raise RuntimeError("zeronb: the helper process that forks the ranks exited while they were "
                               "starting; try again (the next start begins a new helper)") from None
        except BaseException:
            self._kill()
            raise
        finally:
            listener.close()  # every rank is connected: nothing more may connect
        self._dead_reason = None
        self.start_seconds = time.perf_counter() - t0
        waited = (f" ({self.helper_wait_seconds:.1f} s of it importing torch, once per process)"
                  if self.helper_wait_seconds > 0.1 else "")
        self._say(f"{self.world_size} ranks ready in {self.start_seconds:.2f} s{waited}, {self.why}")

    def _kill(self) -> None:
        """Stop every rank now (SIGKILL to each rank's session: its own children too) and wait
        until the helper has reaped it."""
        for rk in self._ranks:
            rk.kill()
        for rk in self._ranks:
            rk.reap()
        self._ranks = []
        self._store = None

    def close(self) -> None:
        """Stop the ranks and release everything. A closed Cluster cannot run again."""
        if self._closed:
            return
        self._closed = True
        for rk in self._ranks:
            try:
                rk.conn.send_bytes(pickle.dumps(Call("exit", -1)))
            except Exception:
                pass
        deadline = time.monotonic() + 3
        for rk in self._ranks:
            try:
                rk.proc.wait(max(0.05, deadline - time.monotonic()))
            except Exception:
                pass
        self._kill()
        shutil.rmtree(self._tmp, ignore_errors=True)
        _live_clusters.discard(self)

    shutdown = close

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if not self._closed and self._ranks:
                self.close()
        except Exception:
            pass

    def __repr__(self):
        state = "closed" if self._closed else ("stopped" if self._dead_reason else "running")
        return f"<zeronb.Cluster world_size={self.world_size} backend={self.backend} {state}>"

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pids(self) -> list[int]:
        return [rk.proc.pid for rk in self._ranks]

    def _ensure_running(self) -> None:
        if self._closed:
            raise RuntimeError("this zeronb Cluster was closed; start a new one "
                               "(zeronb.start(world_size=...) or zeronb.Cluster(...))")
        if self._dead_reason is not None:
            self._say(f"restarting the {self.world_size} ranks (the last call {self._dead_reason}); "
                      "per-rank state from earlier calls was lost")
            self._start()

    def _stop(self, reason: str) -> None:
        self._kill()
        shutil.rmtree(self._tmp, ignore_errors=True)  # (a restart makes a new one)
        self._dead_reason = reason

    # -- calls ------------------------------------------------------------------------------------

    def run(self, fn, *args, timeout: float | None = None, live: bool = False, echo: bool = True,
            **kwargs) -> RankResults:
        """Run `fn(*args, **kwargs)` on every rank and return the per-rank results.

        timeout: seconds before RankTimeout (default 120, or $ZERONB_TIMEOUT).
        live: print each rank's output as it comes instead of grouped by rank after the call.
        echo: print the ranks' output at all (it is in `res.stdout` either way).
        """
        if not callable(fn):
            raise TypeError(f"zeronb.run needs a function to run on the ranks, not {type(fn).__name__}")
        try:
            blob = cloudpickle.dumps((fn, args, kwargs))
        except Exception as e:
            raise TypeError(f"cannot send {getattr(fn, '__qualname__', fn)!r} and its arguments to the ranks: "
                            f"{type(e).__name__}: {e}. Everything a rank needs must be picklable "
                            "(no open files, locks, sockets or generators); create those inside the function.") from None
        return self._call("call", blob, timeout, live, echo)

    def run_cell(self, source: str, filename: str, timeout: float | None = None, live: bool = False,
                 echo: bool = True) -> RankResults:
        """Run notebook source code in each rank's own namespace (what the %%ranks magic does)."""
        return self._call("cell", (source, filename), timeout, live, echo)

    def _call(self, kind, payload, timeout, live, echo) -> RankResults:
        timeout = _default_timeout() if timeout is None else float(timeout)
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        with self._lock:  # one call at a time per pool: the ranks run one function at a time
            self._ensure_running()
            t0 = time.perf_counter()
            out = self._await(self._send(kind, payload), timeout, live=live)
            if echo and not live:
                print_grouped(out.stdout, out.stderr)
            if out.complete:
                self._restore_group(sorted(r for r, rep in out.replies.items() if not rep.group_alive))
            errors = out.errors
            if out.complete and not errors:
                values = [cloudpickle.loads(out.replies[r].value) for r in range(self.world_size)]
                return RankResults(values, out.stdout, out.stderr, time.perf_counter() - t0)
            if out.complete and all(rep.status == "unpicklable" for rep in errors.values()):
                r0 = min(errors)
                raise TypeError(f"rank(s) {join_ranks(sorted(errors))} returned a value that cannot be sent back to "
                                f"the notebook ({errors[r0].value}). Return plain data instead: numbers, lists, "
                                "dicts, tensors (use .item(), .tolist() or .detach()).")
            stacks = self._stacks(out.still)
            orphaned = {r for r in out.died if self._ranks[r].proc.orphaned}  # the helper died, and they with it
            if not out.complete:  # the group is broken: a rank is gone, or stuck waiting for one
                self._stop("failed" if errors or out.died or out.exited else "timed out")
            raise call_failure(errors, out.died, out.still, stacks, orphaned,
                               timeout, out.stdout, out.stderr, exited=out.exited)

    def _send(self, kind, payload) -> int:
        """Send a call to every rank; its id."""
        self._call_id += 1
        msg = pickle.dumps(Call(kind, self._call_id, payload))
        for rk in self._ranks:
            rk.output.drain()  # output printed between calls (rare) belongs to no call
            rk.output.reset()
        for rk in self._ranks:
            try:
                rk.conn.send_bytes(msg)
            except OSError:  # the rank died since the last call: the wait reports it
                pass
        return self._call_id

    def _await(self, call_id, timeout, *, starting=False, live=False) -> calls.Outcome:
        """Wait for a call (or, `starting`, for the ranks to join their group, which raises if
        one does not)."""
        try:
            out = calls.wait_for(self._ranks, call_id, time.monotonic() + timeout, live=live)
        except KeyboardInterrupt:
            still = [rk.rank for rk in self._ranks if rk.alive()]
            stacks = self._stacks(still)
            self._stop("was interrupted")
            print("zeronb: call interrupted; the ranks were stopped and restart on the next call."
                  + "".join(f"\n--- rank {r} was here (most recent call last) ---\n{s}" for r, s in stacks.items()),
                  file=sys.stderr, flush=True)
            raise
        if starting:
            if not out.complete or out.errors:
                raise launch.start_failure([rk for rk in self._ranks if rk.rank in out.died] or self._ranks)
            for r, reply in out.replies.items():
                if reply.value is not None:
                    self._ranks[r].info = reply.value
        return out

    def _restore_group(self, lost: list) -> None:
        """After a call that destroyed the process group on some ranks (`dist.destroy_process_group()`,
        as a script written for torchrun ends), every rank joins a new one: the pool stays usable
        and keeps each rank's state. If that fails, the ranks restart on the next call."""
        if not lost:
            return
        self._generation += 1
        try:
            self._await(self._send("regroup", self._generation), START_TIMEOUT, starting=True)
        except Exception as e:
            self._stop("destroyed the process group")
            self._say(f"rank(s) {join_ranks(lost)} destroyed the process group and a new one could not be made "
                      f"({shorten(str(e).splitlines()[-1])}); the ranks restart on the next call")
            return
        self._say(f"rank(s) {join_ranks(lost)} destroyed the process group (dist.destroy_process_group()); "
                  "every rank joined a new one, so later calls work as before (per-rank state is kept)")

    def _stacks(self, ranks) -> dict[int, str]:
        """Where each of `ranks` is right now, as tracebacks."""
        return {r: format_stack_dump(d) for r, d in launch.stack_dumps([self._ranks[r] for r in ranks]).items()}


# ---------------------------------------------------------------------------------------------
# The notebook's default pool

_live_clusters: "weakref.WeakSet[Cluster]" = weakref.WeakSet()
_default: Cluster | None = None


def start(world_size: int = 2, backend: str = "auto", **kw) -> Cluster:
    """Start the notebook's pool of `world_size` ranks, or return it if it is already running with
    the same settings (a different size or backend replaces it)."""
    global _default
    unknown = set(kw) - {"nodes", "inter_node_bandwidth", "intra_node_bandwidth", "threads", "verbose"}
    if unknown:
        raise TypeError(f"zeronb.start() got unknown argument(s) {', '.join(sorted(unknown))}; it takes world_size, "
                        "backend, nodes, inter_node_bandwidth, intra_node_bandwidth, threads and verbose")
    # a bad setting must not stop the pool that is running
    _check_settings(world_size, backend, kw.get("nodes", 1), kw.get("threads"), kw.get("inter_node_bandwidth"),
                    kw.get("intra_node_bandwidth"))
    if _default is not None and not _default.closed:
        same = (_default.world_size == world_size and _default.requested_backend == backend
                and all(getattr(_default, k) == v for k, v in kw.items() if k != "verbose"))
        if same:
            return _default
        _default.close()
    _default = Cluster(world_size, backend, **kw)
    return _default


def current() -> Cluster:
    if _default is None or _default.closed:
        raise RuntimeError("no zeronb pool is running: start one with zeronb.start(world_size=N)")
    return _default


def run(fn, *args, timeout: float | None = None, live: bool = False, echo: bool = True, **kwargs) -> RankResults:
    """Run `fn(*args, **kwargs)` on every rank of the pool started by `zeronb.start`."""
    return current().run(fn, *args, timeout=timeout, live=live, echo=echo, **kwargs)


def shutdown() -> None:
    """Stop the notebook's pool: its processes are gone when this returns."""
    global _default
    if _default is not None:
        _default.close()
    _default = None


@atexit.register
def _close_all() -> None:
    for cl in list(_live_clusters):
        cl.close()
