"""The observers' arithmetic, on numbers worked out by hand: intervals, the hidden share, ZeRO-3's
memory after each hook, and a timeline's all-gathers ending where a completion query first saw them
complete, or at the stage's wait."""
import time

from zeronb.book.timeline import covered, hidden_share, overlap, waited_for
from zeronb.book.watched import zero3_parameters
from zeronb.zero.observe import Timeline


def test_covered_and_overlap_count_each_instant_once():
    assert covered([(0, 2), (1, 3), (5, 6)]) == 4
    assert covered([]) == 0
    assert overlap([(0, 2), (5, 6)], [(1, 5.5)]) == 1.5
    assert overlap([(0, 1)], [(1, 2)]) == 0  # touching is not running together


def test_hidden_share_is_the_time_of_the_gathers_not_waited_for():
    timeline = [("all-gather (forward)", 1, 0.0, 4.0), ("forward", 0, 1.0, 3.0), ("all-gather (backward)", 0, 5.0, 7.0),
                ("wait", 0, 6.0, 7.0), ("backward", 0, 3.5, 10.0), ("reduce-scatter", 0, 10.0, 11.0)]
    assert waited_for(timeline) == [("all-gather (backward)", 0, 5.0, 7.0)]
    assert hidden_share(timeline) == 4.0 / 6.0  # the waited-for gather counts not at all, in flight or not


def test_zero3_parameters_labels_the_memory_after_each_hook():
    notes = [("forward pass", 0, {"params": 10}), ("all-gather", 0, {"params": 30}), ("gathered", 0, {"params": 30}),
             ("forward", 0, {"params": 30}), ("forward done", 0, {"params": 30}), ("freed", 0, {"params": 10}),
             ("forward", 1, {"params": 30}), ("forward done", 1, {"params": 30}),  # the last unit: kept
             ("backward", 1, {"params": 30}), ("backward done", 1, {"params": 30}), ("reduce-scatter", 1, {"params": 30}),
             ("freed", 1, {"params": 10})]
    assert zero3_parameters(notes) == [("forward 0", 30), ("after forward 0", 10), ("forward 1", 30),
                                       ("after forward 1", 30), ("backward 1", 30), ("after backward 1", 10)]


def _unit(index):
    """A real ZeRO-3 unit (of one rank's shards), whose collective the test sets by hand."""
    import torch

    from zeronb.zero.zero3 import Unit

    return Unit(index, torch.nn.Linear(2, 2), rank=0, shards=1)


class _Work:
    """A collective whose completion the test sets: `done` (what `is_completed` answers)."""

    def __init__(self, done=False):
        self.done = done

    def is_completed(self):
        return self.done


def test_a_gather_ends_at_the_first_event_it_was_seen_complete_and_was_not_waited_for():
    timeline, u = Timeline("cpu"), _unit(2)
    timeline(None, "forward pass", 0)
    u.work = work = _Work()
    timeline(None, "all-gather", u)  # issued, not complete
    timeline(None, "forward", 1)     # asked: not yet
    work.done = True
    time.sleep(0.01)
    timeline(None, "forward done", 1)  # asked: complete
    time.sleep(0.01)
    timeline(None, "gathered", u)
    marks = {w: t for w, k, t in timeline.records()}
    spans = timeline.spans()
    (what, key, start, end), = [s for s in spans if s[0].startswith("all-gather")]
    assert (what, key) == ("all-gather (forward)", 2)
    assert start == marks["all-gather (forward)"] and end == marks["forward done"] < marks["gathered"]
    assert not waited_for(spans) and not [s for s in spans if s[0] == "wait"]


def test_a_gather_complete_only_when_waited_for_ends_at_the_wait_with_a_wait_span():
    """A backend that moves nothing until the wait: in flight all along, never seen complete before it."""
    timeline, u = Timeline("cpu"), _unit(0)
    timeline(None, "forward pass", 0)
    u.work = work = _Work()
    timeline(None, "all-gather", u)
    timeline(None, "forward", 3)
    timeline(None, "forward done", 3)
    work.done = True  # (the stage's wait ran it)
    timeline(None, "gathered", u)
    marks = {w: t for w, k, t in timeline.records()}
    spans = timeline.spans()
    gather = next(s for s in spans if s[0].startswith("all-gather"))
    assert gather[3] == marks["gathered"] and waited_for(spans) == [gather]
    assert ("wait", 0, marks["forward done"], marks["gathered"]) in spans
    assert hidden_share(spans) == 0
