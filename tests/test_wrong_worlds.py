"""Every check must be able to fail: the registry of wrong worlds (tests/wrong_worlds) covers every check
cell of every chapter and every exercise checker, and a sample of its worlds is planted and rejected
here (all of them: scripts/wrong_worlds.sh)."""
import json
import pathlib

import pytest

from wrong_worlds import CHECKS, WORLDS, harness, solutions

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHAPTERS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))


def check_cells(chapter):
    """The code cells of a chapter's "## Checks" section that assert something: (index, cell)."""
    cells = json.loads((ROOT / "notebooks" / f"{chapter}.ipynb").read_text())["cells"]
    start = next(i for i, c in enumerate(cells) if c["cell_type"] == "markdown" and "## Checks" in "".join(c["source"]))
    return [(i, c) for i, c in enumerate(cells) if i > start and c["cell_type"] == "code" and "assert" in "".join(c["source"])]


# Chapters whose check cells are not all in the registry yet: expected to fail (strict: once a chapter
# is covered its test passes, and it must leave this list). Issue 36 is done when the list is empty.
NOT_YET_COVERED: set = set()


@pytest.mark.parametrize("chapter", [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason="not yet covered"))
                                     if c in NOT_YET_COVERED else c for c in CHAPTERS])
def test_every_check_cell_is_named_and_has_a_wrong_world(chapter):
    named = {}
    for i, cell in check_cells(chapter):
        first = "".join(cell["source"]).splitlines()[0]
        assert "check" in cell["metadata"], f"{chapter} cell {i} ({first!r}) has no name: set its metadata 'check'"
        named[cell["metadata"]["check"]] = i
    assert set(named) == set(CHECKS.get(chapter, {})), (chapter, sorted(named), sorted(CHECKS.get(chapter, {})))
    rejecting = {c for w in WORLDS.values() if w.chapter == chapter for c in w.rejected_by}
    assert set(named) <= rejecting, f"{chapter}: no wrong world for {sorted(set(named) - rejecting)}"
    assert rejecting <= set(named), f"{chapter}: worlds name checks that are not there: {sorted(rejecting - set(named))}"


def test_every_checker_has_wrong_solutions_one_per_property():
    from zeronb.book import exercises

    assert set(solutions.WRONG) == set(exercises.__all__) - {"Verdict"}
    for checker, wrongs in solutions.WRONG.items():
        assert len({w.property for w in wrongs}) >= 3, checker
        assert checker in solutions.RIGHT


# A sample that runs in CI (a chapter world takes about as long as the chapter): the planted fault is
# rejected by the checks the registry names, with an AssertionError.
SAMPLE = ["DDP keeps a second copy of its gradients", "a ring that forwards the wrong chunk"]


@pytest.mark.parametrize("name", SAMPLE)
def test_a_planted_world_is_rejected(name):
    world = WORLDS[name]
    ok, by, message = harness.judge(world, harness.run_chapter(world.chapter, name))
    assert ok, (name, by, message)


def test_every_world_patches_names_that_exist():
    """A world whose patch names a function the code no longer has cannot be planted (the chapter then
    runs unchanged, and the harness reports it not rejected, one world at a time, an hour later): read
    each world's `replace(module, name)` and `m.Class.attr` from its source, and look them up now."""
    import importlib
    import re

    missing = []
    for path in sorted((pathlib.Path(__file__).parent / "wrong_worlds" / "chapters").glob("ch*.py")):
        source = path.read_text()
        for module, name in re.findall(r'replace\("([\w.]+)", "(\w+)"', source):
            if not hasattr(importlib.import_module(module), name):
                missing.append(f"{path.name}: {module}.{name}")
        for fn, body in re.findall(r'\ndef (\w+)\(\):\n(.*?)(?=\n\S)', source, re.S):
            for module in re.findall(r'when_imported\("([\w.]+)"', body):
                found = importlib.import_module(module)
                for cls, attr in (re.findall(r'\bm\.(\w+)\.(\w+)\s*[,=]', body) + re.findall(r'=\s*m\.(\w+)\.(\w+)\b', body)
                                  + re.findall(r'setattr\(m\.(\w+), "(\w+)"', body)):
                    if not hasattr(getattr(found, cls, None), attr):
                        missing.append(f"{path.name} {fn}: {module}.{cls}.{attr}")
    assert not missing, "worlds that patch what is not there: " + "; ".join(sorted(set(missing)))
