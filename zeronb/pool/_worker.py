"""One rank of a zeronb pool: what a process forked by `forkserver.py` runs, `main(authkey)`.

It joins the process group once, then loops: receive a function (or a %%ranks cell) over the
authenticated control channel, run it, send back the result or the exception. Everything it prints,
from Python or from C++, goes to its stdout/stderr pipes; after each call it writes an end marker to
both, so the notebook knows when it has all of a call's output.

A rank's own safety net: it exits when its parent, the helper process, goes away (which the helper
does when the notebook does, even if the kernel was SIGKILLed), and it dumps its Python stack to a file on SIGUSR1, which is how the notebook shows
where a blocked rank is stuck.
"""
import os
import sys

from zeronb.pool.messages import Hello, Reply, end_marker

def _die_with_parent(parent_pid: int) -> None:
    """Exit as soon as the parent process is gone, even while user code holds the main thread
    (on Linux the kernel's PR_SET_PDEATHSIG, set at the fork, is quicker; this is the backup)."""
    import threading
    import time

    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(70)
            time.sleep(0.2)

    threading.Thread(target=watch, name="zeronb-parent-watch", daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before the thread started
        os._exit(70)


def _flush_all(call_id: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:  # C/C++ stdio buffers (printf from an extension) go out before the marker too
        import ctypes
        ctypes.CDLL(None).fflush(None)
    except Exception:
        pass
    marker = end_marker(call_id)
    os.write(1, marker)
    os.write(2, marker)


def _frames(tb) -> list:
    import traceback

    frames = []
    for f in traceback.extract_tb(tb):
        if f.filename == __file__:  # our own dispatch frame is noise to the reader
            continue
        frames.append((f.filename, f.lineno, f.name, f.line or ""))
    return frames


def describe_exception(exc: BaseException) -> list:
    """The exception chain as plain data (class names, messages, frames), so that the notebook can
    show it even when the exception object itself cannot be unpickled there."""
    import traceback

    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__cause__ is not None:
            link, nxt = "cause", exc.__cause__
        elif exc.__context__ is not None and not exc.__suppress_context__:
            link, nxt = "context", exc.__context__
        else:
            link, nxt = None, None
        chain.append({
            "type": type(exc).__name__,
            "message": "".join(traceback.format_exception_only(type(exc), exc)).rstrip("\n"),
            "frames": _frames(exc.__traceback__),
            "link": link,  # how the *next* (older) exception relates to this one
        })
        exc = nxt
    return chain[::-1]  # oldest first, as Python prints them


def _to_cpu(value):
    """Results come back to the notebook on the CPU: a CUDA tensor would make the notebook
    initialise CUDA on GPU 0 just to unpickle it."""
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) and x.device.type != "cpu" else x, value)


def _run_cell(source: str, filename: str, namespace: dict):
    """Run a %%ranks cell in this rank's namespace; like IPython, return the last expression's value."""
    import ast

    tree = ast.parse(source, filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, filename, "exec"), namespace)
    return eval(compile(last, filename, "eval"), namespace) if last is not None else None


def _init_group(backend: str, store, rank: int, world_size: int) -> None:
    from datetime import timedelta

    from zeronb.runtime.backend import join_group, rank_device  # (deferred, as torch: see main)

    timeout = timedelta(seconds=float(os.environ.get("ZERONB_PG_TIMEOUT", "1800")))
    join_group(backend, rank_device(backend, rank), store=store, rank=rank, world_size=world_size,
               timeout=timeout)


def main(authkey: bytes) -> None:
    """Run rank $RANK of the pool. Configuration comes from the environment (set by cluster.py);
    the control channel's key is passed in, never through the environment (other users can read
    that in /proc)."""
    import faulthandler
    import signal

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    sys.stdin = open(os.devnull)  # input() in a rank gets EOF at once instead of hanging the call
    _die_with_parent(int(os.environ["ZERONB_PARENT_PID"]))

    faulthandler.enable(file=sys.stderr, all_threads=False)  # a segfault's Python stack, into stderr
    stack_file = open(os.environ["ZERONB_STACK_FILE"], "a")  # append: the parent truncates it
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)

    import pickle
    import socket
    from datetime import timedelta
    from multiprocessing.connection import Client

    import cloudpickle
    import torch
    import torch.distributed as dist

    threads = os.environ.get("ZERONB_THREADS")
    if threads:
        torch.set_num_threads(int(threads))

    conn = Client((os.environ["ZERONB_HOST"], int(os.environ["ZERONB_PORT"])), authkey=authkey)
    conn.send(Hello(rank, os.getpid()))

    backend = os.environ["ZERONB_BACKEND"]
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timedelta(seconds=60))
    _init_group(backend, store, rank, world_size)
    links_at = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    from zeronb.runtime.links import start_links  # (deferred, as torch above: the process is set up first)

    start_links(links_at, rank)  # on several nodes: which link leads where, and its pacing
    _flush_all(0)
    conn.send(Reply("ready", 0, {"pid": os.getpid(), "host": socket.gethostname(), "backend": backend,
                                 "torch": torch.__version__}))

    namespace = {"__name__": "__rank__", "__builtins__": __builtins__}  # %%ranks cells share it
    while True:
        try:
            kind, call_id, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the notebook closed the channel: shut down
        if kind == "exit":
            break
        if kind == "ping":  # the notebook asks whether this process is still there (a call failed)
            conn.send(Reply("ready", call_id))
            continue
        if kind == "regroup":
            # A call destroyed the process group (as scripts written for torchrun do at their
            # end). Join a new one; its keys get their own prefix in the store, away from the
            # old group's. The notebook asks every rank at once, so they all arrive.
            if dist.is_initialized():
                dist.destroy_process_group()
            _init_group(backend, dist.PrefixStore(f"regroup{payload}/", store), rank, world_size)
            start_links(links_at, rank)
            _flush_all(call_id)
            conn.send(Reply("ready", call_id))
            continue
        try:
            if kind == "call":
                fn, args, kwargs = cloudpickle.loads(payload)
                value = fn(*args, **kwargs)
            else:  # "cell"
                source, filename = payload
                value = _run_cell(source, filename, namespace)
            try:
                reply = Reply("ok", call_id, cloudpickle.dumps(_to_cpu(value)))
            except Exception as e:
                reply = Reply("unpicklable", call_id, f"{type(value).__module__}.{type(value).__qualname__}: {e}")
        except BaseException as e:  # SystemExit and KeyboardInterrupt are reported too
            reply = Reply("error", call_id, describe_exception(e))
        _flush_all(call_id)
        try:
            conn.send(reply._replace(group_alive=dist.is_initialized()))
        except (EOFError, OSError):
            break

    try:
        dist.destroy_process_group()
    except Exception:
        pass
    _flush_all(-1)
    os._exit(0)  # skip interpreter teardown: nothing left to clean, and it can hang on gloo threads
