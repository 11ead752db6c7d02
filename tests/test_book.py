"""The rendered book builds from scratch with warnings as errors, running every chapter."""
import re
import subprocess
import sys

import pytest

from conftest import ROOT, toc_files as _toc_files

# the first test here builds the whole book (every chapter executed): more than the usual per-test limit
pytestmark = pytest.mark.timeout(3600)


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


def test_a_chapter_opened_alone_installs_zeronb_from_the_configured_place_and_needs_no_myst_nb():
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("sync_notebooks", ROOT / "scripts" / "sync_notebooks.py")
    sync = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sync)
    want = sync.first_cell_source()
    assert "ZERONB_SOURCE" in want and "git+https://github.com/" in want
    for nb_path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = [c for c in json.loads(nb_path.read_text())["cells"] if c["cell_type"] == "code"]
        assert "".join(cells[0]["source"]) == want, f"{nb_path.name}: run scripts/sync_notebooks.py"
        assert not any("myst_nb" in "".join(c["source"]) for c in cells), f"{nb_path.name} imports myst_nb"


def test_every_table_a_chapter_builds_is_displayed():
    """zeronb.book.display.table returns an HTML object: Jupyter shows it only as a cell's last expression,
    so one built anywhere else must go through display() or it vanishes from the page."""
    import ast
    import json

    hidden = []
    for nb_path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(nb_path.read_text())["cells"]):
            if cell["cell_type"] != "code":
                continue
            source = "\n".join("pass" if line.lstrip().startswith("%") else line
                               for line in "".join(cell["source"]).split("\n"))
            tree = ast.parse(source)
            last = tree.body[-1] if tree.body else None
            for node in ast.walk(tree):
                if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and node is not last \
                        and getattr(node.value.func, "id", None) == "table":
                    hidden.append(f"{nb_path.name} cell {i}, line {node.lineno}")
    assert not hidden, "tables built but never shown (wrap them in display()): " + "; ".join(hidden)


def test_glue_without_myst_nb_shows_the_value_or_nothing(monkeypatch, capsys):
    from zeronb.book import glue as glue_module

    monkeypatch.setattr(glue_module, "_myst_glue", None)
    glue_module.glue("x", 42, display=False)
    assert capsys.readouterr().out == ""
    glue_module.glue("x", 42)
    assert capsys.readouterr().out.strip() == "42"


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


def test_no_dead_internal_links(built):
    """Every link from one page of the book to another (and to an anchor in it) lands somewhere."""
    from html.parser import HTMLParser
    from urllib.parse import unquote, urldefrag, urlparse

    class Page(HTMLParser):
        def __init__(self):
            super().__init__()
            self.links, self.ids = [], set()

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if "id" in a:
                self.ids.add(a["id"])
            if tag == "a" and a.get("href"):
                self.links.append(a["href"])

    pages = {}
    for html in built.rglob("*.html"):
        p = Page()
        p.feed(html.read_text(errors="replace"))
        pages[html.resolve()] = p
    dead = []
    for src, page in pages.items():
        if "_static" in src.parts or src.name in ("search.html", "genindex.html"):
            continue
        for href in page.links:
            if urlparse(href).scheme or href.startswith(("mailto:", "javascript:")):
                continue  # external links cannot be checked without a network
            path, frag = urldefrag(href)
            target = (src.parent / unquote(path)).resolve() if path else src
            if target.is_dir():
                target = target / "index.html"
            if target not in pages and not target.exists():
                dead.append(f"{src.relative_to(built.resolve())}: {href} (no such file)")
            elif frag and target in pages and unquote(frag) not in pages[target].ids:
                dead.append(f"{src.relative_to(built.resolve())}: {href} (no such anchor)")
    assert not dead, "\n".join(dead[:20])


def test_every_figure_is_numbered_and_captioned(built):
    """Each plot, the ring animation and each widget sits in a numbered figure with a caption, and
    each image has alt text that says what it shows (not its file name)."""
    from bs4 import BeautifulSoup

    figures, bad = 0, []
    for f in _toc_files():
        soup = BeautifulSoup((built / f"{f}.html").read_text(), "html.parser")
        article = soup.select_one("article") or soup
        shown = article.select(".cell_output img, .cell_output .animation, "
                               ".cell_output script[type='application/vnd.jupyter.widget-view+json']")
        for out in shown:
            if out.name == "img" and out.find_parent(class_="animation"):
                continue  # a frame of the animation: the animation itself is the figure
            what = f"{f}: {out.name} {out.get('src', '')[-24:]}"
            figure = out.find_parent("figure")
            caption = figure and figure.find("figcaption")
            number = caption and caption.select_one(".caption-number")
            if not (number and number.get_text().startswith("Fig.")):
                bad.append(f"{what}: not in a numbered figure")
            elif not caption.select_one(".caption-text").get_text(strip=True):
                bad.append(f"{what}: empty caption")
            if out.name == "img" and (not out.get("alt") or out["alt"].endswith(".png")):
                bad.append(f"{what}: no alt text")
            figures += 1
    assert figures >= 30, f"only {figures} figures in the whole book?"
    assert not bad, "\n".join(bad[:20])


# A small notebook made of what the chapters' outputs are made of: text, rich displays, a glued value,
# widgets with an Output widget drawn into, stderr, and an error the page shows on purpose.
_SMALL = [
    ("print('hello from the kernel')", []),
    ("from IPython.display import HTML, display\ndisplay(HTML('<b>a table</b>'))\n6 * 7", []),
    ("from zeronb.book.glue import glue\nglue('answer', 42, display=False)", []),
    ("import ipywidgets as w\nout = w.Output()\nwith out:\n    display(HTML('<i>drawn inside</i>'))\n"
     "w.VBox([w.IntSlider(3), out])", []),
    ("import sys\nprint('to stderr', file=sys.stderr)", []),
    ("raise ValueError('shown on the page')", ["raises-exception"]),
]
_RECORD = """import sys, nbformat, pytest
from nbrecord import NotebookRecorder
recorder = NotebookRecorder()
code = pytest.main(["-q", "-p", "no:cacheprovider", "--nbval-lax", "--nbval-current-env", sys.argv[1]],
                   plugins=[recorder])
(nb,) = recorder.executed().values()
nbformat.write(nb, sys.argv[2])
sys.exit(code)
"""


def _outputs(nb):
    def one(o):
        data = {k: v for k, v in o.get("data", {}).items() if "widget-view" not in k}  # model ids are random
        return (o["output_type"], o.get("name"), o.get("text"), data, o.get("ename"), o.get("evalue"))
    return [[one(o) for o in c.outputs] for c in nb.cells]


def _widgets(nb):
    import json

    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    return sorted((w["model_name"], json.dumps(w["state"].get("outputs"), sort_keys=True), w["state"].get("value"))
                  for w in state.values())


def test_nbvals_recorded_run_is_what_jupyter_would_have_saved(tmp_path):
    """The suite's book is rendered from nbval's run of the chapters (tests/nbrecord.py): its
    outputs, glued values and widget state must be those Jupyter's own execution saves (nbclient,
    which myst-nb runs when the book executes a chapter itself)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell(src, metadata={"tags": tags}) for src, tags in _SMALL]
    path = tmp_path / "small.ipynb"
    nbformat.write(nb, path)
    p = subprocess.run([sys.executable, "-c", _RECORD, str(path), str(tmp_path / "recorded.ipynb")],
                       cwd=ROOT / "tests", capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recorded = nbformat.read(tmp_path / "recorded.ipynb", 4)
    executed = nbformat.read(path, 4)
    NotebookClient(executed, allow_errors=True, resources={"metadata": {"path": str(tmp_path)}}).execute()

    assert _outputs(recorded) == _outputs(executed)
    assert _widgets(recorded) == _widgets(executed)
    assert "<i>drawn inside</i>" in str(_widgets(recorded)) and "<i>drawn inside</i>" not in str(_outputs(recorded))
    assert any("answer" in str(o.get("metadata")) for o in recorded.cells[2].outputs)   # the glued value
