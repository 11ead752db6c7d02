"""Checkers for the chapters' exercises: run the learner's function on real ranks, compare with
torch.distributed (or a formula), and say precisely what is wrong - which rank, which chunk or
element, what was expected and what came back.

    from zeronb.book.exercises import check_all_reduce
    check_all_reduce(my_all_reduce)      # prints a verdict; returns True when everything matches

collectives.py checks the collectives and byte counts (chapters 3, 4, 8, 10); engines.py the
exercises that build the stages' hooks inside real training steps (chapters 7, 9), units.py one
ZeRO-3 unit's (chapter 10); practice.py
accumulation with clipping over shards (chapter 12); nodes.py the hierarchical all-reduce and HSDP's
gradient path on two nodes (chapter 13).

A checker never raises for a wrong answer (the notebook keeps going); it raises only for misuse.
A function that deadlocks is stopped by the pool's timeout and reported as such.
"""
from .checking import Verdict
from .collectives import check_all_reduce, check_ring_all_gather, check_zero1_step, check_zero3_bytes
from .engines import check_bucketed_ddp, check_zero2_hooks
from .units import check_zero3_unit
from .practice import check_accumulate_and_clip
from .nodes import check_hierarchical_all_reduce, check_hsdp_gradient

__all__ = ["Verdict", "check_all_reduce", "check_ring_all_gather", "check_zero1_step", "check_zero3_bytes",
           "check_bucketed_ddp", "check_zero2_hooks", "check_zero3_unit", "check_accumulate_and_clip",
           "check_hierarchical_all_reduce", "check_hsdp_gradient"]
