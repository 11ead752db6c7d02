"""Benchmarks: `python -m zeronb.bench dispatch`, `... collectives` and `... zero`, one module each.

Figures are measured side by side in one run and printed as ratios, because this kind of machine
(a couple of shared cores) is noisy: medians over many calls, alternatives interleaved.

The top layer, beside zeronb.book: may import every layer below; nothing in zeronb imports it.
"""
from ..cost import fit_alpha_beta, fit_residuals
from .collectives import collectives, copy_ceiling, memcpy_bandwidth, speedups
from .dispatch import dispatch
from .stages import zero

__all__ = ["collectives", "copy_ceiling", "dispatch", "fit_alpha_beta", "fit_residuals", "memcpy_bandwidth", "speedups", "zero"]
