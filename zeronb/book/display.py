"""What the chapters show besides figures: small HTML tables, and a piece of zeronb's own source.

Plumbing, not lessons, so that a chapter's cells hold only what they teach.
"""
from __future__ import annotations

import inspect
import os
import textwrap


def table(header, rows):
    """A small HTML table (no pandas needed). Cells are inserted as they are, so they may hold
    markup such as <code> or <b>; anything else is turned into text with str()."""
    from IPython.display import HTML

    th = "".join(f"<th>{h}</th>" for h in header)
    trs = "".join("<tr>" + "".join(f"<td>{v}</td>" for v in row) + "</tr>" for row in rows)
    return HTML(f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>")


def show_source(obj) -> None:
    """Print the source of a function or class of zeronb, with the file and lines it comes from,
    so that a chapter shows the code that really runs rather than a copy of it."""
    lines, start = inspect.getsourcelines(obj)
    start = max(start, 1)  # (a whole module starts at 0)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above zeronb/
    path = os.path.relpath(inspect.getsourcefile(obj), root)
    print(f"# {path}, lines {start}-{start + len(lines) - 1}")
    print(textwrap.dedent("".join(lines)), end="")


def kib(nbytes, digits: int = 1) -> str:
    """A byte count in KiB, as the chapters' tables print it: thousands separated, one decimal."""
    return f"{nbytes / 1024:,.{digits}f}"


NOT_COUNTED = "(not counted: NCCL)"


def wire_text(nbytes, spec: str = "") -> str:
    """A count of bytes on the wire for a table: the number (formatted with spec), or a note when
    the operating system counted nothing (None: NCCL's traffic, or not Linux)."""
    return NOT_COUNTED if nbytes is None else format(nbytes, spec)
