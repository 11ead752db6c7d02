"""Interactive explorers (ipywidgets) over the traces that the ranks recorded.

    ring_explorer(summaries)     # a slider over the steps of a ring collective, one picture per step

They need a live Jupyter kernel to respond; the rendered book shows zeronb.book.page's
ring_explorer_html instead (every frame drawn once, a slider in the page's own script).
"""
from __future__ import annotations

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.display import display

from . import viz


def ring_explorer(summaries, *, call: int = 0, world_size: int | None = None, value: int | None = None):
    """A slider over the steps of one ring collective of the trace (`zeronb.run`'s list of ledger
    summaries) and the picture of the chosen step (`viz.draw_ring_step`). Returns the widget; its
    `.snapshots` are the `viz.ring_state` snapshots it draws."""
    snaps = viz.snapshots(summaries, call, world_size)
    n, op = snaps[0]["world_size"], snaps[0]["op"]
    slider = widgets.IntSlider(value=len(snaps) - 1 if value is None else value, min=0, max=len(snaps) - 1,
                               step=1, description="frame", continuous_update=False,
                               layout=widgets.Layout(width="420px"))
    caption = widgets.Label()
    out = widgets.Output()

    def show(i):
        caption.value = f"{snaps[i]['title']}  ({i + 1} of {len(snaps)})"
        fig, ax = plt.subplots(figsize=(6.2, 6.4), dpi=80)
        viz.draw_ring_step(ax, snaps[i], legend=False)
        fig.legend(handles=viz.legend_handles(n, op), loc="lower center", ncol=2, fontsize=9, frameon=False)
        fig.subplots_adjust(left=0.02, right=0.98, top=0.93, bottom=0.24)
        with out:
            out.clear_output(wait=True)
            display(fig)
        plt.close(fig)  # displayed once, in the Output; not again at the end of the cell

    slider.observe(lambda change: show(change["new"]), names="value")
    show(slider.value)
    box = widgets.VBox([widgets.HBox([slider, caption]), out])
    box.slider, box.output, box.snapshots = slider, out, snaps
    return box
