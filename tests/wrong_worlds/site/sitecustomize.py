"""Plants a wrong world in this Python process: the one named in $ZERONB_WRONG_WORLD, if any.

The harness (tests/wrong_worlds/harness.py) puts this folder first on PYTHONPATH of a chapter's kernel.
Python imports `sitecustomize` at start-up, so the fault is planted before the chapter imports
anything - in the kernel, and in every process the pool starts from it: the helper that forks the
ranks inherits the kernel's import path, and the ranks are forks of the helper. zeronb's own code
is not changed; the fault is a patch applied to it as it is imported."""
import os

if os.environ.get("ZERONB_WRONG_WORLD"):
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # tests/: the wrong_worlds package
    from wrong_worlds import planting

    planting.plant(os.environ["ZERONB_WRONG_WORLD"])
