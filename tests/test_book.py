"""The rendered book builds from scratch with warnings as errors, running every chapter."""
import re

import pytest

from conftest import ROOT, toc_files as _toc_files


def test_every_notebook_is_in_the_toc_and_stripped():
    import nbformat

    listed = set(_toc_files())
    for nb_path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert f"notebooks/{nb_path.stem}" in listed, f"{nb_path.name} is not in _toc.yml"
        nb = nbformat.read(nb_path, 4)
        assert nb.metadata["kernelspec"]["name"] == "python3"
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{nb_path.name}: stored outputs"


@pytest.fixture(scope="module")
def built(built_book):
    return built_book


def test_book_builds_every_page(built):
    for f in _toc_files():
        assert (built / f"{f}.html").exists(), f


def test_chapter_pages_show_real_output(built):
    html = (built / "notebooks" / "01_ranks.html").read_text()
    assert "[rank 0]" in html and "[rank 3]" in html   # output printed by the ranks themselves
    assert "RankError" in html                           # the failing cell rendered its error
    assert "{glue" not in html and "glue:text" not in html  # every glued number was filled in
    text = re.sub(r"<[^>]+>", "", html)
    assert re.search(r"Starting the pool took \d+\.\d seconds", text)
