"""Write the first code cell of every chapter from one place: `repository` in _config.yml.

A chapter opened on its own (Colab, JupyterLab on a GPU box) installs zeronb in that cell, from
the repository the book is built from; ZERONB_SOURCE, set where the notebook runs, points it
elsewhere (a local checkout, a wheel). Run this after changing the repository in _config.yml:

    .venv/bin/python scripts/sync_notebooks.py          (tests/test_book.py checks it was run)
"""
import json
import pathlib
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]

TEMPLATE = '''\
# Opened on its own (Colab, JupyterLab on a GPU box)? This installs zeronb first, and DeepSpeed, whose
# ZeRO several chapters run beside zeronb's; where zeronb is installed already, it does nothing. Set
# ZERONB_SOURCE to install zeronb from elsewhere (a checkout, a wheel).
import importlib.util
import os

if importlib.util.find_spec("zeronb") is None:
    source = os.environ.get("ZERONB_SOURCE", "zeronb @ git+{url}@{branch}")
    %pip install --quiet "{{source}}" "deepspeed>=0.16"

import zeronb  # now: it starts the helper process the ranks are forked from while the rest imports'''


def first_cell_source() -> str:
    repo = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]
    return TEMPLATE.format(url=repo["url"], branch=repo.get("branch", "main"))


def main() -> int:
    source = first_cell_source().splitlines(keepends=True)
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(path.read_text())
        cell = next(c for c in nb["cells"] if c["cell_type"] == "code")
        if cell["source"] != source:
            cell["source"] = source
            path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
            print(f"updated {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
