"""Chapter 10, ZeRO-3: its check cells and their wrong worlds."""
from __future__ import annotations

from ..planting import averaging_over, reduce_scatter, replace, when_imported
from . import chapter, world


# --- chapter 10: ZeRO-3 ----------------------------------------------------------------------------------

chapter("10_zero3", {
    "schedule": "forward gathers 0..L, backward L-1..0, two all-gathers per unit but the last, a reduce-scatter each",
    "bytes": "credited 3(N-1)/N Ψb less the last unit's gather (prefetch alike), DDP's for keep; no all-reduce",
    "memory": "between steps only shards (swept); the trace's peaks per variant; on gloo, in one step, units twice",
    "prefetch": "gathers issued early only with prefetch; some complete before the wait (a completion query); "
                "no overlap without; identical parameters",
    "parity": "ZeRO-3 = one process (float64, float32, prefetch), its gradients and SGD",
    "bf16-memory": "(2+2+12)Ψ/N per part, swept = listed; N times less than DDP; activations the same at every stage",
    "wire": "on gloo's wire each reduce-scatter costs an all-reduce: the bytes gloo's algorithms need plus framing",
    "freed-parameters": "a freed parameter raises in F.linear/F.embedding and crashes elsewhere; version counters",
    "accumulation": "with K micro-batches and one sync: K times the gathers, one reduce-scatter; DDP one all-reduce",
    "deepspeed": "DeepSpeed's stage 3: parity, two gathers of every module, what it holds; FSDP2's extra gather on the wire",
    "persistence": "threshold 0 partitions everything; DeepSpeed's default keeps every tensor of this model whole",
})


def _gathers_last_unit_twice():
    """The last unit freed after its forward like the others, and gathered again for its backward (what FSDP2
    does by default)."""
    def patch(m):
        post_forward = m.ZeRO3.post_forward

        def free_every_unit(self, u, out):
            post_forward(self, u, out)
            if self.reshard_after_forward:
                u.reshard()  # the last one too
        m.ZeRO3.post_forward = free_every_unit
    when_imported("zeronb.zero.zero3", patch)


world("10_zero3", "ZeRO-3 gathers its last unit twice", "the last unit is gathered once: here it is freed after "
      "its forward and gathered again for its backward", ("schedule", "bytes"), _gathers_last_unit_twice)


def _all_reduce_gradients():
    """The notes' ZeRO-3: each unit's gradients all-reduced, and this rank's chunk of the sum kept."""
    def reduce_scatter_into(original):
        def all_reduce_then_keep(shard, full, *, dtype=None, group=None, ring=False):
            import torch.distributed as dist
            send = (full if dtype in (None, full.dtype) else full.to(dtype)).clone()
            dist.all_reduce(send, group=group)
            r, n = dist.get_rank(group), dist.get_world_size(group)
            shard.add_(send[r * shard.numel():(r + 1) * shard.numel()])
        return all_reduce_then_keep
    replace("zeronb.zero.buckets", "reduce_scatter_into", reduce_scatter_into)


world("10_zero3", "ZeRO-3 all-reduces its gradients", "no all-reduce: here each unit's gradients are all-reduced "
      "and the rank keeps its chunk, as a source note says", "bytes", _all_reduce_gradients)


def _keeps_a_copy_of_freed_units():
    """Unit.reshard keeps a copy of the full parameters it releases (a cache to skip a gather): the stage's
    own list of its tensors does not name it."""
    def patch(m):
        reshard = m.Unit.reshard

        def keep_a_copy(self):
            if self.data.untyped_storage().nbytes():
                self._cache = self.data.detach().clone()
            reshard(self)
        m.Unit.reshard = keep_a_copy
    when_imported("zeronb.zero.zero3", patch)


world("10_zero3", "ZeRO-3 keeps a copy of every unit it frees", "between steps a ZeRO-3 rank holds only its shards: "
      "here each unit keeps a copy of the full parameters it last released", "memory", _keeps_a_copy_of_freed_units)


def _frees_by_zeroing():
    """Unit.reshard zeroes the full parameters instead of releasing their storage."""
    def patch(m):
        def zero_instead(self):
            if self.state == "sharded":
                return
            self.data.data.zero_()
            self.state = "sharded"
            self.changed("freed")
        m.Unit.reshard = zero_instead
    when_imported("zeronb.zero.zero3", patch)


world("10_zero3", "ZeRO-3 frees a unit by zeroing it", "a freed unit's memory is released: here free() zeroes the "
      "full parameters and keeps their storage", "memory", _frees_by_zeroing)


def _prefetch_always(value):
    def plant():
        def patch(m):
            init = m.ZeRO3.__init__

            def __init__(self, *args, **kwargs):
                init(self, *args, **kwargs)
                self.prefetch = value
            m.ZeRO3.__init__ = __init__
        when_imported("zeronb.zero.zero3", patch)
    return plant


world("10_zero3", "ZeRO-3 prefetches when not asked to", "without prefetch no gather is issued early: here ZeRO-3 "
      "always prefetches", "prefetch", _prefetch_always(True))
world("10_zero3", "ZeRO-3 ignores prefetch=True", "with prefetch every gather after the first is issued early: here "
      "the setting is ignored", "prefetch", _prefetch_always(False))


class _Lazy:
    """An all-gather in flight that moves nothing until it is waited for (as the issue's reader planted it)."""

    def __init__(self, run):
        self._run, self._done = run, False

    def wait(self, *args, **kwargs):
        if not self._done:
            self._run()
            self._done = True
        return True

    def is_completed(self):
        return self._done

    def get_future(self):
        raise RuntimeError("no future: this work runs when waited for")


def _gathers_move_nothing_until_waited():
    def patch(m):
        all_gather = m.Bucket.all_gather

        def lazy(self, shard, group=None, async_op=False):
            if not async_op:
                return all_gather(self, shard, group)
            return _Lazy(lambda: all_gather(self, shard, group))
        m.Bucket.all_gather = lazy
    when_imported("zeronb.zero.buckets", patch)


world("10_zero3", "ZeRO-3's gathers move nothing until they are waited for", "prefetched gathers move their bytes "
      "while the rank computes: here a gather in flight transfers nothing until the stage waits for it",
      "prefetch", _gathers_move_nothing_until_waited)


def _kept_units_go_stale():
    """reshard_after_forward=False keeps each unit gathered after its backward too, into the next step: the next
    forward computes with the parameters of before the optimizer step."""
    def patch(m):
        def post_backward(self, u):
            if self.sync_now():
                reduce_scatter(self, u)
            if self.reshard_after_forward:
                u.reshard()
        m.ZeRO3.post_backward = post_backward
    when_imported("zeronb.zero.zero3", patch)


world("10_zero3", "ZeRO-3 keeps units gathered into the next step", "every variant trains to the same parameters: "
      "here reshard_after_forward=False never frees a unit, and the next step computes with stale parameters",
      ("prefetch", "memory"), _kept_units_go_stale)


def _sums_gradients():
    averaging_over("ZeRO3", lambda stage: 1)


world("10_zero3", "ZeRO-3 sums its gradients", "ZeRO-3 trains as one process does: here it sums the ranks' "
      "gradients where it should average them (Adam hardly notices; SGD and the gradients do)", "parity",
      _sums_gradients)


def _keeps_fp32_gradients():
    """The optimizer keeps the fp32 copies of its gradient shards after the step (the stage's list of its
    tensors names the master copies, not their .grad)."""
    def step(original):
        def keep(self, grads):
            original(self, grads)
            if self.mixed:
                for master, grad in zip(self.master, grads):
                    master.grad = grad.float()
        return keep
    when_imported("zeronb.zero.optim", lambda m: setattr(m.ShardOptimizer, "step", step(m.ShardOptimizer.step)))


world("10_zero3", "the optimizer keeps its fp32 gradient shards", "a ZeRO-3 rank holds (2+2+12)Ψ/N in bf16-mixed: "
      "here its optimizer keeps the fp32 gradient shards after the step", "bf16-memory", _keeps_fp32_gradients)


def _checkpoints_activations():
    def patch(m):
        init = m.ZeRO3.__init__

        def __init__(self, model, *args, **kwargs):
            from zeronb.models import checkpoint_activations
            checkpoint_activations(model)
            init(self, model, *args, **kwargs)
        m.ZeRO3.__init__ = __init__
    when_imported("zeronb.zero.zero3", patch)


world("10_zero3", "ZeRO-3 checkpoints activations on its own", "ZeRO-3 saves DDP's activations: here it also "
      "checkpoints each unit", "bf16-memory", _checkpoints_activations)


def _real_reduce_scatter_on_gloo():
    """gloo with a real reduce-scatter (a ring), credited by the ledger as the built-in is."""
    def reduce_scatter_single(original):
        def ring(output, input, op=None, group=None, async_op=False):
            from zeronb import ledger
            from zeronb.collectives import ring_reduce_scatter
            for counting in list(ledger._active):
                counting._count("_reduce_scatter_base_", (output, input))  # as the built-in call would be
            with ledger.muted():
                output.copy_(ring_reduce_scatter(input, group=group))
        return ring
    replace("zeronb.runtime.compat", "reduce_scatter_single", reduce_scatter_single)


world("10_zero3", "gloo with a real reduce-scatter (chapter 10)", "gloo runs a reduce-scatter as an all-reduce: "
      "here it sends what a ring reduce-scatter sends", "wire", _real_reduce_scatter_on_gloo)


def _torch_resize_keeps_bytes():
    """A torch whose storage.resize_(0) keeps the bytes (an allocator that never shrinks a block)."""
    import torch

    resize = torch.UntypedStorage.resize_

    def keep(self, size):
        return self if size == 0 else resize(self, size)
    torch.UntypedStorage.resize_ = keep


world("10_zero3", "a torch whose resize_(0) keeps the bytes", "a freed parameter has no bytes behind it, and reading "
      "it raises or crashes: here resize_(0) keeps them", ("freed-parameters", "memory"), _torch_resize_keeps_bytes)


def _reduce_scatters_every_micro_batch():
    when_imported("zeronb.zero.zero3", lambda m: setattr(m.ZeRO3, "sync_now", lambda self: True))


world("10_zero3", "ZeRO-3 reduce-scatters every micro-batch", "syncing after the last micro-batch, ZeRO-3 "
      "reduce-scatters once a step: here after every micro-batch", "accumulation", _reduce_scatters_every_micro_batch)


def _persistence_left_at_default():
    def deepspeed_config(original):
        def without_threshold(*args, **kwargs):
            config = original(*args, **kwargs)
            config["zero_optimization"].pop("stage3_param_persistence_threshold", None)
            return config
        return without_threshold
    replace("zeronb.zero.deepspeed_engine", "deepspeed_config", deepspeed_config)


world("10_zero3", "DeepSpeed's persistence threshold left at its default", "zeronb's DeepSpeed config partitions "
      "every parameter (threshold 0): here the key is left out, and DeepSpeed keeps every small tensor whole",
      ("deepspeed", "persistence"), _persistence_left_at_default)


def _fsdp2_keeps_its_last_unit():
    def patch(m):
        init = m.TorchFSDP.__init__

        def __init__(self, *args, **kwargs):
            kwargs.setdefault("reshard_last_unit", False)
            init(self, *args, **kwargs)
        m.TorchFSDP.__init__ = __init__
    when_imported("zeronb.zero.torch_impls", patch)


world("10_zero3", "FSDP2 keeps its last unit by default", "by default FSDP2 gathers every unit twice, one all-gather "
      "more than zeronb: here TorchFSDP keeps its last unit gathered", "deepspeed", _fsdp2_keeps_its_last_unit)
