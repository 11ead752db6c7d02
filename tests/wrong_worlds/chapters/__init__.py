"""The registry's entries, one module per chapter: its check cells (CHECKS) and its wrong worlds (WORLDS).

A world's `plant` runs in every process of the chapter (the kernel and every rank) before zeronb is
imported: it patches zeronb, or torch as zeronb calls it, through planting.replace/when_imported.
Each world breaks one claim a check cell states; a check cell is listed with what it asserts."""
from __future__ import annotations

import importlib
import pkgutil

from .. import World

CHECKS: dict[str, dict[str, str]] = {}
WORLDS: list[World] = []


def chapter(name: str, checks: dict[str, str]) -> None:
    """Register a chapter's check cells: {name (the cell's metadata "check"): what it asserts}."""
    CHECKS[name] = checks


def world(chapter: str, name: str, breaks: str, rejected_by, plant) -> None:
    """Register a wrong world of `chapter`: the claim it `breaks`, the check cells that must reject it."""
    WORLDS.append(World(name, chapter, breaks, tuple([rejected_by] if isinstance(rejected_by, str) else rejected_by),
                        plant))


for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
