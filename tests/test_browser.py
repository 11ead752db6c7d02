"""The rendered book in a real browser (headless Chromium, driven by Playwright), as a reader with no
internet access meets it: every page loads without console errors and without asking any other host
for anything; math is typeset; animation controls render; chapter 6's calculator answers new inputs
as Python's does and chapter 4's ring explorer shows every frame, with no kernel; a screenshot of
every page is saved in _build/screenshots/ for a person to look at (the whole page)."""
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
            page.wait_for_timeout(1500)  # MathJax and the page's scripts render after load
            page.evaluate("() => window.MathJax && MathJax.startup ? MathJax.startup.promise.then(() => true) : true")
            info = page.evaluate("""() => ({
                math_source: document.querySelectorAll('.math, span.math, div.math').length,
                math_typeset: document.querySelectorAll('mjx-container').length,
                // TeX delimiters left in the prose (code listings may hold them, regular expressions say)
                raw_tex: (() => { const main = document.querySelector('main'); if (!main) return false;
                                  const prose = main.cloneNode(true);
                                  prose.querySelectorAll('pre, code, mjx-container, script, style').forEach(e => e.remove());
                                  return /\\$\\$|\\\\\\(|\\\\\\[/.test(prose.textContent); })(),
                widgets: document.querySelectorAll('.jupyter-widgets, .widget-slider, .widget-image').length,
                widget_views: document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]').length,
                calculators: document.querySelectorAll('[data-zeronb-calc-root]').length,
                ring_explorers: document.querySelectorAll('.zeronb-ring').length,
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


def test_the_explorers_and_animations_render_without_a_kernel(pages):
    """The widgets' outputs render as the page's own explorers (zeronb.book.page), not as saved widget
    state that could not answer; the ring animation has its controls."""
    for f, info in pages.items():
        assert not info["widget_views"], f"{f}: a widget's saved view rendered, which cannot answer without a kernel"
    assert pages["notebooks/06_memory"]["calculators"] == 1, "the memory calculator is not on chapter 6's page"
    assert pages["notebooks/04_ring"]["ring_explorers"] == 1, "the ring explorer is not on chapter 4's page"
    assert pages["notebooks/04_ring"]["animations"] > 0, "the ring animation has no controls"


def _calculator_inputs():
    """At least 20 inputs: the edges (N = 1, stage 0, 1e12 parameters, every precision and optimizer) and
    random ones, from a fixed seed."""
    import random

    from zeronb.book.calculator import OPTIMIZERS
    from zeronb.precision import PRECISIONS

    edges = [("1", 1, 0, "float32", "sgd"), ("1e12", 1, 3, "bf16-mixed", "adam"), ("1e12", 4096, 3, "float64", "adam"),
             ("7.5B", 64, 0, "bf16-mixed", "sgd-momentum"), ("125M", 3, 2, "float32", "sgd-momentum")]
    edges += [("350k", 8, s, p, o) for s in range(4) for p in PRECISIONS for o in OPTIMIZERS][::5]
    rng = random.Random(26)
    sizes = ["7.5B", "125M", "1e12", "350k", "1,000,000", "2.7e9", "13b", "0.5", "1T", "999", "70B", "1_000", "6.7e9"]
    rand = [(rng.choice(sizes), rng.randint(1, 4096), rng.randint(0, 3), rng.choice(list(PRECISIONS)),
             rng.choice(list(OPTIMIZERS))) for _ in range(30)]
    return edges + rand


def _set_calculator(page, values):
    for name, value in zip(("num_params", "world_size", "stage", "precision", "optimizer"), values):
        field = page.locator(f"[data-zeronb-calc={name}]")
        if field.evaluate("e => e.tagName") == "SELECT":
            field.select_option(str(value))  # (fires change)
        else:
            field.fill(str(value))
            field.dispatch_event("change")


@pytest.fixture(scope="module")
def browser_page(site):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page()
        page.route("**/*", lambda r: r.continue_() if urlparse(r.request.url).hostname in ("127.0.0.1", None)
                   else r.abort())
        yield page
        browser.close()


def test_the_calculator_answers_in_the_page_as_python_does(site, browser_page):
    """Chapter 6's calculator in the built page, offline: every answer (the chosen stage's bytes per
    device, and its line of text) equals Python's calculate/describe, exactly; a bad input gets
    Python's message and keeps the last answer and chart."""
    from zeronb.book.calculator import calculate, describe

    page = browser_page
    page.goto(f"{site}/notebooks/06_memory.html", wait_until="load")
    result = page.locator("[data-zeronb-calc=result]")
    assert float(result.get_attribute("data-bytes")) == calculate("7.5B", 64, 3)["total"]  # as the chapter opens it
    inputs = _calculator_inputs()
    assert len(inputs) >= 20
    for values in inputs:
        _set_calculator(page, values)
        want = calculate(*values)
        assert float(result.get_attribute("data-bytes")) == want["total"], values
        assert result.inner_text() == describe(want), values
        assert page.locator("[data-zeronb-calc=error]").inner_text() == ""
    chart = page.locator("[data-zeronb-calc=chart]").inner_html()
    last = result.get_attribute("data-bytes")
    for bad in ("7.5Q", "-3", "abc"):
        _set_calculator(page, (bad,))
        with pytest.raises(ValueError) as python:
            calculate(bad, 64, 3)
        assert page.locator("[data-zeronb-calc=error]").inner_text() == str(python.value)
        assert result.get_attribute("data-bytes") == last and page.locator("[data-zeronb-calc=chart]").inner_html() == chart


def test_the_ring_explorer_slider_shows_every_frame_in_the_page(site, browser_page):
    page = browser_page
    page.goto(f"{site}/notebooks/04_ring.html", wait_until="load")
    slider = page.locator("[data-zeronb-ring=slider]")
    frames = int(slider.get_attribute("max")) + 1
    assert frames >= 3
    seen = set()
    for i in range(frames):
        slider.fill(str(i))  # (a range input: sets the value, fires input and change)
        shown = page.locator(".zeronb-ring img:not([hidden])")
        assert shown.count() == 1 and shown.get_attribute("data-frame") == str(i)
        caption = page.locator("[data-zeronb-ring=caption]").inner_text()
        assert caption.endswith(f"({i + 1} of {frames})")
        seen.add(shown.get_attribute("src"))
    assert len(seen) == frames  # a different picture for every frame


def test_every_page_has_a_title(pages):
    for f, info in pages.items():
        assert info["title"] and not info["title"].startswith("<no title>"), f


def test_no_bar_across_the_top(pages):
    # pydata-sphinx-theme 0.17 adds one (a second search box) unless navbar_persistent is set empty
    for f, info in pages.items():
        assert info["top_bar"] == 0, f"{f}: a {info['top_bar']} px bar across the top of the page"
