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
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from datetime import timedelta
from multiprocessing.connection import Listener, wait

import cloudpickle

from . import backend as _backend
from . import forkserver
from .errors import call_failure, format_stack_dump, join_ranks, shorten, signal_name

DEFAULT_TIMEOUT = 120.0  # seconds; generous for teaching. ZERONB_TIMEOUT overrides it (CI sets it lower)
START_TIMEOUT = 120.0    # seconds for the ranks to connect and join the group
GRACE = 1.0              # seconds the other ranks get to finish after one rank failed
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


def _check_settings(world_size, backend, nodes, threads) -> tuple[str, str]:
    """Every check on a pool's settings, before anything starts (or stops): (backend, why)."""
    _validate_world_size(world_size)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1 or world_size % nodes:
        raise ValueError(f"nodes must be a positive int that divides world_size={world_size}, not {nodes!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive int (torch threads per rank), not {threads!r}")
    return _backend.choose_backend(world_size, backend)


def _default_timeout() -> float:
    return float(os.environ.get("ZERONB_TIMEOUT", DEFAULT_TIMEOUT))


# ---------------------------------------------------------------------------------------------

class _Rank:
    """The notebook's handle on one rank process: its control connection and output pipes."""

    def __init__(self, rank, proc: forkserver.RankProcess, stack_file):
        self.rank = rank
        self.proc = proc
        self.stack_file = stack_file
        self.conn = None
        self.info = {}
        self.buf = {1: b"", 2: b""}       # bytes read from stdout (1) / stderr (2), not yet assigned
        self.printed = {1: 0, 2: 0}       # live mode: how much of buf was already shown
        self.fds = {proc.stdout_fd: 1, proc.stderr_fd: 2}
        self.open_fds = set(self.fds)


class Cluster:
    """A pool of `world_size` rank processes sharing one process group.

    Use `zeronb.start(...)` for the notebook's pool, or this class directly as a context manager:

        with zeronb.Cluster(world_size=2) as c:
            c.run(fn)

    `nodes` simulates several machines on this one: ranks get LOCAL_RANK / GROUP_RANK (the node) as
    torchrun would set them on `nodes` machines of `world_size // nodes` processes each.
    """

    def __init__(self, world_size: int = 2, backend: str = "auto", *, nodes: int = 1,
                 threads: int | None = None, verbose: bool = True):
        self.backend, self.why = _check_settings(world_size, backend, nodes, threads)
        self.world_size, self.nodes, self.requested_backend = world_size, nodes, backend
        # CPU ranks share the cores: one rank's matmul must not use every core (oversubscription
        # makes everything slower), so each gets an equal share unless told otherwise.
        self.threads = threads or max(1, (os.cpu_count() or 1) // world_size)
        self.verbose = verbose
        self._ranks: list[_Rank] = []
        self._closed = False
        self._dead_reason = None  # why the ranks were stopped; they restart on the next call
        self._call_id = 0
        self._lock = threading.Lock()
        self._start()
        _live_clusters.add(self)

    # -- lifecycle --------------------------------------------------------------------------------

    def _say(self, text: str) -> None:
        if self.verbose:
            print(f"zeronb: {text}", flush=True)

    def _start(self) -> None:
        t0 = time.perf_counter()
        env = dict(os.environ)
        env.pop("PYTEST_CURRENT_TEST", None)
        path = forkserver.import_path()
        server = forkserver.helper(env, path, say=self._say)
        server.wait_ready()  # the first pool of a process waits here while the helper imports torch
        self.helper_wait_seconds = time.perf_counter() - t0
        self.helper_pid = server.pid
        self._tmp = tempfile.mkdtemp(prefix="zeronb-")
        key = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=key, backlog=self.world_size + 4)
        self._store = _backend.loopback_store(self.world_size, timedelta(seconds=START_TIMEOUT))
        host, port = self.control_address = self._listener.address  # closed once the ranks are in
        per_node = self.world_size // self.nodes
        env.update({
            "WORLD_SIZE": str(self.world_size), "LOCAL_WORLD_SIZE": str(per_node),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self._store.port),
            "ZERONB_HOST": host, "ZERONB_PORT": str(port),
            "ZERONB_BACKEND": self.backend, "ZERONB_THREADS": str(self.threads),
            "OMP_NUM_THREADS": str(self.threads), "PYTHONUNBUFFERED": "1",
            # one machine: gloo's pairs and NCCL's bootstrap listen on loopback, not the network
            "GLOO_SOCKET_IFNAME": _backend.loopback_interface(),
            "NCCL_SOCKET_IFNAME": _backend.loopback_interface(),
            # what a rank launched on its own would see: the notebook's import path (this zeronb,
            # the notebook's own modules: functions from importable modules are pickled by reference)
            "PYTHONPATH": os.pathsep.join(path),
        })
        self._ranks = []
        self._generation = 0  # how many times the ranks rebuilt their group after a call destroyed it
        try:
            for r in range(self.world_size):
                stack_file = os.path.join(self._tmp, f"rank{r}.stack")
                open(stack_file, "w").close()
                renv = dict(env, RANK=str(r), LOCAL_RANK=str(r % per_node), GROUP_RANK=str(r // per_node),
                            NODE_RANK=str(r // per_node), ZERONB_STACK_FILE=stack_file)
                proc = server.fork(renv, os.getcwd(), path, key)
                self._ranks.append(_Rank(r, proc, stack_file))
            self._accept(key, time.monotonic() + START_TIMEOUT)
            self._wait(0, time.monotonic() + START_TIMEOUT, starting=True)
        except forkserver.HelperGone:
            self._kill()
            raise RuntimeError("zeronb: the helper process that forks the ranks exited while they were "
                               "starting; try again (the next start begins a new helper)") from None
        except BaseException:
            self._kill()
            raise
        finally:
            self._listener.close()  # every rank is connected: nothing more may connect
        self._dead_reason = None
        self.start_seconds = time.perf_counter() - t0
        waited = (f" ({self.helper_wait_seconds:.1f} s of it importing torch, once per process)"
                  if self.helper_wait_seconds > 0.1 else "")
        self._say(f"{self.world_size} ranks ready in {self.start_seconds:.2f} s{waited}, {self.why}")

    def _accept(self, key, deadline) -> None:
        """Accept one authenticated connection per rank; a connection with a wrong key is refused
        (the challenge fails) and does not count."""
        accepted, failure = [], []

        def accept_all():
            while len(accepted) < self.world_size:
                try:
                    conn = self._listener.accept()
                except OSError as e:  # listener closed: startup was abandoned
                    failure.append(e)
                    return
                except Exception:  # AuthenticationError and friends: not one of ours
                    continue
                accepted.append(conn)

        t = threading.Thread(target=accept_all, name="zeronb-accept", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.05)
            dead = [rk for rk in self._ranks if rk.proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                self._listener.close()
                t.join(1)
                if dead:
                    self._raise_start_failure(dead)
                raise RuntimeError(f"zeronb: the ranks did not connect within {START_TIMEOUT:.0f} s")
        for conn in accepted:
            kind, rank, pid = conn.recv()
            self._ranks[rank].conn = conn

    def _raise_start_failure(self, dead) -> None:
        lines = []
        for rk in dead:
            try:
                rk.proc.wait(2)
            except subprocess.TimeoutExpired:
                pass
            self._drain(rk, until_eof=True)
            err = rk.buf[2].decode(errors="replace").strip()
            lines.append(f"--- rank {rk.rank} {signal_name(rk.proc.returncode)} ---\n{err[-3000:]}")
        self._kill()
        raise RuntimeError("zeronb: ranks failed to start:\n" + "\n".join(lines))

    def _kill(self) -> None:
        """Stop every rank now (SIGKILL to each rank's session: its own children too) and wait
        until the helper has reaped it."""
        for rk in self._ranks:
            rk.proc.kill()
        for rk in self._ranks:
            try:
                rk.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
            rk.proc.close()
            if rk.conn is not None:
                rk.conn.close()
        self._ranks = []
        self._store = None

    def close(self) -> None:
        """Stop the ranks and release everything. A closed Cluster cannot run again."""
        if self._closed:
            return
        self._closed = True
        for rk in self._ranks:
            try:
                rk.conn.send_bytes(pickle.dumps(("exit", -1, None)))
            except Exception:
                pass
        deadline = time.monotonic() + 3
        for rk in self._ranks:
            try:
                rk.proc.wait(max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._kill()
        _rmtree(self._tmp)
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
            reason = self._dead_reason
            self._say(f"restarting the {self.world_size} ranks (the last call {reason}); "
                      "per-rank state from earlier calls was lost")
            self._start()

    def _stop(self, reason: str) -> None:
        self._kill()
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

    def _call(self, kind, blob, timeout, live, echo) -> RankResults:
        timeout = _default_timeout() if timeout is None else float(timeout)
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        with self._lock:  # one call at a time per pool: the ranks run one function at a time
            self._ensure_running()
            self._call_id += 1
            msg = pickle.dumps((kind, self._call_id, blob))
            for rk in self._ranks:
                self._drain(rk)  # output printed between calls (rare) belongs to no call
                rk.buf, rk.printed = {1: b"", 2: b""}, {1: 0, 2: 0}
            t0 = time.perf_counter()
            for rk in self._ranks:
                try:
                    rk.conn.send_bytes(msg)
                except OSError:  # the rank died since the last call: the wait below reports it
                    pass
            return self._wait(self._call_id, time.monotonic() + timeout, timeout=timeout, live=live,
                              echo=echo, t0=t0)

    def _drain(self, rk: _Rank, until_eof: bool = False) -> None:
        """Read whatever a rank's pipes hold now without blocking (or all of it, if it exited)."""
        while rk.open_fds:
            ready = wait(list(rk.open_fds), timeout=0.5 if until_eof else 0)
            if not ready:
                return
            for fd in ready:
                self._read(rk, fd)

    def _read(self, rk: _Rank, fd: int, live: bool = False) -> None:
        data = os.read(fd, 1 << 16)
        if not data:
            rk.open_fds.discard(fd)
            return
        stream = rk.fds[fd]
        rk.buf[stream] += data
        if live:  # print the complete lines that arrived, never the end marker
            buf = rk.buf[stream]
            end = buf.rfind(b"\n") + 1
            out = sys.stdout if stream == 1 else sys.stderr
            for line in _strip_markers(buf[rk.printed[stream]:end]).splitlines():
                print(f"[rank {rk.rank}] {line.decode(errors='replace')}", file=out, flush=True)
            rk.printed[stream] = max(rk.printed[stream], end)

    def _wait(self, call_id, deadline, *, starting=False, timeout=None, live=False, echo=True, t0=None):
        """The one loop that waits for a call: replies, output, deaths and the clock."""
        from ._worker import end_marker

        marker = end_marker(call_id)
        n = self.world_size
        replies: dict[int, tuple] = {}
        died: dict[int, int] = {}
        first_failure = None
        by_conn = {rk.conn: rk for rk in self._ranks}
        by_fd = {fd: rk for rk in self._ranks for fd in rk.fds}

        def complete(rk):
            return marker in rk.buf[1] and marker in rk.buf[2]

        try:
            while True:
                pending = [rk for rk in self._ranks if rk.rank not in replies and rk.rank not in died]
                waiting_output = [rk for rk in self._ranks if rk.rank in replies and not complete(rk)
                                  and rk.open_fds]
                if not pending and not waiting_output:
                    break
                now = time.monotonic()
                if first_failure is not None and now > first_failure + GRACE and pending:
                    break  # the rest are blocked: stop waiting for them
                if now > deadline:
                    break
                limit = deadline if first_failure is None else min(deadline, first_failure + GRACE)
                objs = [rk.conn for rk in pending] + [fd for rk in self._ranks for fd in rk.open_fds]
                for obj in wait(objs, timeout=max(0.0, min(limit - now, 0.25))):
                    if isinstance(obj, int):
                        self._read(by_fd[obj], obj, live=live)
                        continue
                    rk = by_conn[obj]
                    try:
                        replies[rk.rank] = obj.recv()
                        if replies[rk.rank][0] not in ("ok", "ready") and first_failure is None:
                            first_failure = time.monotonic()
                    except (EOFError, OSError):
                        try:
                            code = rk.proc.wait(2)
                        except subprocess.TimeoutExpired:
                            code = None
                        died[rk.rank] = code if code is not None else -9
                        self._drain(rk, until_eof=True)
                        if first_failure is None:
                            first_failure = time.monotonic()
                # a rank that exits without its control channel noticing yet
                for rk in pending:
                    if rk.rank not in died and rk.proc.poll() is not None and not rk.conn.poll():
                        died[rk.rank] = rk.proc.returncode
                        self._drain(rk, until_eof=True)
                        if first_failure is None:
                            first_failure = time.monotonic()
        except KeyboardInterrupt:
            still = [rk.rank for rk in self._ranks if rk.rank not in replies and rk.rank not in died]
            stacks = self._stacks(still)
            self._stop("was interrupted")
            msg = "zeronb: call interrupted; the ranks were stopped and restart on the next call."
            if stacks:
                msg += "\n" + "\n".join(f"--- rank {r} was here (most recent call last) ---\n{s}"
                                        for r, s in stacks.items())
            print(msg, file=sys.stderr, flush=True)
            raise

        seconds = time.perf_counter() - t0 if t0 else 0.0
        stdout, stderr = self._split_output(marker)
        if starting:
            if died or len(replies) < n:
                self._raise_start_failure([rk for rk in self._ranks if rk.rank in died] or self._ranks)
            for r, (_, _, info) in replies.items():
                if info is not None:
                    self._ranks[r].info = info
            return None

        if echo and not live:
            _print_grouped(stdout, stderr)

        still = [rk.rank for rk in self._ranks if rk.rank not in replies and rk.rank not in died]
        if not died and not still:
            self._restore_group(sorted(r for r, rep in replies.items() if not rep[3]))
        errors = {r: rep for r, rep in replies.items() if rep[0] != "ok"}
        if not errors and not died and not still:
            values = [cloudpickle.loads(replies[r][2]) for r in range(n)]
            return RankResults(values, stdout, stderr, seconds)

        unpicklable = {r: rep[2] for r, rep in errors.items() if rep[0] == "unpicklable"}
        if unpicklable and len(unpicklable) == len(errors) and not died and not still:
            ranks = ", ".join(map(str, sorted(unpicklable)))
            r0 = min(unpicklable)
            raise TypeError(f"rank(s) {ranks} returned a value that cannot be sent back to the notebook "
                            f"({unpicklable[r0]}). Return plain data instead: numbers, lists, dicts, "
                            "tensors (use .item(), .tolist() or .detach()).")

        stacks = self._stacks(still)
        orphaned = {r for r in died if self._ranks[r].proc.orphaned}  # the helper died, and they with it
        if still or died:  # the group is broken: a rank is gone, or stuck waiting for one
            self._stop("failed" if errors or died else "timed out")
        raise call_failure(errors, died, still, stacks, orphaned, timeout, stdout, stderr)

    def _restore_group(self, lost: list) -> None:
        """After a call that destroyed the process group on some ranks (`dist.destroy_process_group()`,
        as a script written for torchrun ends), every rank joins a new one: the pool stays usable
        and keeps each rank's state. If that fails, the ranks restart on the next call."""
        if not lost:
            return
        self._generation += 1
        self._call_id += 1
        msg = pickle.dumps(("regroup", self._call_id, self._generation))
        try:
            for rk in self._ranks:
                rk.conn.send_bytes(msg)
            self._wait(self._call_id, time.monotonic() + START_TIMEOUT, starting=True)
        except Exception as e:
            self._stop("destroyed the process group")
            self._say(f"rank(s) {join_ranks(lost)} destroyed the process group and a new one could not be made "
                      f"({shorten(str(e).splitlines()[-1])}); the ranks restart on the next call")
            return
        self._say(f"rank(s) {join_ranks(lost)} destroyed the process group (dist.destroy_process_group()); "
                  "every rank joined a new one, so later calls work as before (per-rank state is kept)")

    def _split_output(self, marker: bytes):
        stdout, stderr = [], []
        for rk in self._ranks:
            texts = []
            for stream in (1, 2):
                data = rk.buf[stream]
                cut = data.find(marker)
                mine, rest = (data[:cut], data[cut + len(marker):]) if cut >= 0 else (data, b"")
                rk.buf[stream] = rest
                texts.append(_strip_markers(mine).decode(errors="replace"))
            stdout.append(texts[0])
            stderr.append(texts[1])
        return stdout, stderr

    def _stacks(self, ranks) -> dict[int, str]:
        """Where each of `ranks` is right now: faulthandler dumps its threads on SIGUSR1 (this works
        even when the rank is blocked inside C++ code, such as a gloo recv)."""
        alive = [self._ranks[r] for r in ranks if self._ranks[r].proc.poll() is None]
        for rk in alive:
            open(rk.stack_file, "w").close()
            try:
                os.kill(rk.proc.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        dumps: dict[int, str] = {}
        # Usually ~0.1 s; on a loaded machine a rank may wait over a second to be scheduled and run
        # its handler. The wait ends as soon as every dump is in.
        deadline = time.monotonic() + 3.0
        while len(dumps) < len(alive) and time.monotonic() < deadline:
            time.sleep(0.02)
            for rk in alive:
                if rk.rank in dumps:
                    continue
                text = open(rk.stack_file).read()
                # a complete dump ends with the main thread's frames, then a blank line or EOF
                if re.search(r'_worker\.py", line \d+ in main$', text, re.M):
                    time.sleep(0.02)
                    dumps[rk.rank] = open(rk.stack_file).read()
        return {r: format_stack_dump(d) for r, d in dumps.items()}


def _strip_markers(data: bytes) -> bytes:
    return re.sub(rb"\x1ezeronb-end:-?\d+\x1e\n", b"", data)


def _print_grouped(stdout, stderr) -> None:
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


def _rmtree(path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The notebook's default pool

_live_clusters: "weakref.WeakSet[Cluster]" = weakref.WeakSet()
_default: Cluster | None = None


def start(world_size: int = 2, backend: str = "auto", **kw) -> Cluster:
    """Start the notebook's pool of `world_size` ranks, or return it if it is already running with
    the same settings (a different size or backend replaces it)."""
    global _default
    unknown = set(kw) - {"nodes", "threads", "verbose"}
    if unknown:
        raise TypeError(f"zeronb.start() got unknown argument(s) {', '.join(sorted(unknown))}; "
                        "it takes world_size, backend, nodes, threads and verbose")
    # a bad setting must not stop the pool that is running
    _check_settings(world_size, backend, kw.get("nodes", 1), kw.get("threads"))
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
