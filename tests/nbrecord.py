"""Every chapter runs once in the suite: nbval executes it as a test, and this plugin keeps what its
cells printed, drew and glued, so that the suite's book build renders those outputs instead of
running every chapter a second time.

The outputs are built the way Jupyter Book's own execution builds them: every message a cell's
execution sends is handed to nbclient's `NotebookClient.process_message` (myst-nb executes with
nbclient), which also keeps the widgets' state and routes what is displayed inside an Output widget
into it. The client only listens: nothing is sent to the kernel. A chapter with a failed cell, or
one nbval did not run, is not taken: the book build executes it itself (`executed_notebooks`).
"""
from __future__ import annotations

import copy
import pathlib
from types import SimpleNamespace

import pytest


def _is_nbval_cell(item) -> bool:
    return type(item).__name__ == "IPyNbCell" and type(item).__module__.startswith("nbval")


class _Recording:
    """One notebook's executed copy, filled in as nbval runs its cells."""

    def __init__(self, collector):
        from jupyter_client.session import Session
        from nbclient import NotebookClient

        self.nb = copy.deepcopy(collector.nb)
        for cell in self.nb.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        self.client = NotebookClient(self.nb, record_timing=False)
        self.client.reset_execution_trackers()  # what execute() would set up: widget state, display ids
        # an Output widget answers the kernel with its new state: here nobody listens to the answer
        self.client.kc = SimpleNamespace(session=Session(), shell_channel=SimpleNamespace(send=lambda msg: None))
        self.index = {id(cell): i for i, cell in enumerate(collector.nb.cells)}
        self.failed = False
        self.current = None  # (msg_id of the running cell's execute request, its index)
        self._hook(collector)

    def _hook(self, collector):
        kernel, read = collector.kernel, collector.get_kernel_message
        execute = kernel.execute_cell_input

        def execute_cell_input(source, *args, **kwargs):
            msg_id = execute(source, *args, **kwargs)
            self.current = (msg_id, self.current[1])
            return msg_id

        def get_kernel_message(*args, **kwargs):
            msg = read(*args, **kwargs)
            self.take(msg)
            return msg

        kernel.execute_cell_input = execute_cell_input
        collector.get_kernel_message = get_kernel_message

    def start(self, cell) -> None:
        """A cell is about to run (what nbclient does before it executes one)."""
        self.current = (None, self.index[id(cell)])
        self.client.clear_before_next_output = False

    def take(self, msg) -> None:
        from nbclient.exceptions import CellExecutionComplete

        if self.current is None or msg["parent_header"].get("msg_id") != self.current[0]:
            return
        i = self.current[1]
        try:
            self.client.process_message(msg, self.nb.cells[i], i)
        except CellExecutionComplete:
            pass
        except Exception as e:  # a recording that went wrong must not fail the test: the build runs the chapter
            self.failed = True
            print(f"nbrecord: cell {i}: {type(e).__name__}: {e}")

    def notebook(self):
        self.client.set_widgets_metadata()
        return self.nb


class _Unrecorded:
    failed = True

    def start(self, cell):
        pass


class NotebookRecorder:
    """The pytest plugin: `recordings` maps a notebook's path to its executed copy."""

    def __init__(self):
        self.recordings: dict = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        if _is_nbval_cell(item):
            collector = item.parent
            path = str(pathlib.Path(str(collector.fspath)).resolve())
            try:
                if path not in self.recordings:
                    self.recordings[path] = _Recording(collector)
                self.recordings[path].start(item.cell)
            except Exception as e:  # nbval changed inside: record nothing, the build runs the chapter
                print(f"nbrecord: cannot record {path}: {type(e).__name__}: {e}")
                self.recordings[path] = _Unrecorded()
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        if _is_nbval_cell(item) and outcome.get_result().failed:
            recording = self.recordings.get(str(pathlib.Path(str(item.parent.fspath)).resolve()))
            if recording is not None:
                recording.failed = True

    def executed(self) -> dict:
        """{notebook path: executed notebook} for every notebook whose cells all passed."""
        return {path: r.notebook() for path, r in self.recordings.items() if not r.failed}
