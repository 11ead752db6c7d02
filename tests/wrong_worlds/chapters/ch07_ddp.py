"""Chapter 7, DDP: its check cells and their wrong worlds."""
from __future__ import annotations

from ..planting import replace, when_imported
from . import chapter, world


# --- chapter 7: DDP ----------------------------------------------------------------------------------------

chapter("07_ddp", {
    "slices": "the ranks' slices, in rank order, are the global batch row for row, B/N rows each",
    "parity": "every engine matches one process (parameters, the gradients, SGD), replicas bit for bit equal",
    "ulps": "most differing elements 1-2 ulps off, the worst many at a near-zero element; Adam enlarges SGD's",
    "seeds": "a seed per rank keeps the replicas exactly as far apart; PyTorch's DDP broadcasts rank 0's weights",
    "bytes": "credited 2(N-1)/N Psi b in one call per bucket (per tensor naively); the wire that plus <= 2% headers",
    "buckets": "buckets in backward order, padded to a multiple of N, each closed by the tensor reaching 64 KiB",
    "overlap": "buckets launched during backward, in its order, and still in flight when later gradients land",
    "memory": "swept from outside: (p + g + K) Psi + step counters, all listed; PyTorch's DDP (p + 2g + K) Psi",
})


def _slices_overlap():
    """Rank r > 0 starts its slice one row early (an off-by-one): the slices overlap, the last row is never used."""
    def patch(m):
        def local_batch(cfg, step, rank, world_size, dtype=None, device="cpu"):
            import torch
            per = cfg.global_batch // world_size
            x, y = m.global_batch(cfg, step, dtype or torch.float32, device)
            lo = rank * per - (1 if rank else 0)
            return x[lo:lo + per], y[lo:lo + per]
        m.local_batch = local_batch
    when_imported("zeronb.models", patch)


world("07_ddp", "slices that overlap by a row", "rank r trains on rows [rB/N, (r+1)B/N): here rank r > 0 starts "
      "one row early", "slices", _slices_overlap)


def _stages_sum():
    # divided_ returns the gradients as they are: the all-reduce brings back the ranks' sum, not their average
    replace("zeronb.zero.buckets", "divided_", lambda original: lambda grads, ranks: grads)


world("07_ddp", "zeronb's DDP sums the gradients", "every engine averages the gradients: here zeronb's DDP and "
      "NaiveDDP all-reduce them undivided (Adam's update nearly hides it)", "parity", _stages_sum)


def _float64_sums_through_float32():
    """A blocking all-reduce of float64 sums a float32 copy (as a reduce dtype applied where it was not asked)."""
    def patch(dist):
        all_reduce = dist.all_reduce

        def rounded(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            import torch
            if async_op or tensor.dtype != torch.float64:
                return all_reduce(tensor, op=op, group=group, async_op=async_op)
            low = tensor.float()
            all_reduce(low, op=op, group=group)
            tensor.copy_(low)
        dist.all_reduce = rounded
    when_imported("torch.distributed", patch)


world("07_ddp", "float64 sums rounded through float32", "the all-reduce sums in the tensor's own precision: here "
      "float64 gradients are summed in float32, so DDP by hand leaves one process by far more than 2 ulps",
      "ulps", _float64_sums_through_float32)


def _sgd_is_adam():
    def optimizer_class(original):
        def always_adam(name):
            import torch
            return torch.optim.Adam
        return always_adam
    replace("zeronb.precision", "optimizer_class", optimizer_class)


world("07_ddp", "optimizer 'sgd' builds Adam", "the SGD runs step with plain SGD: here the name 'sgd' builds Adam, "
      "so they show Adam's differences", "ulps", _sgd_is_adam)


def _one_seed_for_all():
    def make_model(original):
        def seeded_once(cfg=None, *args, **kwargs):
            import dataclasses
            if cfg is None:
                return original(*args, **kwargs)
            return original(dataclasses.replace(cfg, seed=0), *args, **kwargs)
        return seeded_once
    replace("zeronb.models", "make_model", make_model)


world("07_ddp", "make_model ignores its seed", "rank r's model from seed r starts apart from rank 0's: here every "
      "model is built from one fixed seed", "seeds", _one_seed_for_all)


def _ddp_does_not_broadcast():
    when_imported("torch.nn.parallel.distributed", lambda m: setattr(m, "_sync_module_states", lambda **kw: None))


world("07_ddp", "PyTorch's DDP broadcasts nothing when built", "with init_sync=True PyTorch's DDP gives every rank "
      "rank 0's weights: here it checks the shapes and broadcasts nothing", "seeds", _ddp_does_not_broadcast)


def _bucket_size_in_elements():
    """DDP hands make_buckets its bucket size as a number of elements (DeepSpeed's unit): 8x too large in float64."""
    def make_buckets(original):
        def in_elements(params, shards, bucket_bytes):
            size = None if bucket_bytes is None else bucket_bytes * params[0].element_size()
            return original(params, shards, size)
        return in_elements
    replace("zeronb.zero.ddp", "make_buckets", make_buckets)


world("07_ddp", "DDP's bucket size read as elements", "DDP makes one all-reduce per bucket of 64 KiB: here it takes "
      "64 Ki elements per bucket, so one bucket holds the whole model", ("bytes", "overlap"), _bucket_size_in_elements)


def _all_reduce_sent_twice():
    """Every all-reduce runs twice, the first time on a copy and out of the ledger's sight (a layer that
    sends each collective again, as a retry would): the credit is the ring's, the wire twice that."""
    def patch(dist):
        all_reduce = dist.all_reduce

        def twice(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            from zeronb.ledger import muted
            with muted():
                all_reduce(tensor.clone(), op=op, group=group)
            return all_reduce(tensor, op=op, group=group, async_op=async_op)
        dist.all_reduce = twice
    when_imported("torch.distributed", patch)


world("07_ddp", "every all-reduce goes out twice", "on the wire an all-reduce sends the ring's 2(N-1)/N S plus "
      "headers: here each goes out twice, once unseen by the ledger", "bytes", _all_reduce_sent_twice)


def _buckets_in_forward_order():
    replace("zeronb.zero.buckets", "make_buckets",
            lambda original: lambda params, shards, bucket_bytes: original(list(reversed(params)), shards, bucket_bytes))


world("07_ddp", "buckets filled in forward order", "make_buckets fills bucket 0 with the layers backward reaches "
      "first: here it starts from the embeddings", "buckets", _buckets_in_forward_order)


def _buckets_closed_early():
    """DeepSpeed's rule: a bucket closes before the tensor that would take it over the size."""
    import sys

    def make_buckets(original):
        def close_before(params, shards, bucket_bytes):
            if bucket_bytes is None:
                return original(params, shards, bucket_bytes)
            m = sys.modules["zeronb.zero.buckets"]
            groups, current, size = [], [], 0
            for p in reversed([p for p in params if p.requires_grad]):
                if current and size + p.numel() * p.element_size() > bucket_bytes:
                    groups.append(current)
                    current, size = [], 0
                current.append(p)
                size += p.numel() * p.element_size()
            groups += [current] if current else []
            return [m.Bucket(list(reversed(g)), shards, f"bucket{i}") for i, g in enumerate(groups)]
        return close_before
    replace("zeronb.zero.buckets", "make_buckets", make_buckets)


world("07_ddp", "buckets closed before they overflow", "a bucket closes with the tensor that takes it to 64 KiB: "
      "here before it, as DeepSpeed's do", "buckets", _buckets_closed_early)


def _ddp_waits_in_its_hook():
    """The hook launches the bucket's all-reduce and waits for it before backward goes on."""
    def patch(m):
        launch = m.DDP.all_reduce_bucket

        def and_wait(self, b):
            launch(self, b)
            b.work.wait()
        m.DDP.all_reduce_bucket = and_wait
    when_imported("zeronb.zero.ddp", patch)


world("07_ddp", "DDP waits inside its hook", "a bucket's all-reduce runs while backward goes on: here the hook "
      "waits for it (the order of launches and gradients is unchanged)", "overlap", _ddp_waits_in_its_hook)


def _ddp_launches_after_backward():
    def patch(m):
        step = m.DDP.step

        def launch_all_then_step(self):
            for b in self.buckets:
                self.all_reduce_bucket(b)
            step(self)
        m.DDP.post_backward = lambda self, b: None
        m.DDP.step = launch_all_then_step
    when_imported("zeronb.zero.ddp", patch)


world("07_ddp", "DDP all-reduces after backward", "each bucket leaves as soon as backward has produced it: here every "
      "bucket leaves once backward is done", "overlap", _ddp_launches_after_backward)


def _ddp_grads_apart_from_buckets():
    """PyTorch's default layout in zeronb's DDP: each .grad apart from its bucket, copied in before the
    all-reduce and kept (zeroed) between steps. It trains exactly alike and holds the gradients twice;
    the stage's own list names the bucket only."""
    def patch(m):
        init, all_reduce_bucket, step = m.DDP.__init__, m.DDP.all_reduce_bucket, m.DDP.step

        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            for b in self.buckets:
                for p in b.params:
                    p.grad = None  # autograd makes a .grad of its own

        def copy_in_first(self, b):
            for p, view in zip(b.params, b.views(b.grad)):
                view.copy_(p.grad)
            all_reduce_bucket(self, b)

        def copy_back(self):
            step(self)  # (Adam steps the flat buffers with the bucket's averaged gradients)
            for b in self.buckets:
                for p in b.params:
                    p.grad.zero_()

        m.DDP.__init__, m.DDP.all_reduce_bucket, m.DDP.step = __init__, copy_in_first, copy_back
    when_imported("zeronb.zero.ddp", patch)


world("07_ddp", "DDP's .grads kept apart from its buckets", "zeronb's DDP holds (p + g + K) Psi, its gradients in "
      "its buckets: here each .grad is kept apart too, as PyTorch's default layout does", "memory",
      _ddp_grads_apart_from_buckets)


def _torch_ddp_grads_in_buckets():
    import functools

    replace("zeronb.zero.torch_impls", "DistributedDataParallel",
            lambda original: functools.partial(original, gradient_as_bucket_view=True))


world("07_ddp", "PyTorch's DDP with gradient_as_bucket_view", "PyTorch's DDP by default holds a second copy of "
      "the gradients in its buckets: here its .grads are views into them", "memory", _torch_ddp_grads_in_buckets)


def _padded_to_2n():
    replace("zeronb.shards", "padded_numel",
            lambda original: lambda numel, world_size: original(numel, 2 * world_size))


world("07_ddp", "buckets padded to a multiple of 2N", "a bucket is padded by fewer than N elements: here to a "
      "multiple of 2N (invisible at N = 4 on this model, not at N = 1000)", "memory", _padded_to_2n)
