"""The exercise checkers accept a right answer and say precisely what is wrong with a wrong one."""
import pytest
import torch
import torch.distributed as dist

import zeronb
from zeronb.book import exercises
from wrong_worlds import solutions


@pytest.fixture(scope="module", autouse=True)
def pool():
    zeronb.start(4, backend="gloo", verbose=False)
    yield
    zeronb.shutdown()


CHECKERS = list(solutions.WRONG)  # every checker of the book


@pytest.mark.parametrize("checker", CHECKERS)
def test_checker_accepts_a_right_solution(checker):
    v = getattr(exercises, checker)(solutions.RIGHT[checker])
    assert v.ok, str(v)


@pytest.mark.parametrize("checker,wrong", [(c, w) for c in CHECKERS for w in solutions.WRONG[c]],
                         ids=lambda x: x if isinstance(x, str) else x.name.replace(" ", "-"))
def test_checker_names_the_mistake(checker, wrong):
    v = getattr(exercises, checker)(wrong.solution, **wrong.kwargs)
    assert not v.ok and wrong.says in "\n".join(v.problems), str(v)
    assert len(v.problems) <= 3, str(v)  # the mistake in a line or two, not a line per element
