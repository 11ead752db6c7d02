"""The observers' arithmetic, on numbers worked out by hand: intervals, the hidden share, ZeRO-3's
memory after each hook, and a timeline's collectives ending no later than the stage's wait."""
import time

from zeronb.book.timeline import covered, hidden_share, overlap
from zeronb.book.watched import zero3_parameters
from zeronb.zero.observe import Timeline


def test_covered_and_overlap_count_each_instant_once():
    assert covered([(0, 2), (1, 3), (5, 6)]) == 4
    assert covered([]) == 0
    assert overlap([(0, 2), (5, 6)], [(1, 5.5)]) == 1.5
    assert overlap([(0, 1)], [(1, 2)]) == 0  # touching is not running together


def test_hidden_share_is_the_gathers_time_under_computation():
    timeline = [("all-gather (forward)", 1, 0.0, 4.0), ("forward", 0, 1.0, 3.0), ("backward", 0, 3.5, 10.0),
                ("reduce-scatter", 0, 10.0, 11.0)]
    assert hidden_share(timeline) == (2.0 + 0.5) / 4.0


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


class _Done:
    """A collective that completed before anyone asked: its future's callback runs at once."""

    def get_future(self):
        import torch

        future = torch.futures.Future()
        future.set_result(None)
        return future


def test_a_collective_ends_when_the_stage_waited_if_its_completion_was_stamped_later():
    timeline, u = Timeline("cpu"), _unit(2)
    timeline(None, "forward pass", 0)
    u.work = _Done()
    timeline(None, "all-gather", u)  # issued; completion stamped by the callback, right now
    time.sleep(0.01)
    timeline(None, "gathered", u)    # (later than the completion: the span ends at the completion)
    (what, key, start, end), = timeline.spans()
    assert (what, key) == ("all-gather (forward)", 2) and 0 <= start <= end
    waited = next(t for w, k, t in timeline.records() if w == "gathered")
    assert end < waited  # the completion, not the wait


def test_a_completion_stamped_after_the_wait_returned_is_cut_to_the_wait():
    """A callback may run a little after the waiter woke: the collective was complete by then."""
    import torch

    timeline, future = Timeline("cpu"), torch.futures.Future()

    class Work:
        def get_future(self):
            return future

    u = _unit(0)
    u.work = Work()
    timeline(None, "forward pass", 0)
    timeline(None, "all-gather", u)
    timeline(None, "gathered", u)
    time.sleep(0.01)
    future.set_result(None)  # the completion callback stamps now, after the wait
    (_, _, start, end), = timeline.spans()
    assert end == next(t for w, k, t in timeline.records() if w == "gathered")
