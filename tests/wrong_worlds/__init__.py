"""The registry of wrong worlds: for every check cell of every chapter, the planted faults it must
reject, and for every exercise checker, the wrong solutions it must reject.

A check counts only if a world where its claim is false makes it fail. A *wrong world* here is a
named fault planted in zeronb (or in torch as zeronb calls it) in the chapter's kernel and in every
rank, without changing zeronb's code: `plant()` patches modules as they are imported (planting.py),
and the harness starts the chapter's kernel with the fault named in $ZERONB_WRONG_WORLD
(site/sitecustomize.py). The chapter then runs as a reader would run it; the check cells named in
`rejected_by` must fail with an AssertionError.

    CHECKS[chapter][check]   what a check cell asserts (cells carry their name in metadata "check")
    WORLDS[name]             World(chapter, breaks, rejected_by, plant)
    solutions.WRONG[checker] the wrong solutions of each exercise checker

    python tests/wrong_worlds/harness.py [chapter ...]   (scripts/wrong_worlds.sh) runs them all
"""
from __future__ import annotations

from typing import Callable, NamedTuple


class World(NamedTuple):
    name: str
    chapter: str                 # the notebook's stem, e.g. "04_ring"
    breaks: str                  # the claim this world makes false, in one sentence
    rejected_by: tuple           # the check cells (metadata "check") that must fail in it
    plant: Callable[[], None]    # run in every process of the chapter: patch zeronb or torch


def _load():
    from . import chapters

    worlds = {}
    for w in chapters.WORLDS:
        if w.name in worlds:
            raise ValueError(f"two wrong worlds are called {w.name!r}")
        worlds[w.name] = w
    return chapters.CHECKS, worlds


CHECKS, WORLDS = _load()
