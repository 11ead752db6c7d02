"""Chapter 5, bandwidth: its check cells and their wrong worlds."""
from __future__ import annotations

import functools

from ..planting import replace, when_imported
from . import chapter, world


# --- chapter 5: bandwidth ------------------------------------------------------------------------------

chapter("05_bandwidth", {
    "counts": "the ring's and the naive root's bytes per rank equal their formulas (and the OS's count, within "
              "headers); every ring send is one chunk to the next rank, 2(N-1) for an all-reduce",
    "sweep": "algbw = S/t, busbw = algbw * f with nccl-tests' factors; the bytes behind f counted in the sweep's own "
             "calls, on the ledger and on the wire; speedups() = time(built-in) / time(ring)",
    "fits": "the alpha-beta fits are the least-squares lines on relative misses (no line does better); beta > 0 "
            "for ring and built-in; the largest tensor took longer than the smallest",
    "segments": "the bytes do not depend on the segment size; 2(N-1) ceil(chunk / segment) messages; the finest "
                "segment sends >= 50x the messages and is slower",
})


def _every_segment_in_two_messages():
    """The ring sends every segment as two messages (each half of it): the same bytes, twice the steps'
    messages."""
    def segments(original):
        def halves(chunk_numel, element_size, segment_bytes):
            return [piece for a, b in original(chunk_numel, element_size, segment_bytes)
                    for piece in ((a, (a + b) // 2), ((a + b) // 2, b)) if piece[1] > piece[0]]
        return halves
    replace("zeronb.collectives.ring", "_segments", segments)


world("05_bandwidth", "a ring that sends every segment as two messages",
      "a ring step is one send of one chunk to the next rank: here every chunk goes out as two messages",
      ("counts", "segments"), _every_segment_in_two_messages)


def _naive_reduce_scatter_sends_the_whole_sum():
    """The naive reduce-scatter's root sends every rank the whole sum, and each keeps its shard (as a
    reduce-scatter made of an all-reduce does)."""
    def patch(naive):
        def naive_reduce_scatter(tensor, *, root=0):
            import torch.distributed as dist
            rank, n = naive.world()
            naive.check_same(tensor.numel(), tensor.dtype, tensor.device, "naive_reduce_scatter")
            total = tensor.detach().reshape(-1).clone()
            a, b = naive.bounds(total.numel(), n, rank)
            with naive.ledger.scope("naive_reduce_scatter"):
                naive._reduce_to_root(total, root)
                if rank == root:
                    for w in [dist.isend(total, dst) for dst in range(n) if dst != root]:
                        w.wait()
                elif n > 1:
                    dist.recv(total, root)
            return total[a:b].clone()
        naive.naive_reduce_scatter = naive_reduce_scatter
    when_imported("zeronb.collectives.naive", patch)


world("05_bandwidth", "a naive reduce-scatter whose root sends the whole sum",
      "the naive reduce-scatter's root sends each rank its shard, (N-1)/N S: here it sends each the whole sum",
      "counts", _naive_reduce_scatter_sends_the_whole_sum)


def _ledger_counts_elements():
    """The ledger counts the elements a send carries, not its bytes (numel for nbytes)."""
    def nbytes(original):
        def elements(tensors):
            return tensors.numel() if hasattr(tensors, "numel") else sum(elements(t) for t in tensors)
        return elements
    replace("zeronb.ledger", "_nbytes", nbytes)


world("05_bandwidth", "a ledger that counts elements, not bytes",
      "the ledger counts the bytes that leave a rank (the OS agrees): here it counts elements, a quarter of them",
      "counts", _ledger_counts_elements)


def _busbw_with_the_all_reduce_factor():
    """The benchmark computes every collective's busbw with the all-reduce's factor, 2(N-1)/N."""
    replace("zeronb.bench.collectives", "bus_factor", lambda original: lambda op, n: original("all_reduce", n))


world("05_bandwidth", "a benchmark whose busbw uses the all-reduce factor for everything",
      "busbw = algbw * (N-1)/N for reduce-scatter and all-gather: here 2(N-1)/N", "sweep",
      _busbw_with_the_all_reduce_factor)


def _times_half_the_tensor():
    """The benchmark times a tensor half the size it reports (the size read as float64 elements)."""
    def time_collectives(original):
        @functools.wraps(original)
        def half(nbytes, *args):
            return original(nbytes // 2, *args)
        return half
    replace("zeronb.bench.collectives", "_time_collectives", time_collectives)


world("05_bandwidth", "a benchmark that times half the tensor it reports",
      "a row's S is the tensor its collective moved: here the sweep timed tensors of S/2", "sweep",
      _times_half_the_tensor)


def _speedups_inverted():
    """speedups() divides the ring's time by the built-in's (a number above 1 then says the ring was slower)."""
    def speedups(original):
        def inverted(*args, **kwargs):
            return [dict(s, speedup=s["ring_s"] / s["torch_s"]) for s in original(*args, **kwargs)]
        return inverted
    replace("zeronb.bench.collectives", "speedups", speedups)


world("05_bandwidth", "speedups() the wrong way round",
      "speedups() is time(built-in) / time(ring): here time(ring) / time(built-in)", "sweep", _speedups_inverted)


def _fit_weighted_by_one_over_sqrt_t():
    """fit_alpha_beta passes np.polyfit the weights 1/sqrt(t), as if they multiplied the squared residual
    (they multiply the residual itself): it minimises the misses relative to sqrt(t)."""
    def fit(original):
        def sqrt_weighted(sizes, seconds):
            import numpy as np
            t = np.asarray(seconds, float)
            beta, alpha = np.polyfit(np.asarray(sizes, float), t, 1, w=1 / np.sqrt(t))
            return float(alpha), float(beta)
        return sqrt_weighted
    replace("zeronb.cost", "fit_alpha_beta", fit)


world("05_bandwidth", "an alpha-beta fit weighted 1/sqrt(t)",
      "the fit minimises the relative misses: here it weights each miss by 1/sqrt(t)", "fits",
      _fit_weighted_by_one_over_sqrt_t)


def _fit_swapped():
    """fit_alpha_beta unpacks np.polyfit's (slope, intercept) as (alpha, beta)."""
    def fit(original):
        def swapped(sizes, seconds):
            alpha, beta = original(sizes, seconds)
            return beta, alpha  # (np.polyfit's coefficients come highest degree first: slope, intercept)
        return swapped
    replace("zeronb.cost", "fit_alpha_beta", fit)


world("05_bandwidth", "an alpha-beta fit that returns its numbers swapped",
      "(alpha, beta) is the best line's intercept and slope: here its slope and intercept", "fits", _fit_swapped)


def _sizes_labelled_in_reverse():
    """The sweep labels each size's times with the sizes in reverse order (a zip with the list reversed)."""
    def collectives(original):
        def relabelled(*args, **kwargs):
            result = original(*args, **kwargs)
            sizes = sorted({r["bytes"] for r in result["rows"]})
            label = dict(zip(sizes, reversed(sizes)))
            for r in result["rows"]:
                factor = r["busbw"] / r["algbw"]
                r["bytes"] = label[r["bytes"]]
                r["algbw"] = r["bytes"] / r["seconds"]
                r["busbw"] = r["algbw"] * factor
            return result
        return relabelled
    replace("zeronb.bench.collectives", "collectives", collectives)


world("05_bandwidth", "a sweep that labels its times with the sizes reversed",
      "each row's time is its size's: here the largest size carries the smallest tensor's time",
      ("sweep", "fits"), _sizes_labelled_in_reverse)


def _segment_size_ignored():
    """ring_all_reduce drops the segment size it is given and cuts every chunk at the default."""
    def patch(ring):
        run = ring._ring

        def default_segments(op, steps, segment_bytes, group):
            return run(op, steps, ring.SEGMENT_BYTES, group)
        ring._ring = default_segments
    when_imported("zeronb.collectives.ring", patch)


world("05_bandwidth", "a ring that ignores the segment size it is given",
      "the messages follow the segment size, 2(N-1) ceil(chunk / segment): here the default is always used",
      "segments", _segment_size_ignored)


def _segments_overlap():
    """Each of a chunk's segments after the first starts one element early (an off-by-one in the cut):
    the element is sent twice."""
    def segments(original):
        def overlapping(chunk_numel, element_size, segment_bytes):
            return [(a - 1 if a else a, b) for a, b in original(chunk_numel, element_size, segment_bytes)]
        return overlapping
    replace("zeronb.collectives.ring", "_segments", segments)


world("05_bandwidth", "a ring whose segments overlap by an element",
      "the bytes do not depend on the segment size: here every cut between segments sends an element twice",
      "segments", _segments_overlap)
