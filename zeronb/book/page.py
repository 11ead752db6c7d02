"""What a reader of the rendered book, who has no kernel, gets in place of a widget: the same
explorer, answering in the page's own script, with nothing fetched (the book is read offline).

    show(memory_calculator(), calculator_html())     # a live kernel shows the widget, the page the HTML
    show(ring_explorer(summaries), ring_explorer_html(snapshots))

`show` displays one output holding both: the widget's view, and the HTML. A live Jupyter renders the
widget (its renderer comes first); the book's build renders the HTML (`nb_mime_priority_overrides`
in _config.yml puts text/html before the widget's view, whose saved state could not answer).

The calculator's page: calculator.js computes what zeronb.book.calculator computes, from the bytes per
parameter Python hands it as data; tests/test_browser.py holds its answers against Python's, exactly.
The ring explorer's page: every frame drawn by Python (viz.draw_ring_step), a slider that shows one.
Contract for tests: inputs carry `data-zeronb-calc` = num_params, world_size, stage, precision,
optimizer (a change event updates the answer); the answer `data-zeronb-calc="result"`, with
`data-bytes` the chosen stage's bytes per device (calculate(...)["total"]); a bad input's message is in
`data-zeronb-calc="error"`, and the last answer and chart stay.
"""
from __future__ import annotations

import base64
import html
import io
import itertools
import json
import pathlib

from ..precision import PRECISIONS
from . import viz
from .calculator import MAX_WORLD_SIZE, OPTIMIZERS, STAGE_NAMES, bytes_per_param, calculate

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
_ids = itertools.count()


def show(widget, page_html: str) -> None:
    """Display `widget` for a live kernel and `page_html` for the rendered page, as one output."""
    from IPython.display import display  # (inside: IPython only where a notebook runs)

    bundle = {k: v for k, v in widget._repr_mimebundle_().items() if k in (WIDGET_VIEW, "text/plain")}
    display({**bundle, "text/html": page_html}, raw=True)


def calculator_html(num_params="7.5B", world_size: int = 64, stage: int = 3, precision: str = "bf16-mixed",
                    optimizer: str = "adam") -> str:
    """The calculator as HTML and script: the page answers new inputs without a kernel."""
    calculate(num_params, world_size, stage, precision, optimizer)  # bad defaults fail here, loudly
    data = {"bytes_per_param": {p: {o: bytes_per_param(p, o) for o in OPTIMIZERS} for p in PRECISIONS},
            "optimizers": OPTIMIZERS, "stage_names": STAGE_NAMES}
    esc = html.escape

    def select(name, options, chosen):
        opts = "".join(f'<option value="{esc(str(v))}"{" selected" if v == chosen else ""}>{esc(label)}</option>'
                       for v, label in options)
        return f'<select data-zeronb-calc="{name}">{opts}</select>'

    label = 'style="display:inline-block;width:110px"'
    fields = [
        ("parameters", f'<input data-zeronb-calc="num_params" value="{esc(str(num_params))}" '
                       'placeholder="7.5B, 125M, 1e12" size="14">'),
        ("ranks N", f'<input data-zeronb-calc="world_size" type="number" min="1" max="{MAX_WORLD_SIZE}" step="1" '
                    f'value="{world_size}" style="width:8em">'),
        ("ZeRO stage", select("stage", [(s, STAGE_NAMES[s]) for s in range(4)], stage)),
        ("precision", select("precision", [(p, p) for p in PRECISIONS], precision)),
        ("optimizer", select("optimizer", list(OPTIMIZERS.items()), optimizer)),
    ]
    rows = "".join(f"<div><label {label}>{name}</label>{field}</div>" for name, field in fields)
    script = (pathlib.Path(__file__).with_name("calculator.js")).read_text()
    return (f'<div class="zeronb-calculator" data-zeronb-calc-root id="zeronb-calc-{next(_ids)}" '
            'style="text-align:left;display:inline-block">'
            f'<script type="application/json">{json.dumps(data)}</script>{rows}'
            '<p><b data-zeronb-calc="result"></b></p><p data-zeronb-calc="error" style="color:#b00"></p>'
            '<div data-zeronb-calc="chart"></div>'
            f"<script>{script}</script></div>")


def ring_explorer_html(snapshots, value: int | None = None) -> str:
    """The ring explorer as HTML: every frame drawn once (viz.draw_ring_step, as the widget draws
    it), and a slider that shows the chosen one. The frames are data, so no kernel is needed."""
    from matplotlib.figure import Figure  # (inside: matplotlib is slow to import)

    n, op = snapshots[0]["world_size"], snapshots[0]["op"]
    frames = []
    for snap in snapshots:
        fig = Figure(figsize=(6.2, 6.4), dpi=80)
        ax = fig.add_subplot()
        viz.draw_ring_step(ax, snap, legend=False)
        fig.legend(handles=viz.legend_handles(n, op), loc="lower center", ncol=2, fontsize=9, frameon=False)
        fig.subplots_adjust(left=0.02, right=0.98, top=0.93, bottom=0.24)
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        frames.append(base64.b64encode(buf.getvalue()).decode())
    start = len(snapshots) - 1 if value is None else value
    captions = [f"{s['title']}  ({i + 1} of {len(snapshots)})" for i, s in enumerate(snapshots)]
    imgs = "".join(f'<img data-frame="{i}" src="data:image/png;base64,{f}" alt="{html.escape(captions[i])}"'
                   f'{"" if i == start else " hidden"}>' for i, f in enumerate(frames))
    uid = f"zeronb-ring-{next(_ids)}"
    return (f'<div class="zeronb-ring" id="{uid}"><div><label>frame <input type="range" min="0" '
            f'max="{len(frames) - 1}" step="1" value="{start}" data-zeronb-ring="slider" style="width:320px">'
            f'</label> <span data-zeronb-ring="caption">{html.escape(captions[start])}</span></div>{imgs}'
            f'<script type="application/json">{json.dumps(captions)}</script>'
            "<script>(function () {"
            f'var root = document.getElementById("{uid}"), slider = root.querySelector("[data-zeronb-ring=slider]");'
            'var captions = JSON.parse(root.querySelector("script[type=\'application/json\']").textContent);'
            'function show() { var i = +slider.value;'
            '  root.querySelectorAll("img[data-frame]").forEach(function (img) { img.hidden = +img.dataset.frame !== i; });'
            '  root.querySelector("[data-zeronb-ring=caption]").textContent = captions[i]; }'
            'slider.addEventListener("input", show); slider.addEventListener("change", show);'
            "})();</script></div>")
