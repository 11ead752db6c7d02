"""Where rank processes come from: a fork server that has imported torch once, so ranks don't.

Importing torch costs seconds of CPU per process (about 2.5 s here), and a pool of N ranks started
as N fresh Pythons pays it N times, at every start and every restart. Instead, one helper process
is started fresh (never forked from the notebook, which may have touched CUDA or OpenMP), imports
torch and zeronb's rank code, and then does nothing else: no CUDA, no threads, no tensors. A rank
is a fork of it - ready to join its process group in milliseconds. This is the "zygote" of
Android and of Python's own `multiprocessing.forkserver`; ours is small because the pool needs
little: fork, hand the rank its pipes, tell the notebook when it exits.

    notebook ──socket──▶ helper (a script: zeronb/pool/forkserver.py: imports, then waits)
                           ├─fork─▶ rank 0  (new session, stdout/stderr = the notebook's pipes)
                           └─fork─▶ rank 1 ...

- The notebook sends each rank's pipes over a Unix socket (SCM_RIGHTS): the rank writes into them.
- The helper is the ranks' parent: it reaps them and writes each one's exit status into a pipe of
  its own that the notebook reads, so "killed by SIGKILL" still reaches the notebook.
- Lifetimes chain: the helper exits when the notebook's end of the socket closes (the notebook
  exited, even by SIGKILL), and a rank is killed when the helper exits (PR_SET_DEATHSIG on Linux,
  a watch thread elsewhere). The helper is detached (not the notebook's child) and in its own
  session, so Jupyter's interrupt reaches neither it nor the ranks.
- The helper serves every pool of the process. It is replaced when it died (saying so), or when what
  it imported is stale: zeronb's source or an environment variable read at import time changed.
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading

START_TIMEOUT = 120.0  # seconds for the helper to import torch (a cold disk, a busy machine)

# Imported by the helper before any fork, so that no rank pays for them. The pool names what it
# needs itself; `preload` adds what the ranks will run (zeronb/__init__.py names it), passed to the
# helper in its environment.
PRELOAD = ["torch", "torch.distributed", "cloudpickle", "numpy", "zeronb.pool._worker"]
_REQUIRED, PRELOAD_ENV = ("torch", "torch.distributed", "cloudpickle", "zeronb.pool._worker"), "ZERONB_PRELOAD"


def preload(*modules: str) -> None:
    """Have the helper import these too before it forks (one that fails there is left to the rank)."""
    PRELOAD.extend(m for m in modules if m not in PRELOAD)

# Environment variables that libraries read once, when they are loaded: a helper started under
# other values would hand stale settings to its ranks, so a change starts a new helper.
# (CUDA_* is not among them: CUDA starts in the rank, after the fork, from the rank's environment;
# and torch itself sets CUDA_MODULE_LOADING in a process that starts CUDA.)
_IMPORT_TIME_ENV = ("TORCH", "PYTORCH", "LD_", "OMP_", "KMP_", "MKL_", "GOMP_", "OPENBLAS", "PYTHON")
_PER_POOL_ENV = ("PYTHONPATH", "OMP_NUM_THREADS", "PYTHONUNBUFFERED")  # set per rank by the pool


# --- messages over the Unix socket: a length-prefixed pickle, file descriptors attached ---------

def _send(sock: socket.socket, obj, fds=()) -> None:
    data = pickle.dumps(obj)
    head = struct.pack("!I", len(data))
    if fds:
        socket.send_fds(sock, [head], list(fds))
    else:
        sock.sendall(head)
    sock.sendall(data)


def _recv(sock: socket.socket, maxfds: int = 0):
    """(message, fds), or (None, []) when the other end has closed."""
    head, fds, _, _ = socket.recv_fds(sock, 4, maxfds) if maxfds else (sock.recv(4), [], 0, None)
    while head and len(head) < 4:
        more = sock.recv(4 - len(head))
        if not more:
            break
        head += more
    if len(head) < 4:
        return None, []
    size, = struct.unpack("!I", head)
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None, []
        data += chunk
    return pickle.loads(data), fds


# --- the notebook's side ----------------------------------------------------------------------

class RankProcess:
    """The notebook's handle on a forked rank: what `subprocess.Popen` offers, for a process that
    is the helper's child, not ours. The exit status arrives through a pipe the helper writes."""

    def __init__(self, pid: int, stdout_fd: int, stderr_fd: int, status_fd: int):
        self.pid = pid
        self.stdout_fd, self.stderr_fd = stdout_fd, stderr_fd
        self._status_fd = status_fd
        self.returncode = None
        self.orphaned = False  # the helper exited first: the rank was killed with it, status unknown

    def poll(self):
        if self.returncode is None and select.select([self._status_fd], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._status_fd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            self._read_status()
        return self.returncode

    def _read_status(self) -> None:
        data = os.read(self._status_fd, 64)  # one write of a few bytes: it arrives whole
        os.close(self._status_fd)
        self._status_fd = None
        if data.strip():
            self.returncode = int(data)
        else:  # the helper died before this rank; PR_SET_DEATHSIG killed the rank with SIGKILL
            self.returncode, self.orphaned = -signal.SIGKILL, True

    def kill(self) -> None:
        """SIGKILL to the rank's whole session (its own children too)."""
        if self.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def close(self) -> None:
        for fd in (self.stdout_fd, self.stderr_fd, self._status_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.stdout_fd = self.stderr_fd = self._status_fd = None


class HelperGone(RuntimeError):
    """The helper process exited: the ranks it forked are gone and it cannot fork more."""


class ForkServer:
    """The notebook's connection to one helper process."""

    def __init__(self, env: dict, path: list):
        self.stamp = _stamp(env)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(env, PYTHONPATH=os.pathsep.join(path), PYTHONUNBUFFERED="1", **{PRELOAD_ENV: ",".join(PRELOAD)},
                   # OpenBLAS (numpy's) starts its threads at import; a process that forks must have none
                   OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
                   # torch.cuda.is_available() by NVML, not cuInit: the helper must not touch CUDA
                   PYTORCH_NVML_BASED_CUDA_CHECK="1")
        env.pop("PYTEST_CURRENT_TEST", None)
        # Run as a script, not `-m zeronb.pool.forkserver` (which would import the package, and torch,
        # before forking). The first process only forks the helper and exits (reaped here at once):
        # the helper is nobody's child but init's, in its own session.
        launcher = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
                                    pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self._sock = mine
        self._lock = threading.Lock()
        self.pid = None
        launcher.wait()

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Block until the helper has imported everything (the first time only)."""
        if self.pid is not None:
            return
        with self._lock:
            if self.pid is not None:
                return
            if not select.select([self._sock], [], [], timeout)[0]:
                self.close()
                raise RuntimeError(f"zeronb: the helper process did not finish importing torch within {timeout:.0f} s")
            msg, _ = _recv(self._sock)
            if msg is None or msg[0] != "ready":
                self.close()
                detail = msg[1] if msg else "it exited (its error, if any, is on the notebook server's stderr)"
                raise RuntimeError(f"zeronb: the helper process that forks the ranks failed to start: {detail}")
            self.pid = msg[1]

    def alive(self) -> bool:
        """False once the helper has exited: its end of the socket is closed, so ours reads EOF
        (a "ready" message not yet read is data, not EOF)."""
        if self._sock is None:
            return False
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def fork(self, env: dict, cwd: str, path: list, authkey: bytes) -> RankProcess:
        """Fork one rank: it runs `zeronb.pool._worker.main` with this environment, directory and
        import path, writing its output into pipes this process reads."""
        self.wait_ready()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        status_r, status_w = os.pipe()
        try:
            with self._lock:
                try:
                    _send(self._sock, ("fork", env, cwd, path, authkey), [out_w, err_w, status_w])
                    reply, _ = _recv(self._sock)
                except OSError:
                    reply = None
            if reply is None:
                self.close()
                raise HelperGone("the helper process exited")
        except BaseException:
            for fd in (out_r, err_r, status_r):
                os.close(fd)
            raise
        finally:  # the rank has its own copies now; ours would keep the pipes open after it exits
            for fd in (out_w, err_w, status_w):
                os.close(fd)
        return RankProcess(reply[1], out_r, err_r, status_r)

    def close(self) -> None:
        """Closing our end makes the helper exit (and with it any rank it still has)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def import_path() -> list[str]:
    """Where a rank imports from: this zeronb first, then what the notebook can import (its own
    modules too: functions from importable modules are pickled by reference)."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (above zeronb/pool/)
    paths = [here] + [os.path.abspath(p or os.getcwd()) for p in sys.path]
    return list(dict.fromkeys(p for p in paths if os.path.isdir(p)))


def _stamp(env: dict) -> tuple:
    """What the helper's imports depend on: the interpreter, the environment variables read at
    import time, and zeronb's source files (edited while a notebook runs)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # zeronb/, every layer
    sources = []
    for folder, _, files in os.walk(here):
        sources += [(os.path.join(folder, f), os.stat(os.path.join(folder, f)).st_mtime_ns)
                    for f in files if f.endswith(".py")]
    env_part = sorted((k, v) for k, v in env.items()
                      if k.startswith(_IMPORT_TIME_ENV) and k not in _PER_POOL_ENV)
    return sys.executable, tuple(env_part), tuple(sorted(sources))


_helper: ForkServer | None = None
_retired: list = []  # replaced helpers, kept until the process exits (their ranks die with them)
_helper_lock = threading.Lock()


def helper(env: dict | None = None, path: list | None = None, say=print) -> ForkServer:
    """The process's helper, started or replaced when needed; `say` tells the reader why."""
    global _helper
    env = dict(os.environ) if env is None else env
    stamp = _stamp(env)
    with _helper_lock:
        old = _helper
        if old is not None:
            if not old.alive():
                print(f"zeronb: the helper process that forks the ranks (pid {old.pid}) exited; "
                      "starting a new one (the next start imports torch again)", file=sys.stderr, flush=True)
                old.close()
                old = None
            elif old.stamp != stamp:
                why = ("zeronb's source changed" if old.stamp[2] != stamp[2]
                       else "environment variables read at import time changed")
                say(f"starting a new helper process for the ranks: {why} since the last one started")
                _retired.append(old)  # not closed: ranks of pools still running are its children
                old = None
        if old is None:
            _helper = ForkServer(env, path or import_path())
        return _helper


def prestart() -> None:
    """Start the helper now, in the background, so that its import of torch overlaps with the
    notebook's own work before the first `zeronb.start`."""
    try:
        helper(say=lambda text: None)
    except Exception:  # the first start will try again, and say what failed
        pass


def close() -> None:
    """Close every helper of this process (any rank they still have dies with it)."""
    global _helper
    with _helper_lock:
        for server in [_helper, *_retired]:
            if server is not None:
                server.close()
        _helper = None
        _retired.clear()


# --- the helper's side ------------------------------------------------------------------------

def serve(fd: int) -> None:
    """The helper: import, then fork a rank for each request and reap the ranks as they exit."""
    import importlib
    import traceback

    sock = socket.socket(fileno=fd)
    try:
        for name in os.environ.get(PRELOAD_ENV, ",".join(PRELOAD)).split(","):
            try:
                importlib.import_module(name)
            except ImportError:
                if name in _REQUIRED:
                    raise
    except BaseException:
        _send(sock, ("error", traceback.format_exc()))
        return
    import gc

    gc.freeze()  # objects from the imports stay put: the ranks' collector won't copy their pages

    # SIGCHLD wakes the loop below through a pipe, so that an exit is reported at once
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the notebook stops us: by closing the socket
    status_fds: dict[int, int] = {}
    try:
        _send(sock, ("ready", os.getpid()))
    except OSError:  # the process that started us has gone already (a kernel that ran one cell): nothing to serve
        return

    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
            _reap(status_fds)
        if sock in readable:
            try:
                msg, fds = _recv(sock, maxfds=3)
            except OSError:
                msg, fds = None, []
            if msg is None:
                return  # the notebook is gone: exiting kills every rank we forked
            _, env, cwd, path, authkey = msg
            pid = _fork(sock, fds, (wake_r, wake_w), status_fds, env, cwd, path, authkey)
            _send(sock, ("forked", pid))


def _reap(status_fds: dict) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = status_fds.pop(pid, None)
        if fd is not None:
            os.write(fd, b"%d\n" % os.waitstatus_to_exitcode(status))
            os.close(fd)


def _fork(sock, fds, wake, status_fds, env, cwd, path, authkey) -> int:
    out_w, err_w, status_w = fds
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            others = [sock.fileno(), *wake, *status_fds.values(), status_w]
            _become_rank(parent, out_w, err_w, others, env, cwd, path, authkey)
        finally:
            os._exit(70)  # a rank never returns into the helper's loop
    os.close(out_w)
    os.close(err_w)
    status_fds[pid] = status_w
    return pid


def _become_rank(parent, out_w, err_w, others, env, cwd, path, authkey) -> None:
    os.setsid()  # its own session: Jupyter's interrupt is for the kernel, not the ranks
    if sys.platform.startswith("linux"):  # die with the helper, even mid-call
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the helper died before the line above
        os._exit(70)
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL if sig == signal.SIGCHLD else signal.default_int_handler)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    for fd in (devnull, out_w, err_w, *others):
        os.close(fd)
    os.environ.clear()
    os.environ.update(env, ZERONB_PARENT_PID=str(parent))
    os.chdir(cwd)
    sys.path[:0] = [p for p in path if p not in sys.path]
    if "numpy" in sys.modules:  # `random` reseeds itself in a fork; numpy's global generator does not
        sys.modules["numpy"].random.seed()

    from zeronb.pool import _worker  # (deferred: a script's own folder is not on the path; PRELOAD imported it)

    _worker.main(authkey)


if __name__ == "__main__":
    # Started by ForkServer as a script: its folder, zeronb/pool/, is not a place to import from (the
    # package is, through PYTHONPATH). Fork once more and let the first process exit, so that the
    # helper is not the notebook's child (the notebook keeps no process of its own between pools).
    del sys.path[0]
    if os.fork() == 0:
        os.setsid()
        serve(int(sys.argv[1]))
    os._exit(0)
