"""The pool inside a real Jupyter kernel: interrupting a call, and the kernel dying under it."""
import os
import signal
import sys
import time

import psutil
import pytest
from jupyter_client import KernelManager

from conftest import running


@pytest.fixture
def kernel():
    km = KernelManager(kernel_name="python3")
    km.kernel_spec.argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]  # this env
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)


def wait_done(kc, msg_id, timeout=120):
    """Wait for a request to finish; return (reply content, stdout text, error name)."""
    out, ename = [], None
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out.append(content["text"])
        elif kind == "error":
            ename = content["ename"]
        elif kind == "status" and content["execution_state"] == "idle":
            break
    while True:
        reply = kc.get_shell_msg(timeout=10)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"], "".join(out), ename


def execute(kc, code, timeout=120):
    """Run code in the kernel; return (status, stdout text, error name)."""
    reply, out, ename = wait_done(kc, kc.execute(code), timeout)
    return reply["status"], out, ename




def test_interrupting_the_kernel_stops_the_call_and_the_pool_comes_back(kernel):
    km, kc = kernel
    status, out, _ = execute(kc, "import zeronb, time\nc = zeronb.start(2, backend='gloo')\nprint(c.pids)")
    assert status == "ok"
    old_pids = eval(out.splitlines()[-1])
    msg_id = kc.execute("zeronb.run(time.sleep, 60)")
    time.sleep(2)
    t0 = time.monotonic()
    km.interrupt_kernel()
    reply, _, ename = wait_done(kc, msg_id, timeout=20)
    assert time.monotonic() - t0 < 5
    assert reply["status"] == "error" and ename == "KeyboardInterrupt"
    assert not running(old_pids)
    status, out, _ = execute(kc, "print(zeronb.run(lambda: 41 + 1, echo=False))")
    assert status == "ok" and "[42, 42]" in out and "per-rank state" in out


def test_idle_ranks_survive_an_interrupt(kernel):
    """Ranks run in their own session: Jupyter's interrupt does not reach them."""
    km, kc = kernel
    execute(kc, "import zeronb\nc = zeronb.start(2, backend='gloo', verbose=False)\npids = c.pids")
    msg_id = kc.execute("import time; time.sleep(30)")
    time.sleep(1)
    km.interrupt_kernel()
    assert wait_done(kc, msg_id, timeout=20)[2] == "KeyboardInterrupt"
    status, out, _ = execute(kc, "print(c.pids == pids, zeronb.run(lambda: 1, echo=False))")
    assert "True [1, 1]" in out


def test_ranks_exit_when_the_kernel_dies(kernel):
    km, kc = kernel
    status, out, _ = execute(kc, "import zeronb\nprint(zeronb.start(3, backend='gloo', verbose=False).pids)")
    assert status == "ok", out
    pids = eval(out)
    procs = [psutil.Process(p) for p in pids]
    assert all(p.is_running() for p in procs)
    os.kill(km.provisioner.process.pid, signal.SIGKILL)  # SIGKILL: no atexit, no cleanup, nothing but the ranks' own watch
    t0 = time.monotonic()
    while running(pids) and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    assert not running(pids), f"ranks still alive after the kernel died: {running(pids)}"
    assert time.monotonic() - t0 < 2


def test_importing_zeronb_in_a_kernel_starts_the_helper_which_dies_with_the_kernel(kernel):
    km, kc = kernel
    status, out, _ = execute(kc, "import zeronb\nfrom zeronb.pool import forkserver\n"
                                 "h = forkserver._helper\nh.wait_ready()\nprint(h.pid)")
    assert status == "ok", out  # forkserver._helper is None unless the import started it
    helper = int(out)
    # started at import, before any pool: a detached process, not the kernel's child
    assert helper not in [p.pid for p in psutil.Process(km.provisioner.process.pid).children(recursive=True)]
    status, out, _ = execute(kc, "c = zeronb.start(2, backend='gloo', verbose=False)\nprint(c.helper_pid, *c.pids)")
    assert status == "ok", out
    pids = [int(p) for p in out.split()]
    assert pids[0] == helper and len(running(pids)) == 3
    os.kill(km.provisioner.process.pid, signal.SIGKILL)
    t0 = time.monotonic()
    while running(pids) and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    assert not running(pids), f"helper or ranks still alive after the kernel died: {running(pids)}"
