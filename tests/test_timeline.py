"""The unit timeline (zeronb.book.timeline) and the observe helpers chapters 10 and 11 draw it from:
bars where the spans say, on real matplotlib axes, and the bytes of full units alive after each hook."""
import matplotlib

matplotlib.use("Agg")  # no display: draw into memory

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from zeronb.book.timeline import COLOURS, unit_timeline, unit_timeline_legend  # noqa: E402
from zeronb.book.timeline import relative_spans  # noqa: E402
from zeronb.book.watched import gathered, peak_gathered  # noqa: E402

UNITS = ["0: embeddings", "1: block", "2: head"]
SPANS = [("all-gather (forward)", 0, 10.000, 10.002), ("forward", 0, 10.002, 10.005),
         ("all-gather (forward)", 1, 10.005, 10.006), ("forward", 1, 10.006, 10.010),
         ("backward", 1, 10.010, 10.014), ("reduce-scatter", 1, 10.014, 10.016),
         ("all-gather (backward)", 0, 10.016, 10.017), ("backward", 0, 10.017, 10.020)]


@pytest.fixture
def ax():
    fig, ax = plt.subplots()
    yield ax
    plt.close(fig)


def _geometry(bar):
    return bar.get_x(), bar.get_width(), bar.get_y() + bar.get_height() / 2, bar.get_height()


def test_one_bar_per_span_in_ms_since_the_origin_on_its_units_row(ax):
    bars = unit_timeline(ax, SPANS, UNITS, origin=10.0, title="a step")
    assert len(bars) == len(SPANS) == len(ax.patches)
    for bar, (what, unit, start, end) in zip(bars, SPANS):
        x, width, y, _ = _geometry(bar)
        assert x == pytest.approx((start - 10.0) * 1e3) and width == pytest.approx((end - start) * 1e3)
        assert y == pytest.approx(unit)
        assert bar.get_facecolor() == matplotlib.colors.to_rgba(COLOURS[what])
    assert [t.get_text() for t in ax.get_yticklabels()] == UNITS
    assert ax.get_ylim() == (2.5, -0.5)  # unit 0 at the top
    assert ax.get_title() == "a step"


def test_lanes_put_communication_above_computation_in_each_row(ax):
    colours = {w: f"C{i}" for i, w in enumerate(COLOURS)}
    bars = unit_timeline(ax, relative_spans(SPANS), UNITS, colours=colours, lanes=True)
    for bar, (what, unit, start, end) in zip(bars, SPANS):
        x, width, y, height = _geometry(bar)
        compute = what in ("forward", "backward")
        assert y == pytest.approx(unit + (0.2 if compute else -0.2)) and height < 0.5  # y grows downwards
        assert x == pytest.approx((start - 10.0) * 1e3)  # relative_spans: from the earliest start
        assert bar.get_facecolor() == matplotlib.colors.to_rgba(colours[what])
    legend = unit_timeline_legend(ax, colours)
    assert [t.get_text() for t in legend.get_texts()] == list(colours)


def test_relative_spans_counts_from_the_given_origin_or_the_first_start():
    what, unit, start, end = relative_spans(SPANS, origin=10.01)[4]
    assert (what, unit) == ("backward", 1) and start == pytest.approx(0.0) and end == pytest.approx(0.004)
    assert relative_spans(SPANS)[0][2] == 0.0 and relative_spans([]) == []


def test_gathered_is_the_parameters_held_after_each_hook_less_the_shards():
    held = lambda p: {"params": p, "grads": 0, "optimizer": 0}  # noqa: E731
    notes = [("forward pass", 0, held(10)), ("forward", 0, held(40)), ("forward done", 0, held(40)),
             ("freed", 0, held(10)), ("forward", 1, held(110)), ("forward done", 1, held(110)),
             ("backward", 1, held(110)), ("freed", 1, held(10)), ("backward", 0, held(40)), ("freed", 0, held(10))]
    assert gathered(notes, 10) == [("forward 0", 30), ("after forward 0", 0), ("forward 1", 100),
                                   ("after forward 1", 100), ("backward 1", 100), ("after backward 1", 0),
                                   ("backward 0", 30), ("after backward 0", 0)]
    assert peak_gathered(notes, 10) == 100 and peak_gathered([], 10) == 0
