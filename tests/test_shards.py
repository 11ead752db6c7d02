"""zeronb.shards: the one padding rule, checked exhaustively on small sizes."""
import pytest

from zeronb import shards


@pytest.mark.parametrize("n", range(1, 9))
def test_bounds_cover_the_tensor_in_rank_order(n):
    for numel in list(range(0, 40)) + [1000003]:
        b = shards.all_bounds(numel, n)
        c = shards.chunk_size(numel, n)
        assert b[0][0] == 0 and b[-1][1] == numel
        for (s0, e0), (s1, e1) in zip(b, b[1:]):
            assert e0 == s1  # contiguous, disjoint, in rank order
        assert all(0 <= e - s <= c for s, e in b)
        if c:
            assert all(e - s == c for s, e in b[:numel // c])  # full chunks first
        assert 0 <= shards.padding(numel, n) < n
        assert shards.padded_numel(numel, n) == c * n >= numel
        assert sum(shards.shard_numel(numel, n, r) for r in range(n)) == numel
        for i in range(0, numel, max(1, numel // 50)):
            r = shards.owner(i, numel, n)
            assert b[r][0] <= i < b[r][1]


def test_the_documented_examples():
    assert shards.all_bounds(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert shards.padding(10, 4) == 2
    assert shards.all_bounds(3, 4) == [(0, 1), (1, 2), (2, 3), (3, 3)]  # the last rank owns nothing
    assert shards.chunk_bounds(10, 4, 3) == (9, 12)


@pytest.mark.parametrize("bad", [-1, 2.5, "3", True, None])
def test_bad_sizes(bad):
    with pytest.raises(ValueError):
        shards.bounds(bad, 2, 0)
    with pytest.raises(ValueError):
        shards.bounds(4, bad, 0)


def test_bad_rank_and_index():
    with pytest.raises(ValueError):
        shards.bounds(10, 4, 4)
    with pytest.raises(IndexError):
        shards.owner(10, 10, 4)
