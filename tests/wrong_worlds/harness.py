"""Run the chapters in their wrong worlds, and the exercise checkers on their wrong solutions, and
say which check rejected each, with what message.

    python tests/wrong_worlds/harness.py                  every chapter world and every checker
    python tests/wrong_worlds/harness.py 02_shards 04     the worlds of these chapters (a prefix will do)
    python tests/wrong_worlds/harness.py --checkers       the exercise checkers only
    python tests/wrong_worlds/harness.py --world NAME     one world

A chapter runs as nbval runs it (nbclient, a fresh kernel, cells in order), with the world planted
in its kernel and every rank (site/sitecustomize.py) and errors allowed, so that every check cell
runs and says whether it rejected the world. The exit status is 1 if any world was not rejected by
every check its registry entry names."""
from __future__ import annotations

import argparse
import os
import re
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))

from wrong_worlds import WORLDS  # noqa: E402


def check_cells(nb) -> dict:
    """{check name: cell} for the chapter's check cells (metadata "check")."""
    return {c.metadata["check"]: c for c in nb.cells if c.cell_type == "code" and "check" in c.metadata}


def run_chapter(chapter: str, world: str | None, timeout: int = 900) -> dict:
    """Execute the chapter with `world` planted (None: as it is). Returns {"checks": {name: None if it
    passed, else (error name, first line of its message)}, "broke": (cell index, error) of the first
    cell outside the checks that raised unexpectedly, or None, "seconds"}."""
    import nbformat
    from nbclient import NotebookClient

    path = ROOT / "notebooks" / f"{chapter}.ipynb"
    nb = nbformat.read(path, as_version=4)
    env = dict(os.environ, ZERONB_TIMEOUT=os.environ.get("ZERONB_TIMEOUT", "120"))
    env["PYTHONPATH"] = os.pathsep.join([str(HERE / "site")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if world:
        env["ZERONB_WRONG_WORLD"] = world
    else:
        env.pop("ZERONB_WRONG_WORLD", None)
    client = NotebookClient(nb, timeout=timeout, allow_errors=True, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)  # the kernel is started with this process's environment
    try:
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    checks, broke = {}, None
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        name = cell.metadata.get("check")
        if name:
            checks[name] = (errors[0]["ename"], _message(errors[0])) if errors else None
        elif errors and broke is None and "raises-exception" not in cell.metadata.get("tags", []):
            broke = (i, f"{errors[0]['ename']}: {_first_line(errors[0]['evalue'])}")
    return {"checks": checks, "broke": broke, "seconds": time.perf_counter() - t0}


def _message(error: dict) -> str:
    """The error's message, or for a bare assert the line that failed (from the traceback)."""
    if str(error["evalue"]).strip():
        return _first_line(error["evalue"])
    plain = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in error.get("traceback", [])]
    failing = [m.group(1) for block in plain for ln in block.splitlines() if (m := re.match(r"\s*-+>\s*\d+\s(.*)", ln))]
    return _first_line(failing[-1].strip()) if failing else ""


def _first_line(text: str, width: int = 150) -> str:
    line = next((ln for ln in str(text).splitlines() if ln.strip()), "")
    return line if len(line) <= width else line[:width - 1] + "…"


def judge(world, result) -> tuple[bool, str, str]:
    """(rejected as the registry says, the checks that failed, the message)."""
    failed = {name: err for name, err in result["checks"].items() if err is not None}
    asserted = {name for name, (ename, _) in failed.items() if ename == "AssertionError"}
    ok = set(world.rejected_by) <= asserted
    by = ", ".join(sorted(failed)) or "-"
    first = next((failed[name] for name in world.rejected_by if name in failed), None) or next(iter(failed.values()), None)
    message = f"{first[0]}: {first[1]}" if first else ""
    if not ok:
        missing = ", ".join(sorted(set(world.rejected_by) - asserted))
        message = f"NOT REJECTED by {missing}" + (f" (the chapter broke at cell {result['broke'][0]}: "
                                                   f"{result['broke'][1]})" if result["broke"] else "") + \
            (f"; {message}" if message else "")
    return ok, by, message


def run_checkers() -> list[tuple]:
    """One row per wrong solution: (chapter, checker, solution, rejected?, first problem)."""
    import zeronb
    from wrong_worlds import solutions
    from zeronb.book import exercises

    chapters = {"check_all_reduce": "03", "check_ring_all_gather": "04", "check_bucketed_ddp": "07",
                "check_zero1_step": "08", "check_zero2_hooks": "09", "check_zero3_bytes": "10", "check_zero3_unit": "10",
                "check_accumulate_and_clip": "12", "check_hierarchical_all_reduce": "13", "check_hsdp_gradient": "13"}
    zeronb.start(4, backend="gloo", verbose=False)
    rows = []
    try:
        for checker, wrongs in solutions.WRONG.items():
            right = getattr(exercises, checker)(solutions.RIGHT[checker])
            rows.append((chapters.get(checker, "?"), checker, "(a right solution)", right.ok,
                         "accepted" if right.ok else right.problems[0]))
            for w in wrongs:
                v = getattr(exercises, checker)(w.solution, **w.kwargs)
                said = w.says in "\n".join(v.problems)
                rows.append((chapters.get(checker, "?"), checker, w.name, not v.ok and said,
                             v.problems[0] if v.problems else "ACCEPTED (a wrong solution passed)"))
    finally:
        zeronb.shutdown()
    return rows


def table(rows, header) -> str:
    widths = [min(60, max(len(str(r[i])) for r in rows + [header])) for i in range(len(header))]
    out = [" | ".join(str(h).ljust(w) for h, w in zip(header, widths)), "-+-".join("-" * w for w in widths)]
    for r in rows:
        out.append(" | ".join(str(c).ljust(w) if i < len(r) - 1 else str(c) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("chapters", nargs="*", help="chapters (notebook stems or their number) to run; default: all")
    ap.add_argument("--world", action="append", default=[], help="run only this world (repeatable)")
    ap.add_argument("--checkers", action="store_true", help="run the exercise checkers' wrong solutions only")
    ap.add_argument("--no-checkers", action="store_true", help="skip the exercise checkers")
    args = ap.parse_args(argv)
    bad = 0
    if not args.checkers:
        worlds = [w for w in WORLDS.values()
                  if (not args.chapters or any(w.chapter.startswith(c) for c in args.chapters))
                  and (not args.world or w.name in args.world)]
        rows = []
        for w in worlds:
            result = run_chapter(w.chapter, w.name)
            ok, by, message = judge(w, result)
            bad += not ok
            rows.append((w.chapter, ", ".join(w.rejected_by), w.name, by, ("✓ " if ok else "✗ ") + message))
            print(f"[{len(rows)}/{len(worlds)}] {w.chapter} / {w.name}: {'rejected' if ok else 'NOT REJECTED'} "
                  f"({result['seconds']:.0f} s)", file=sys.stderr, flush=True)
        if rows:
            print(table(rows, ("chapter", "check", "wrong world", "rejected by", "message")))
    if (args.checkers or not args.no_checkers) and not args.world and not args.chapters:
        rows = run_checkers()
        bad += sum(not r[3] for r in rows)
        print()
        print(table([(c, k, s, ("✓ " if ok else "✗ ") + m) for c, k, s, ok, m in rows],
                    ("chapter", "checker", "wrong solution", "verdict")))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
