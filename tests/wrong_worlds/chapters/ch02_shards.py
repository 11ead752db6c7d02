"""Chapter 2, shards: its check cells and their wrong worlds."""
from __future__ import annotations

from ..planting import replace, when_imported
from . import chapter, world


# --- chapter 2: shards ---------------------------------------------------------------------------------

chapter("02_shards", {
    "shard-rule": "bounds cover the tensor once, in rank order; equal chunks; padding < N, on the last ranks only",
    "real-shards": "the shards real ranks took join back to the tensor; each rank's pieces of the MLP are the layout's",
    "stage-counts": "what each of zeronb's stages holds, swept from outside, is the formula plus its layout's padding",
    "fsdp2-rows": "FSDP2 cuts every parameter on dimension 0, ceil(rows/N) rows per rank, stored padded",
})


def _pad_to_2n():
    def chunk_size(original):
        return lambda numel, world_size: 2 * original(numel, 2 * world_size)
    replace("zeronb.shards", "chunk_size", chunk_size)


world("02_shards", "padding to a multiple of 2N", "padding < N: the flat tensor is padded to a multiple of 2N",
      ("shard-rule", "stage-counts"), _pad_to_2n)


def _bounds_overlap():
    def bounds(original):
        def overlapping(numel, world_size, rank):
            start, stop = original(numel, world_size, rank)
            return (max(0, start - 1) if rank and start < stop else start), stop
        return overlapping
    replace("zeronb.shards", "bounds", bounds)


world("02_shards", "shards overlap by one element", "every element is owned exactly once: rank r > 0 also takes "
      "the element before its shard", ("shard-rule", "real-shards"), _bounds_overlap)


def _ddp_second_gradient_copy():
    """PyTorch's DDP layout without gradient_as_bucket_view: each .grad apart from its bucket, copied
    in before the all-reduce and kept (zeroed) between steps. It trains exactly alike and holds the
    gradients twice, while the stage's own inventory names the bucket only."""
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

        def zero_after(self):
            step(self)
            for b in self.buckets:
                for p in b.params:
                    p.grad.zero_()

        m.DDP.__init__, m.DDP.all_reduce_bucket, m.DDP.step = __init__, copy_in_first, zero_after
    when_imported("zeronb.zero.ddp", patch)


world("02_shards", "DDP keeps a second copy of its gradients", "zeronb's DDP holds params + grads + Adam, padded: "
      "here it also keeps each .grad apart from its bucket", "stage-counts", _ddp_second_gradient_copy)


def _fsdp2_shards_columns():
    def fully_shard(original):
        def shard_on_columns():
            import torch
            from torch.distributed.tensor import Shard
            shard = original()
            def placement(p):  # (FSDP2 refuses uneven shards on any dimension but 0)
                n = torch.distributed.get_world_size()
                return Shard(p.dim() - 1) if p.dim() > 1 and p.shape[-1] % n == 0 else Shard(0)
            return lambda module, **kw: shard(module, shard_placement_fn=placement, **kw)
        return shard_on_columns
    replace("zeronb.runtime.compat", "fully_shard", fully_shard)


world("02_shards", "FSDP2 shards on the last dimension", "FSDP2 cuts each parameter on dimension 0: here a weight "
      "whose columns divide by N is cut on its columns",
      "fsdp2-rows", _fsdp2_shards_columns)
