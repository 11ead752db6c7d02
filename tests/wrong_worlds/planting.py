"""Applying a wrong world's fault to zeronb as it is imported, in whichever process imports it.

    when_imported("zeronb.shards", lambda m: setattr(m, "padded_numel", ...))

A patch runs right after its module has executed and before the module that imported it goes on,
so names others import from it (`from .shards import padded_numel`) are the patched ones."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_patches: dict[str, list] = {}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds a patched module with the other finders, and wraps its loader to patch it once loaded."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            for patch in _patches.get(fullname, []):
                patch(module)

        spec.loader.exec_module = exec_module
        return spec


def when_imported(module: str, patch) -> None:
    """Call `patch(module)` once `module` is imported (at once if it already is)."""
    if module in sys.modules:
        patch(sys.modules[module])
        return
    _patches.setdefault(module, []).append(patch)
    if not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())


def replace(module: str, name: str, make):
    """Replace `module.name` with `make(original)` once `module` is imported."""
    when_imported(module, lambda m: setattr(m, name, make(getattr(m, name))))


def plant(name: str) -> None:
    """Plant the wrong world called `name` (a key of wrong_worlds.WORLDS) in this process."""
    from . import WORLDS

    if name not in WORLDS:
        raise SystemExit(f"no wrong world called {name!r}; there are: {', '.join(sorted(WORLDS))}")
    WORLDS[name].plant()


def averaging_over(stage_class: str, ranks):
    """Make the stages of `stage_class` (a class of zeronb.zero; "FlatStage" for all of zeronb's own)
    average their gradients over `ranks(stage)` ranks instead of all the ranks whose gradients are
    averaged."""
    module = "zeronb.zero.flat" if stage_class == "FlatStage" else f"zeronb.zero.{stage_class.lower()}"

    def patch(m):
        cls = getattr(m, stage_class)
        init = cls.__init__

        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.data_parallel = ranks(self)
        cls.__init__ = __init__
    when_imported(module, patch)


def reduce_scatter(stage, bucket, grads=None) -> None:
    """What a zeronb stage's post_backward does with a complete bucket: reduce-scatter its gradients
    (or `grads`) into the bucket's gradient shard, as the stage's config says."""
    bucket.reduce_scatter_grads(stage.data_parallel, grads, dtype=stage.config.reduce_dtype, group=stage.shard_group,
                                ring=stage.config.reduce_scatter == "ring")
