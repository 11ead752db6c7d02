"""The ring trace and the pictures drawn from it, on real gloo ranks.

The ranks run zeronb's ring collectives under a CommLedger; the tests check the trace itself (every
send has its receive, N-1 steps per phase, the chunk indices of the ring rule), then that replaying
it (viz.ring_state) gives what a ring must give, then that the figures are made from it."""
import matplotlib

matplotlib.use("Agg")  # no display: draw into memory

import matplotlib.figure  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from IPython.display import HTML  # noqa: E402

from zeronb.book import viz  # noqa: E402
from zeronb.shards import chunk_size  # noqa: E402

NUMEL = 10          # not a multiple of 3 or 4: the padded last chunk is traced like the others
OPS = ("ring_all_reduce", "ring_reduce_scatter", "ring_all_gather")


def _record(numel):
    """On every rank: each ring collective under a ledger of its own, then all three under one."""
    from zeronb.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter
    from zeronb.ledger import CommLedger
    from zeronb.shards import bounds

    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.arange(numel, dtype=torch.float64) + 100 * r
    a, b = bounds(numel, n, r)

    def ar():
        return ring_all_reduce(x.clone())

    def rs():
        return ring_reduce_scatter(x)

    def ag():
        return ring_all_gather(x[a:b].clone(), numel)

    out = {}
    for name, fn in zip(OPS, (ar, rs, ag)):
        with CommLedger() as ledger:
            value = fn()
        out[name] = ledger.summary()
        out[name + ":value"] = value
    with CommLedger() as ledger:  # three calls in one trace
        ar(), rs(), ag()
    out["all"] = ledger.summary()
    with CommLedger() as ledger:  # many small segments: the pipelined path of the ring
        ring_all_reduce(torch.arange(64, dtype=torch.float32) + r, segment_bytes=8)
    out["segmented"] = ledger.summary()
    return out


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"N{n}")
def traced(request, gloo_pool):
    n = request.param
    return n, list(gloo_pool(n).run(_record, NUMEL, echo=False))


def _summaries(res, key):
    return [res[r][key] for r in range(len(res))]


def _key(e):
    return (e["op"], e["phase"], e["step"], e["src"], e["dst"], e["chunk"], e["bytes"])


# --- the trace ---------------------------------------------------------------------------------

@pytest.mark.parametrize("key", OPS + ("all", "segmented"))
def test_every_send_has_its_receive(traced, key):
    n, res = traced
    events = viz.trace_events(_summaries(res, key))
    sends = sorted(_key(e) for e in events if e["kind"] == "send")
    recvs = sorted(_key(e) for e in events if e["kind"] == "recv")
    assert sends and sends == recvs
    for r in range(n):  # each rank records its own side only: sends from it, receives into it
        mine = res[r][key]["events"]
        assert all(e["src"] == r for e in mine if e["kind"] == "send")
        assert all(e["dst"] == r for e in mine if e["kind"] == "recv")
        assert all(e["end"] >= e["start"] for e in mine)


@pytest.mark.parametrize("op", OPS)
def test_n_minus_1_steps_per_phase_per_rank(traced, op):
    n, res = traced
    phases = {"ring_all_reduce": ["reduce-scatter", "all-gather"], "ring_reduce_scatter": ["reduce-scatter"],
              "ring_all_gather": ["all-gather"]}[op]
    for r in range(n):
        events = res[r][op]["events"]
        for phase in phases:
            for kind in ("send", "recv"):
                steps = [e["step"] for e in events if e["phase"] == phase and e["kind"] == kind]
                assert steps == list(range(n - 1)), (r, phase, kind, steps)
        assert {e["phase"] for e in events} == set(phases)


@pytest.mark.parametrize("op", OPS)
def test_chunk_indices_follow_the_ring_rule(traced, op):
    """zeronb.collectives' docstring: reduce-scatter step s, rank r sends chunk (r-s-1) mod N and
    receives (r-s-2) mod N; all-gather step s, sends (r-s) mod N and receives (r-s-1) mod N; always
    to rank r+1 and from rank r-1."""
    n, res = traced
    chunk_bytes = chunk_size(NUMEL, n) * 8  # float64
    for r in range(n):
        for e in res[r][op]["events"]:
            s, rs = e["step"], e["phase"] == "reduce-scatter"
            assert e["dst"] == (e["src"] + 1) % n
            if e["kind"] == "send":
                assert e["src"] == r and e["chunk"] == (r - s - (1 if rs else 0)) % n, e
            else:
                assert e["dst"] == r and e["chunk"] == (r - s - (2 if rs else 1)) % n, e
            assert e["bytes"] == chunk_bytes


def test_ledger_bytes_are_the_sends_of_the_trace(traced):
    n, res = traced
    chunk_bytes = chunk_size(NUMEL, n) * 8
    for r in range(n):
        for op, passes in zip(OPS, (2, 1, 1)):
            summary = res[r][op]
            traced_bytes = sum(e["bytes"] for e in summary["events"] if e["kind"] == "send")
            assert summary["by_op"] == {op: passes * (n - 1) * chunk_bytes}
            assert summary["bytes_sent"] == traced_bytes


# --- replaying the trace -------------------------------------------------------------------------

def test_ring_state_of_an_all_reduce(traced):
    n, res = traced
    snaps = viz.ring_state(_summaries(res, "ring_all_reduce"), n)
    assert len(snaps) == 1 + 2 * (n - 1)
    assert [s["phase"] for s in snaps] == ["start"] + ["reduce-scatter"] * (n - 1) + ["all-gather"] * (n - 1)
    assert snaps[0]["holds"] == [[[r]] * n for r in range(n)]
    for s in snaps[1:n]:  # at reduce-scatter step k each received chunk holds one more term: k + 2
        assert len(s["received"]) == n
        assert all(len(s["holds"][d][c]) == s["step"] + 2 for d, c in s["received"])
    after_rs = snaps[n - 1]
    for r in range(n):  # only the owner has the complete sum of its chunk
        assert after_rs["holds"][r][r] == list(range(n))
        assert after_rs["complete"][r] == [c == r for c in range(n)]
    assert all(all(row) for row in snaps[-1]["complete"])
    assert snaps[n]["title"] == f"all-gather, step 1 of {n - 1}"


def test_ring_state_of_reduce_scatter_and_all_gather_alone(traced):
    n, res = traced
    rs = viz.ring_state(_summaries(res, "ring_reduce_scatter"), n)
    assert len(rs) == n
    assert [rs[-1]["complete"][r][r] for r in range(n)] == [True] * n
    assert sum(map(sum, rs[-1]["complete"])) == n
    ag = viz.ring_state(_summaries(res, "ring_all_gather"), n)
    assert len(ag) == n
    assert ag[0]["complete"] == [[c == r for c in range(n)] for r in range(n)]  # own shard only
    for k, s in enumerate(ag[1:], start=1):  # one more chunk per rank per step
        assert [sum(row) for row in s["complete"]] == [k + 1] * n
    assert all(all(row) for row in ag[-1]["complete"])


def test_ring_state_matches_the_values_the_ranks_computed(traced):
    """The model's contribution sets predict the numbers: rank r put in arange + 100 r."""
    n, res = traced
    total = torch.arange(NUMEL, dtype=torch.float64) * n + 100 * sum(range(n))
    for r in range(n):
        assert torch.equal(res[r]["ring_all_reduce:value"], total)
        lo, hi = r * chunk_size(NUMEL, n), min(NUMEL, (r + 1) * chunk_size(NUMEL, n))
        assert torch.equal(res[r]["ring_reduce_scatter:value"], total[lo:hi])
        assert torch.equal(res[r]["ring_all_gather:value"], torch.arange(NUMEL, dtype=torch.float64)
                           + 100 * torch.tensor([min(i // chunk_size(NUMEL, n), n - 1) for i in range(NUMEL)]))


def test_ring_state_splits_a_trace_into_its_calls(traced):
    n, res = traced
    snaps = viz.ring_state(_summaries(res, "all"), n)
    assert [(s["call"], s["op"]) for s in snaps if s["phase"] == "start"] == list(enumerate(OPS))
    assert len(snaps) == (1 + 2 * (n - 1)) + 2 * (1 + (n - 1))
    seg = viz.ring_state(_summaries(res, "segmented"), n)
    assert len(seg) == 1 + 2 * (n - 1) and all(all(row) for row in seg[-1]["complete"])


def test_ring_state_needs_every_rank(traced):
    n, res = traced
    with pytest.raises(ValueError, match="every rank"):
        viz.ring_state([res[0]["ring_all_reduce"]], n)


def _synthetic(n, wrong=False):
    """A ring all-reduce trace written from the rule, without ranks (optionally with one error)."""
    events = []
    for phase, (ds, dr) in (("reduce-scatter", (1, 2)), ("all-gather", (0, 1))):
        for step in range(n - 1):
            for r in range(n):
                c = (r - step - ds) % n
                if wrong and phase == "reduce-scatter" and step == n - 2 and r == 0:
                    c = (c + 1) % n  # rank 0 forwards the wrong chunk at the last step
                common = dict(op="ring_all_reduce", phase=phase, step=step, bytes=4, start=0.0, end=1.0)
                events.append(dict(common, kind="send", src=r, dst=(r + 1) % n, chunk=c))
                events.append(dict(common, kind="recv", src=r, dst=(r + 1) % n, chunk=c))
    return events


def test_ring_state_is_a_replay_not_a_copy_of_the_rule():
    """A trace with one wrong chunk index gives a wrong state: the pictures would show the bug."""
    for n in (5, 8):
        good = viz.ring_state(_synthetic(n), n)
        assert all(all(row) for row in good[-1]["complete"])
        bad = viz.ring_state(_synthetic(n, wrong=True), n)
        assert not bad[n - 1]["complete"][1][1]   # rank 1 never got the last term of its chunk
        assert not all(all(row) for row in bad[-1]["complete"])


# --- the figures ---------------------------------------------------------------------------------

def test_ring_figures(traced):
    n, res = traced
    for key, panels in (("ring_all_reduce", 1 + 2 * (n - 1)), ("ring_reduce_scatter", n), ("ring_all_gather", n)):
        fig = viz.ring_figures(_summaries(res, key))
        assert isinstance(fig, matplotlib.figure.Figure)
        titled = [ax.get_title() for ax in fig.axes if ax.get_title()]
        assert len(titled) == panels and titled[0].startswith("start")
        assert f"step {n - 1} of {n - 1}" in titled[-1]
        assert fig._suptitle is not None
        assert fig.legends or any(ax.get_legend() for ax in fig.axes)
        matplotlib.pyplot.close(fig)


def test_draw_ring_step_draws_the_sends(traced):
    n, res = traced
    snaps = viz.ring_state(_summaries(res, "ring_all_reduce"), n)
    fig, ax = matplotlib.pyplot.subplots()
    viz.draw_ring_step(ax, snaps[1])
    arrows = [p for p in ax.patches if isinstance(p, matplotlib.patches.FancyArrowPatch)]
    boxes = [p for p in ax.patches if isinstance(p, matplotlib.patches.Rectangle)]
    assert len(arrows) == n and len(boxes) == n * n
    labels = {t.get_text() for t in ax.texts}
    assert {str(s["chunk"]) for s in snaps[1]["sends"]} <= labels and f"rank {n - 1}" in labels
    assert ax.get_title() == "reduce-scatter, step 1 of %d" % (n - 1) and ax.get_legend() is not None
    matplotlib.pyplot.close(fig)


def test_ring_animation_has_a_frame_per_snapshot(traced):
    n, res = traced
    open_before = matplotlib.pyplot.get_fignums()
    html = viz.ring_animation(_summaries(res, "ring_all_reduce"), interval=500)
    assert isinstance(html, HTML)
    frames = 1 + 2 * (n - 1)
    assert html.data.count("data:image/png;base64") == frames
    assert f"frames[{frames - 1}]" in html.data and "font-awesome" not in html.data
    assert matplotlib.pyplot.get_fignums() == open_before  # closed: not shown a second time


def test_timeline(traced):
    n, res = traced
    fig = viz.timeline(_summaries(res, "ring_all_reduce"))
    ax = fig.axes[0]
    bars = [p for p in ax.patches if isinstance(p, matplotlib.patches.Rectangle) and p.get_width() > 0]
    assert len(bars) == n * 2 * (n - 1)  # one per send: every rank, every step, both phases
    assert min(b.get_x() for b in bars) == 0.0 and ax.get_xlim()[1] > 0
    assert "ms" in ax.get_xlabel() and ax.get_ylabel() and ax.get_title() and ax.get_legend()
    matplotlib.pyplot.close(fig)


def test_ring_explorer(traced):
    from zeronb.book import widgets

    n, res = traced
    open_before = matplotlib.pyplot.get_fignums()
    box = widgets.ring_explorer(_summaries(res, "ring_all_reduce"))
    assert box.slider.min == 0 and box.slider.max == 2 * (n - 1) == len(box.snapshots) - 1
    box.slider.value = 1
    assert "reduce-scatter, step 1" in box.children[0].children[1].value
    assert matplotlib.pyplot.get_fignums() == open_before


def test_display_table_and_show_source(capsys):
    from zeronb.book.display import show_source, table
    from zeronb.shards import bounds

    html = table(["a", "b"], [[1, "<code>x</code>"], [2, 3]]).data
    assert html.count("<tr>") == 3 and "<th>a</th>" in html and "<td><code>x</code></td>" in html
    show_source(bounds)
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("# zeronb/shards.py, lines ") and "def bounds(" in out


def test_max_diff_compares_runs_by_name():
    import pytest
    import torch

    from zeronb.train import max_diff

    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    assert max_diff(a, {"w": torch.tensor([1.0, 2.5]), "b": torch.tensor([0.5])}) == 0.5
    with pytest.raises(ValueError, match="different parameters"):
        max_diff(a, {"w": a["w"]})
