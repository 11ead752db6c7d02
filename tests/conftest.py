"""Fixtures shared by the book tests: one clean build of the whole book per test session."""
import os
import pathlib
import subprocess
import sys

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
def built_book(tmp_path_factory):
    """Build the book from scratch (every chapter executed), warnings as errors; the HTML folder.
    ZERONB_BOOK_HTML=path reuses a build instead (for working on the page tests)."""
    if os.environ.get("ZERONB_BOOK_HTML"):
        return pathlib.Path(os.environ["ZERONB_BOOK_HTML"])
    out = tmp_path_factory.mktemp("book")
    jb = pathlib.Path(sys.executable).with_name("jupyter-book")
    p = subprocess.run([str(jb), "build", str(ROOT), "--path-output", str(out), "-W", "-n", "--keep-going"],
                       capture_output=True, text=True, timeout=3600)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-6000:]
    return out / "_build" / "html"
