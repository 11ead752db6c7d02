"""The rendered book in a real browser (headless Chromium, driven by Playwright), as a reader with no
internet access meets it: every page loads without console errors and without asking any other host
for anything; math is typeset; widgets and animation controls render; a screenshot of every page is
saved in _build/screenshots/ for a person to look at (the whole page)."""
import functools
import http.server
import shutil
import threading
from urllib.parse import urlparse

import pytest

from conftest import ROOT, toc_files

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian package chromium)"),
              pytest.mark.timeout(3600)]  # may be the one that builds the book

# Chromium's own background chatter is switched off, so that every request we see is the page's
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


@pytest.fixture(scope="module")
def site(built_book):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(built_book))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def pages(site):
    """Visit every page once; return what happened on each."""
    from playwright.sync_api import sync_playwright

    shots = ROOT / "_build" / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    seen = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        for f in toc_files():
            page = context.new_page()
            errors, outside = [], []
            page.on("console", lambda m, errors=errors: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))

            def route(r, outside=outside):
                if urlparse(r.request.url).hostname in ("127.0.0.1", None):
                    return r.continue_()
                outside.append(r.request.url)  # no network: refuse, as an air-gapped machine would
                return r.abort()

            page.route("**/*", route)
            page.goto(f"{site}/{f}.html", wait_until="load")
            page.wait_for_timeout(1500)  # MathJax and the widget manager render after load
            info = page.evaluate("""() => ({
                math_source: document.querySelectorAll('.math, span.math, div.math').length,
                math_typeset: document.querySelectorAll('mjx-container').length,
                raw_tex: /\\$\\$|\\\\\\(|\\\\\\[/.test(document.querySelector('main')?.innerText || ''),
                widgets: document.querySelectorAll('.jupyter-widgets, .widget-slider, .widget-image').length,
                widget_views: document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]').length,
                animations: document.querySelectorAll('.animation input[type=range], .anim-buttons').length,
                title: document.title,
                figures: document.querySelectorAll('img').length,
                top_bar: document.querySelector('#pst-header')?.offsetHeight || 0,
            })""")
            # the whole page, figures and all, for a person to read through (a few MB each)
            page.screenshot(path=str(shots / f"{f.replace('/', '_')}.png"), full_page=True)
            seen[f] = dict(info, errors=errors, outside=outside)
            page.close()
        browser.close()
    return seen


def test_no_page_reaches_the_internet(pages):
    for f, info in pages.items():
        assert not info["outside"], f"{f} asked other hosts for: {info['outside'][:5]}"


def test_no_console_errors(pages):
    for f, info in pages.items():
        assert not info["errors"], f"{f}: {info['errors'][:5]}"


def test_math_is_typeset(pages):
    with_math = [f for f, info in pages.items() if info["math_source"]]
    assert with_math, "no page has math?"
    for f in with_math:
        assert pages[f]["math_typeset"] > 0, f"{f}: math left as TeX"
        assert not pages[f]["raw_tex"], f"{f}: raw TeX delimiters in the text"


def test_widgets_and_animations_render(pages):
    with_widgets = [f for f, info in pages.items() if info["widget_views"]]
    assert with_widgets, "no page embeds a widget?"
    for f in with_widgets:
        assert pages[f]["widgets"] > 0, f"{f}: widget state saved but nothing rendered"
    assert pages["notebooks/04_ring"]["animations"] > 0, "the ring animation has no controls"


def test_every_page_has_a_title(pages):
    for f, info in pages.items():
        assert info["title"] and not info["title"].startswith("<no title>"), f


def test_no_bar_across_the_top(pages):
    # pydata-sphinx-theme 0.17 adds one (a second search box) unless navbar_persistent is set empty
    for f, info in pages.items():
        assert info["top_bar"] == 0, f"{f}: a {info['top_bar']} px bar across the top of the page"
