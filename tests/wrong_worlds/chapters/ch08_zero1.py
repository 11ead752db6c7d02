"""Chapter 8, ZeRO-1: its check cells and their wrong worlds."""
from __future__ import annotations

from ..planting import averaging_over, replace, when_imported
from . import chapter, world


# --- chapter 8: ZeRO-1 -------------------------------------------------------------------------------------

chapter("08_zero1", {
    "parity": "zeronb's and PyTorch's ZeRO-1 match one process and DDP (parameters, gradients, SGD); replicas equal",
    "bytes": "reduce-scatter + all-gather credited DDP's all-reduce exactly; ZeroRedundancyOptimizer's broadcasts; wire",
    "memory": "swept from outside: ZeRO-1 holds (p + g) Psi + K Psi/N, all listed; fractions of DDP; PyTorch's 2g",
    "ownership": "ZeRO-1's equal chunks; ZeroRedundancyOptimizer's whole tensors by the greedy rule, state for those only",
    "avg": "ReduceOp.AVG in a reduce-scatter does what this torch and backend should (honoured on torch >= 2.11)",
    "deepspeed": "DeepSpeed's ZeRO-1: an all-reduce, a float32 partition copy, no gradients kept, 2N padding, one gather",
})


def _zero1_sums():
    averaging_over("ZeRO1", lambda stage: 1)


world("08_zero1", "ZeRO-1 steps with the summed gradient", "ZeRO-1 divides by N before its reduce-scatter: here "
      "its optimizer steps with the ranks' sum", "parity", _zero1_sums)


def _zro_never_broadcasts():
    when_imported("torch.distributed.optim.zero_redundancy_optimizer",
                  lambda m: setattr(m.ZeroRedundancyOptimizer, "_sync_params", lambda self: None))


world("08_zero1", "ZeroRedundancyOptimizer never broadcasts", "each owner broadcasts its updated tensors: here none "
      "does, so every rank keeps stale copies of the tensors it does not own", ("parity", "bytes"), _zro_never_broadcasts)


def _zero1_all_reduces():
    """The reduce-scatter done as an all-reduce of the whole gradient, of which each rank keeps its chunk."""
    def patch(m):
        reduce_scatter_into = m.reduce_scatter_into

        def via_all_reduce(shard, full, *, dtype=None, group=None, ring=False):
            import torch.distributed as dist
            if ring:
                return reduce_scatter_into(shard, full, dtype=dtype, group=group, ring=ring)
            summed = full.clone() if dtype in (None, full.dtype) else full.to(dtype)
            dist.all_reduce(summed, group=group)
            r = dist.get_rank(group)
            shard.add_(summed[r * shard.numel():(r + 1) * shard.numel()])
        m.reduce_scatter_into = via_all_reduce
    when_imported("zeronb.zero.buckets", patch)


world("08_zero1", "ZeRO-1 all-reduces and keeps its chunk", "ZeRO-1 reduce-scatters its gradients: here it "
      "all-reduces them and keeps its chunk (DeepSpeed's way)", "bytes", _zero1_all_reduces)


def _ring_segments_twice():
    """Every segment of zeronb's ring goes out twice: twice a reduce-scatter's bytes on the wire."""
    replace("zeronb.collectives.ring", "_segments",
            lambda original: lambda *args: [seg for seg in original(*args) for _ in range(2)])


world("08_zero1", "the ring reduce-scatter sends each segment twice", "with zeronb's ring reduce-scatter ZeRO-1 "
      "puts DDP's bytes on the wire: here each segment goes out twice", "bytes", _ring_segments_twice)


def _zero1_keeps_its_receive_buffer():
    """The reduce-scatter receives into a buffer the bucket keeps and reuses from step to step (saving an
    allocation): Psi/N elements held between steps that the stage does not list."""
    def patch(m):
        reduce_scatter_grads = m.Bucket.reduce_scatter_grads

        def and_a_kept_buffer(self, *args, **kwargs):
            reduce_scatter_grads(self, *args, **kwargs)
            if getattr(self, "received", None) is None:  # what the next call would receive into, kept
                self.received = self.grad_shard.new_empty(self.grad_shard.numel())
        m.Bucket.reduce_scatter_grads = and_a_kept_buffer
    when_imported("zeronb.zero.buckets", patch)


world("08_zero1", "ZeRO-1 keeps its receive buffer", "ZeRO-1 holds (p + g) Psi + K Psi/N and lists all of it: here "
      "it also keeps the reduce-scatter's receive buffer between steps", "memory", _zero1_keeps_its_receive_buffer)


def _zero1_unsharded_optimizer():
    """A ZeRO-1 that all-reduces the whole gradient and steps the whole flat buffer on every rank: DDP in
    ZeRO-1's clothes, the optimizer state whole."""
    def patch(m):
        init = m.ZeRO1.__init__

        def __init__(self, model, config=None, observers=()):
            init(self, model, config, observers)
            self.optimizer = m.ShardOptimizer([self.bucket.data], self.config, sharded=False)

        def all_reduce(self):
            self.bucket.start_all_reduce(self.data_parallel, group=self.shard_group)
            self.bucket.finish()

        def step(self):
            self.update([self.bucket.grad])
            self.bucket.grad.zero_()

        m.ZeRO1.__init__, m.ZeRO1._reduce_scatter, m.ZeRO1.step = __init__, all_reduce, step
    when_imported("zeronb.zero.zero1", patch)


world("08_zero1", "ZeRO-1 that does not shard its optimizer", "each rank keeps K Psi/N of optimizer state: here "
      "every rank steps the whole buffer and keeps K Psi", ("memory", "bytes"), _zero1_unsharded_optimizer)


def _torch_ddp_grads_in_buckets():
    import functools

    replace("zeronb.zero.torch_impls", "DistributedDataParallel",
            lambda original: functools.partial(original, gradient_as_bucket_view=True))


world("08_zero1", "PyTorch's ZeRO-1 with gradient_as_bucket_view", "PyTorch's DDP + ZeroRedundancyOptimizer holds "
      "each gradient twice: here its .grads are views into its buckets", "memory", _torch_ddp_grads_in_buckets)


def _zro_round_robin():
    def patch(m):
        partition = m.ZeroRedundancyOptimizer._partition_parameters

        def round_robin(self, params_per_rank=None):
            if params_per_rank is None and not self._partition_parameters_cache and len(self.param_groups) == 1:
                params = self.param_groups[0]["params"]
                partition(self, [params[r::self.world_size] for r in range(self.world_size)])
                return self._partition_parameters_cache
            return partition(self, params_per_rank)
        m.ZeroRedundancyOptimizer._partition_parameters = round_robin
    when_imported("torch.distributed.optim.zero_redundancy_optimizer", patch)


world("08_zero1", "ZeroRedundancyOptimizer deals tensors round robin", "ZeroRedundancyOptimizer hands out tensors "
      "largest first, each to the rank owning the fewest elements: here in the model's order, round robin",
      "ownership", _zro_round_robin)


def _zro_keeps_every_state():
    """The local optimizer is built over every parameter: each rank keeps (and steps) the state of all of them."""
    def patch(m):
        init_local = m.ZeroRedundancyOptimizer._init_local_optimizer

        def over_everything(self):
            init_local(self)
            self.optim = self._optim_constructor([p for g in self.param_groups for p in g["params"]],
                                                 **self._optim_defaults)
        m.ZeroRedundancyOptimizer._init_local_optimizer = over_everything
    when_imported("torch.distributed.optim.zero_redundancy_optimizer", patch)


world("08_zero1", "ZeroRedundancyOptimizer keeps every tensor's state", "a rank's optimizer holds the state of the "
      "tensors it owns only: here of every tensor", "ownership", _zro_keeps_every_state)


def _reduce_scatter_ignores_avg():
    """gloo's reduce-scatter before pytorch#171458: it accepts ReduceOp.AVG and sums."""
    def reduce_scatter_single(original):
        def sums(output, input, op=None, group=None, async_op=False):
            import torch.distributed as dist
            op = dist.ReduceOp.SUM if op in (None, dist.ReduceOp.AVG) else op
            return original(output, input, op=op, group=group, async_op=async_op)
        return sums
    replace("zeronb.runtime.compat", "reduce_scatter_single", reduce_scatter_single)


world("08_zero1", "a reduce-scatter that sums when asked to average", "this torch's gloo honours ReduceOp.AVG in a "
      "reduce-scatter: here it sums, as gloo did before the fix", "avg", _reduce_scatter_ignores_avg)


def _deepspeed_config(**zero):
    """zeronb's deepspeed_config with these keys of zero_optimization set (a default DeepSpeed could have)."""
    def deepspeed_config(original):
        def with_keys(*args, **kwargs):
            config = original(*args, **kwargs)
            config["zero_optimization"].update(zero)
            return config
        return with_keys
    replace("zeronb.zero.deepspeed_engine", "deepspeed_config", deepspeed_config)


world("08_zero1", "DeepSpeed reduces each slice to its owner", "DeepSpeed's ZeRO-1 all-reduces whole buckets "
      "(use_multi_rank_bucket_allreduce, its default): here the default is off, and it reduces to each owner",
      "deepspeed", lambda: _deepspeed_config(use_multi_rank_bucket_allreduce=False))

world("08_zero1", "DeepSpeed's bucket size handed over in bytes", "zeronb sets reduce_bucket_size to its DDP's "
      "64 KiB of float32, in elements: here 65,536 elements, the bytes taken for elements", "deepspeed",
      lambda: _deepspeed_config(reduce_bucket_size=64 << 10))


def _deepspeed_keeps_fp32_gradient():
    """DeepSpeed's step keeps its partition's float32 gradient after the optimizer has used it (under a name
    its stage's list does not look for) instead of dropping it."""
    def patch(m):
        optimizer_step = m.DeepSpeedZeroOptimizer._optimizer_step

        def and_keep(self, i):
            optimizer_step(self, i)
            self.kept_partitions = getattr(self, "kept_partitions", {})
            self.kept_partitions[i] = self.single_partition_of_fp32_groups[i].grad
        m.DeepSpeedZeroOptimizer._optimizer_step = and_keep
    when_imported("deepspeed.runtime.zero.stage_1_and_2", patch)


world("08_zero1", "DeepSpeed keeps its fp32 gradient after the step", "DeepSpeed holds no gradient between steps: "
      "here it keeps its partition's float32 gradient", "deepspeed", _deepspeed_keeps_fp32_gradient)


def _deepspeed_without_all_gather_into_tensor():
    """A torch without all_gather_into_tensor: DeepSpeed's fallback gathers in allgather_bucket_size pieces."""
    when_imported("deepspeed.comm", lambda m: setattr(m, "has_all_gather_into_tensor", lambda: False))


world("08_zero1", "DeepSpeed gathers in allgather_bucket_size pieces", "allgather_bucket_size has no effect: here "
      "DeepSpeed takes its fallback (a torch without all_gather_into_tensor), which gathers in pieces of that size",
      "deepspeed", _deepspeed_without_all_gather_into_tensor)


def _deepspeed_aligns_to_n():
    """DeepSpeed without its 4-byte alignment of 16-bit partitions: the flat buffer padded to a multiple of N."""
    when_imported("deepspeed.runtime.zero.stage_1_and_2", lambda m: setattr(
        m.DeepSpeedZeroOptimizer, "nccl_start_alignment_factor", property(lambda self: 1, lambda self, value: None)))


world("08_zero1", "DeepSpeed's partitions aligned to N", "DeepSpeed pads its flat buffer to a multiple of 2N: here "
      "of N", "deepspeed", _deepspeed_aligns_to_n)
