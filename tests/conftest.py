"""Shared by the tests: one gloo pool of each size for the whole session, one clean build of the
whole book, and the record of how long each injected fault took to surface (printed as a table at
the end of the run)."""
import os
import pathlib
import subprocess
import sys
import time

import psutil
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]


def toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [c["file"] for c in part["chapters"]]
    return files


@pytest.fixture(scope="session")
def gloo_pool():
    """`gloo_pool(n)`: a running gloo pool of n ranks, started once for the whole session and shared.
    A test must leave it usable: tests that break a pool on purpose, or need other settings, start
    their own. Yet a test that kills the helper process which forks every pool's ranks (test_faults)
    takes the shared pools' ranks with it: a first call finds that out, and the next restarts them."""
    from zeronb import Cluster, RankError

    pools = {}

    def get(n: int):
        if n not in pools or pools[n].closed:
            pools[n] = Cluster(n, backend="gloo", verbose=False)
        else:
            try:
                pools[n].run(int, echo=False, timeout=60)
            except RankError:  # its ranks are gone: the pool restarts them on the next call
                pass
        return pools[n]

    yield get
    for c in pools.values():
        c.close()


def pytest_configure(config):
    from nbrecord import NotebookRecorder

    config.pluginmanager.register(NotebookRecorder(), "zeronb-notebook-recorder")


def pytest_collection_modifyitems(config, items):
    """The tests of the rendered book run last, after nbval has run the chapters: the book is built
    from those runs' outputs (nbrecord), so that no chapter runs twice."""
    items.sort(key=lambda item: "built_book" in getattr(item, "fixturenames", ()))


@pytest.fixture(scope="session")
def built_book(request, tmp_path_factory):
    """The book built from scratch, warnings as errors; the HTML folder. The chapters nbval ran in
    this session without a failure are rendered from that run's outputs; any other chapter is
    executed by the build itself, as `scripts/book.sh` executes them all.
    ZERONB_BOOK_HTML=path reuses a build instead (for working on the page tests)."""
    import shutil

    import nbformat

    if os.environ.get("ZERONB_BOOK_HTML"):
        return pathlib.Path(os.environ["ZERONB_BOOK_HTML"])
    recorder = request.config.pluginmanager.get_plugin("zeronb-notebook-recorder")
    executed = recorder.executed() if recorder else {}
    out = tmp_path_factory.mktemp("book")
    source = out / "source"
    shutil.copytree(ROOT / "book", source / "book")
    shutil.copy(ROOT / "_toc.yml", source)
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    config["execute"]["execute_notebooks"] = "off"
    (source / "_config.yml").write_text(yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
    (source / "notebooks").mkdir()
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = executed.get(str(path.resolve()))
        if nb is None:
            nb = nbformat.read(path, 4)
            nb.metadata["mystnb"] = {"execution_mode": "force"}
        nbformat.write(nb, source / "notebooks" / path.name)
    ran = len(list((ROOT / "notebooks").glob("*.ipynb"))) - len(executed)
    print(f"book: {len(executed)} chapters from nbval's run, {ran} executed by the build")
    jb = pathlib.Path(sys.executable).with_name("jupyter-book")
    p = subprocess.run([str(jb), "build", str(source), "--path-output", str(out), "-W", "-n", "--keep-going"],
                       capture_output=True, text=True, timeout=3600)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-6000:]
    return out / "_build" / "html"


def running(pids):
    """The processes among `pids` that still run (a zombie has exited; only its parent's
    bookkeeping is left)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def listening_addresses(pids) -> list:
    """The address every listening socket of these processes (and their children) is bound to."""
    procs = []
    for pid in pids:
        p = psutil.Process(pid)
        procs += [p, *p.children(recursive=True)]
    return [c.laddr.ip for p in procs for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


FAULT_TIMES: list[tuple[str, float]] = []


def surfaced(what: str, t0: float) -> float:
    """Seconds since t0 (time.monotonic) that a fault took to surface; kept for the end-of-run table."""
    took = time.monotonic() - t0
    FAULT_TIMES.append((what, took))
    return took


def pytest_terminal_summary(terminalreporter):
    # Tests that could not start because a fixture they share failed (a pool that did not come up, a
    # build that broke) would each print the same traceback: name the cause once, with its count.
    causes = {}
    for report in terminalreporter.stats.get("error", []):
        if report.when == "setup":
            crash = getattr(report.longrepr, "reprcrash", None)
            cause = crash.message if crash else str(report.longrepr).strip().splitlines()[-1]
            causes.setdefault(cause, []).append(report.nodeid)
    if causes:
        terminalreporter.section("tests that could not start, by cause", red=True)
        for cause, tests in causes.items():
            terminalreporter.write_line(f"{len(tests)} test(s) could not start, the first {tests[0]}: {cause}")
    if FAULT_TIMES:
        terminalreporter.section("faults: time from the fault to the exception in the caller")
        for what, took in FAULT_TIMES:
            terminalreporter.write_line(f"{took:6.2f} s  {what}")
