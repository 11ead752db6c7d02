"""Collectives built from torch.distributed send and receive, to see what the built-ins do:

    ring.py          ring reduce-scatter, all-gather and all-reduce, pipelined in segments
    hierarchical.py  the all-reduce across nodes in three rings
    naive.py         the same through one root, for comparison
    checks.py        what every one checks first (a process group; the same size and dtype on every rank)

A lesson (chapters 3, 4, 5 and 13): may import the other lessons (zeronb.shards, zeronb.ledger)
and zeronb.runtime; the stages build on it.
"""
from .hierarchical import hierarchical_all_reduce
from .naive import naive_all_gather, naive_all_reduce, naive_reduce_scatter
from .ring import SEGMENT_BYTES, ring_all_gather, ring_all_reduce, ring_reduce_scatter

__all__ = ["SEGMENT_BYTES", "hierarchical_all_reduce", "naive_all_gather", "naive_all_reduce", "naive_reduce_scatter",
           "ring_all_gather", "ring_all_reduce", "ring_reduce_scatter"]
