"""Chapter 9, ZeRO-2: its check cells and their wrong worlds."""
from __future__ import annotations

from ..planting import averaging_over, reduce_scatter, replace, when_imported
from . import chapter, world
from .ch10_zero3 import _keeps_fp32_gradients, _real_reduce_scatter_on_gloo


# --- chapter 9: ZeRO-2 -----------------------------------------------------------------------------------

chapter("09_zero2", {
    "hooks": "buckets reduce-scattered in backward order, one each, the first during backward; the trace's peak is "
             "the shard + the largest bucket; the shard after backward",
    "rs-buffers": "each reduce-scatter allocates a chunk (receive buffer) and, on gloo, a copy of its bucket",
    "bucket-sweep": "for every bucket size the trace's peak is the shard + the largest bucket; the shard after",
    "bytes": "credited 2(N-1)/N Ψb for ZeRO-2, ZeRO-1, DDP; no all-reduce; on the wire exactly what the calls predict "
             "(payload + each call's measured cost)",
    "parity": "ZeRO-2 = one process (float64, float32), its gradients and SGD; = ZeRO-1, DDP, the other versions",
    "bf16-memory": "bf16-mixed parts within 3% of the formula, swept = listed; 2Ψ + 14Ψ/N; 2Ψ + 18Ψ/N in the step",
    "gloo-wire": "on gloo's wire the reduce-scatter costs an all-reduce: ZeRO-2 = the all-reduce version",
    "deepspeed": "DeepSpeed's ZeRO-2: parity, all-reduces, what it holds; its buckets at most the limit, zeronb's at "
                 "least: not the same buckets",
})


def _buckets_in_forward_order():
    def make_buckets(original):
        def forward_order(params, shards, bucket_bytes):
            if bucket_bytes is None:
                return original(params, shards, bucket_bytes)
            from zeronb.zero.buckets import Bucket
            groups, current, size = [], [], 0
            for p in [p for p in params if p.requires_grad]:
                current.append(p)
                size += p.numel() * p.element_size()
                if size >= bucket_bytes:
                    groups.append(current)
                    current, size = [], 0
            if current:
                groups.append(current)
            return [Bucket(group, shards, f"bucket{i}") for i, group in enumerate(groups)]
        return forward_order
    replace("zeronb.zero.buckets", "make_buckets", make_buckets)


world("09_zero2", "buckets made in forward order", "bucket 0 holds the last layer and goes first: here the buckets "
      "are made in forward order, so the first complete is the last made", "hooks", _buckets_in_forward_order)


def _reduce_scatters_after_backward():
    """ZeRO-2 whose hooks only count, and which reduce-scatters every bucket once backward is done."""
    def patch(m):
        def post_backward(self, b):
            pass

        def end_micro_batch(self):
            if self.sync_now():
                for b in self.buckets:
                    reduce_scatter(self, b)
        m.ZeRO2.post_backward, m.ZeRO2.end_micro_batch = post_backward, end_micro_batch
    when_imported("zeronb.zero.zero2", patch)


world("09_zero2", "ZeRO-2 reduce-scatters once backward is done", "the reduce-scatters happen during backward, the "
      "peak one bucket: here every bucket waits for the end of backward", "hooks", _reduce_scatters_after_backward)


def _keeps_each_grad():
    """Bucket.take_grads copies the gradients into the flat tensor and keeps each parameter's .grad."""
    when_imported("zeronb.zero.buckets", lambda m: setattr(m.Bucket, "take_grads", lambda self: self.flatten_grads()))


world("09_zero2", "ZeRO-2 keeps each .grad after taking it", "the full gradients are dropped once the bucket is "
      "flat: here each parameter keeps its .grad", ("hooks", "bucket-sweep"), _keeps_each_grad)


def _whole_bucket_receive_buffer():
    def reduce_scatter_into(original):
        def over_allocated(shard, full, *, dtype=None, group=None, ring=False):
            if ring:
                return original(shard, full, dtype=dtype, group=group, ring=ring)
            from zeronb.runtime.compat import reduce_scatter_single
            send = full if dtype in (None, full.dtype) else full.to(dtype)
            received = send.new_empty(send.numel())[:shard.numel()]  # a whole bucket for one chunk
            reduce_scatter_single(received, send, group=group)
            shard.add_(received)
        return over_allocated
    replace("zeronb.zero.buckets", "reduce_scatter_into", reduce_scatter_into)


world("09_zero2", "a receive buffer the size of the bucket", "the reduce-scatter's receive buffer is one chunk: here "
      "it is allocated at the whole bucket's size", "rs-buffers", _whole_bucket_receive_buffer)


def _all_reduces_parameters():
    """After the step each rank all-reduces its buckets with every chunk but its own zeroed (the notes'
    "all-reduce the updated weights"), in place of the all-gather."""
    def patch(m):
        def step(self):
            import torch.distributed as dist
            self.update([b.grad_shard for b in self.buckets])
            for b in self.buckets:
                b.grad_shard.zero_()
                mine = b.chunk(self.shard_rank).clone()
                b.data.zero_()
                b.chunk(self.shard_rank).copy_(mine)
                dist.all_reduce(b.data, group=self.shard_group)
                b.changed("gathered")
        m.ZeRO2.step = step
    when_imported("zeronb.zero.zero2", patch)


world("09_zero2", "ZeRO-2 all-reduces its parameters after the step", "ZeRO-2 is credited exactly ZeRO-1's bytes, a "
      "reduce-scatter and an all-gather: here it all-reduces the updated parameters", "bytes", _all_reduces_parameters)


def _ring_checks_twice():
    def check_same(original):
        def twice(*args, **kwargs):
            original(*args, **kwargs)
            original(*args, **kwargs)
        return twice
    replace("zeronb.collectives.ring", "check_same", check_same)


world("09_zero2", "a ring that checks sizes twice a call", "each ring call costs one size check beyond its payload: "
      "here it runs two", "bytes", _ring_checks_twice)


def _zero2_sums_gradients():
    averaging_over("ZeRO2", lambda stage: 1)


world("09_zero2", "ZeRO-2 sums its gradients", "ZeRO-2 trains as one process does: here it sums the ranks' gradients "
      "where it should average them", "parity", _zero2_sums_gradients)
world("09_zero2", "the optimizer keeps its fp32 gradient shards (chapter 9)", "between steps ZeRO-2 holds 2Ψ + 14Ψ/N in "
      "bf16-mixed: here its optimizer keeps the fp32 gradient shards after the step", "bf16-memory",
      _keeps_fp32_gradients)
world("09_zero2", "gloo with a real reduce-scatter (chapter 9)", "gloo runs a reduce-scatter as an all-reduce: here "
      "it sends what a ring reduce-scatter sends", ("gloo-wire", "bytes"), _real_reduce_scatter_on_gloo)


def _bucket_in_bytes():
    def deepspeed_config(original):
        def in_bytes(*args, **kwargs):
            config = original(*args, **kwargs)
            config["zero_optimization"]["reduce_bucket_size"] *= 4  # bytes of float32, where DeepSpeed reads elements
            return config
        return in_bytes
    replace("zeronb.zero.deepspeed_engine", "deepspeed_config", deepspeed_config)


world("09_zero2", "DeepSpeed's bucket given in bytes", "zeronb gives DeepSpeed its own bucket's limit in elements: "
      "here in bytes, four times as many elements", "deepspeed", _bucket_in_bytes)


def _deepspeed_gathers_in_pieces():
    """DeepSpeed's all-gather after the step as on a torch without all_gather_into_tensor: in pieces of
    allgather_bucket_size (all_gather_dp_groups' fallback)."""
    when_imported("deepspeed.comm", lambda m: setattr(m, "has_all_gather_into_tensor", lambda: False))


world("09_zero2", "DeepSpeed gathers in pieces of allgather_bucket_size", "allgather_bucket_size has no effect: "
      "DeepSpeed gathers the whole buffer in one call; here it takes its fallback and gathers in pieces",
      "deepspeed", _deepspeed_gathers_in_pieces)
