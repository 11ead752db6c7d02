"""Chapter 12, training in practice: its check cells and their wrong worlds."""
from __future__ import annotations

from ..planting import reduce_scatter, replace, when_imported
from . import chapter, world
from .ch06_memory import _below_every_ledger, _bf16_as_fp32_mode, _zero3_checkpoints_its_units


# --- chapter 12: training in practice ------------------------------------------------------------------------

chapter("12_practice", {
    "accum-parity": "accumulation, every stage and choice, both implementations, equals one process on the whole "
                    "batch (parameters and gradients)",
    "accum-bytes": "syncing every micro-batch: DDP K times the all-reduces and bytes, ZeRO K times the "
                   "reduce-scatters; ZeRO-3 gathers every micro-batch; PyTorch's switches skip the sync",
    "accum-memory": "zeronb's engines hold what they list (swept) between micro-batches; ZeRO-2/3 shards (every) or "
                    "Psi b (last); ZeRO-1 buffer (+ shard); DDP the same; FSDP2 waiting Psi b more (swept)",
    "accum-torch": "PyTorch's DDP rebuild broadcasts, FSDP2's set_reshard_after_backward, DDP's second gradient "
                   "copy without bucket views",
    "accum-wire": "zeronb's DDP puts on the wire its credit plus gloo's measured framing per all-reduce, within 1%",
    "clipping": "the same global norm on every rank, clip_grad_norm_'s on one process; the same parameters",
    "bf16-reduction": "bf16's averaged gradient ~2^16 times fp32's error, reversed and zeroed elements; Adam's first "
                      "step lr*sign(g); ledger halves; the wire the credit plus framing",
    "checkpointing": "less saved, each unit its input only; the same per rank at every stage; the work counted; no "
                     "extra gather per unit; a region over two units: zeronb +1 gather, FSDP2 none; early stop",
    "sharded-checkpoints": "one balanced file per saving rank, pieces per rank; resumed runs equal uninterrupted "
                           "ones; the export bit for bit",
})


# --- accumulation ------------------------------------------------------------------------------------------

def _reduce_scatter_written_not_added():
    def reduce_scatter_into(original):
        def written(shard, full, *, dtype=None, group=None, ring=False):
            before = shard.clone()
            original(shard, full, dtype=dtype, group=group, ring=ring)
            shard.sub_(before)  # what arrived, in place of what was there: the earlier micro-batches are lost
        return written
    replace("zeronb.zero.buckets", "reduce_scatter_into", reduce_scatter_into)


world("12_practice", "each micro-batch's reduce-scatter written, not added", "accumulation equals the whole batch: "
      "here each micro-batch's reduce-scatter overwrites the gradient shard", "accum-parity",
      _reduce_scatter_written_not_added)


def _ddp_syncs_every_micro_batch():
    replace("zeronb.zero.ddp", "DDP", lambda DDP: type("DDP", (DDP,), {"sync_now": lambda self: True}))


world("12_practice", "a DDP that syncs every micro-batch whatever it is told", "syncing after the last micro-batch "
      "sends 1/K of the bytes: here zeronb's DDP all-reduces after every one regardless", "accum-bytes",
      _ddp_syncs_every_micro_batch)


def _zero3_keeps_units_between_micro_batches():
    """ZeRO-3 keeps a unit gathered after its backward until the last micro-batch (FSDP2's
    set_reshard_after_backward(False)): the next micro-batch's forward finds it gathered."""
    def patch(m):
        def post_backward(self, u):
            if self.sync_now():
                reduce_scatter(self, u)
            if self.last_micro_batch:
                u.reshard()
        m.ZeRO3.post_backward = post_backward
    when_imported("zeronb.zero.zero3", patch)


world("12_practice", "a ZeRO-3 that keeps its units gathered between micro-batches", "ZeRO-3 all-gathers for every "
      "micro-batch's forward and backward: here a unit stays gathered from one micro-batch's backward to the next "
      "one's forward", "accum-bytes", _zero3_keeps_units_between_micro_batches)


def _torch_sync_switch_ignored():
    def patch(m):
        import contextlib

        m.TorchDDP.gradient_sync = lambda self, sync: contextlib.nullcontext()
        m.TorchFSDP.gradient_sync = lambda self, sync: contextlib.nullcontext()
    when_imported("zeronb.zero.torch_impls", patch)


world("12_practice", "PyTorch stages whose sync switch does nothing", "no_sync and set_requires_gradient_sync(False) "
      "skip the gradient collective until the last micro-batch: here they are not applied",
      ("accum-bytes", "accum-memory"), _torch_sync_switch_ignored)


def _buckets_keep_what_they_sent():
    """Each bucket keeps a reference to the last tensor it sent (to send it again after an error, say):
    memory the engine's own list does not name."""
    def patch(m):
        take_grads, finish = m.Bucket.take_grads, m.Bucket.finish

        def take_grads_(self):  # (the flat tensor a reduce-scatter then sends)
            self.last_sent = take_grads(self)
            return self.last_sent

        def finish_(self):
            self.last_sent = self.comm
            return finish(self)
        m.Bucket.take_grads, m.Bucket.finish = take_grads_, finish_
    when_imported("zeronb.zero.buckets", patch)


world("12_practice", "buckets that keep the last tensor they sent", "an engine holds what it lists: here every bucket "
      "keeps the last tensor it sent, unlisted", "accum-memory", _buckets_keep_what_they_sent)


def _zero2_keeps_full_gradients():
    def patch(m):
        def post_backward(self, b):
            if self.sync_now():
                reduce_scatter(self, b, b.flatten_grads())  # a copy: each .grad stays
        m.ZeRO2.post_backward = post_backward
    when_imported("zeronb.zero.zero2", patch)


world("12_practice", "a ZeRO-2 that keeps the full gradients it reduce-scattered", "ZeRO-2 syncing every micro-batch "
      "holds only its shards: here each bucket's full gradients stay after their reduce-scatter", "accum-memory",
      _zero2_keeps_full_gradients)


def _ddp_never_rebuilds():
    def patch(dist):
        import torch

        torch._C._distributed_c10d.Reducer._rebuild_buckets = lambda self: False
    when_imported("torch.distributed", patch)


world("12_practice", "a DDP that never rebuilds its buckets", "PyTorch's DDP rebuilds its buckets, with two "
      "broadcasts, after the first synchronising backward: here it never does", "accum-torch", _ddp_never_rebuilds)


def _fsdp2_reshard_after_backward_ignored():
    def patch(m):
        m.FSDPModule.set_reshard_after_backward = lambda self, *args, **kwargs: None
    when_imported("torch.distributed.fsdp._fully_shard._fully_shard", patch)


world("12_practice", "an FSDP2 whose set_reshard_after_backward does nothing", "set_reshard_after_backward(False) "
      "saves the forward's all-gathers: here it is ignored", "accum-torch", _fsdp2_reshard_after_backward_ignored)


def _ddp_bucket_views_forced():
    def patch(m):
        init = m.DistributedDataParallel.__init__

        def __init__(self, *args, **kwargs):
            kwargs["gradient_as_bucket_view"] = True
            init(self, *args, **kwargs)
        m.DistributedDataParallel.__init__ = __init__
    when_imported("torch.nn.parallel.distributed", patch)


world("12_practice", "a DDP that lays every .grad in its bucket", "PyTorch's DDP by default keeps each .grad apart "
      "from its bucket (Psi b more): here every .grad is a bucket view whatever it is asked", "accum-torch",
      _ddp_bucket_views_forced)


def _all_reduce_by_all_gather_mode():
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    class AllGatherAndSum(TorchDispatchMode):
        """An all-reduce made of an all-gather of every rank's whole tensor and a local sum: (N-1) S sent
        per rank, where a ring sends 2(N-1)/N S."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func._schema.name != "c10d::allreduce_":
                return func(*args, **kwargs)
            tensors, group = args[0], args[1]
            n = dist.ProcessGroup.unbox(group).size()
            work = None
            for t in tensors:
                every = t.new_empty((n,) + tuple(t.shape))
                _, work = torch.ops.c10d._allgather_base_(every.view(-1), t.contiguous().view(-1), group, True, -1)
                torch._C._distributed_c10d.Work.unbox(work).wait()
                t.copy_(every.sum(0))
            return (tensors, work)
    return AllGatherAndSum()


world("12_practice", "an all-reduce that all-gathers and sums", "gloo's all-reduce is a ring, 2(N-1)/N S per rank: "
      "here each rank gathers every whole tensor and sums", "accum-wire",
      lambda: _below_every_ledger(_all_reduce_by_all_gather_mode))


# --- clipping ------------------------------------------------------------------------------------------------

def _clip_each_shard_by_its_own_norm():
    replace("zeronb.zero.optim", "clip_by_global_norm_", lambda original: lambda grads, max_norm, sharded=True,
            group=None: original(grads, max_norm, sharded=False, group=group))


world("12_practice", "each shard clipped by its own norm", "clipping takes the whole model's norm, the same on every "
      "rank: here each rank clips its shard by the shard's norm", "clipping", _clip_each_shard_by_its_own_norm)


def _norm_measured_not_applied():
    replace("zeronb.zero.optim", "clip_by_global_norm_", lambda original: lambda grads, max_norm, sharded=True,
            group=None: original([g.clone() for g in grads], max_norm, sharded=sharded, group=group))


world("12_practice", "clipping that measures the norm and scales nothing", "clipping scales the gradients: here the "
      "norm is computed and the gradients are left as they are", "clipping", _norm_measured_not_applied)


# --- bf16 reduction ----------------------------------------------------------------------------------------------

def _fp32_all_reduce_compressed():
    """The backend compresses every fp32 all-reduce to bf16 on the wire (sums in bf16, casts back)."""
    def patch(dist):
        import torch

        original = dist.all_reduce

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if tensor.dtype != torch.float32:
                return original(tensor, op=op, group=group, async_op=async_op)
            low = tensor.to(torch.bfloat16)
            work = original(low, op=op, group=group, async_op=True)
            work.wait()
            tensor.copy_(low)
            return work if async_op else None
        dist.all_reduce = all_reduce
    when_imported("torch.distributed", patch)


world("12_practice", "a backend that compresses fp32 all-reduces to bf16", "fp32 reduction is 2^16 times finer than "
      "bf16's and reverses no element: here the backend sums fp32 in bf16", "bf16-reduction",
      _fp32_all_reduce_compressed)


def _adam_without_bias_correction():
    def optimizer_class(original):
        import torch

        class Adam(torch.optim.Adam):
            """Adam without the bias correction of its moments: its first step is lr * 0.1 g / sqrt(0.001 g^2)."""

            @torch.no_grad()
            def step(self, closure=None):
                for group in self.param_groups:
                    beta1, beta2 = group["betas"]
                    for p in group["params"]:
                        if p.grad is None:
                            continue
                        state = self.state[p]
                        if not state:
                            state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                         exp_avg_sq=torch.zeros_like(p))
                        state["step"] += 1
                        state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                        p.addcdiv_(state["exp_avg"], state["exp_avg_sq"].sqrt().add_(group["eps"]), value=-group["lr"])

        return lambda name: Adam if name == "adam" else original(name)
    replace("zeronb.precision", "optimizer_class", optimizer_class)


world("12_practice", "an Adam without bias correction", "Adam's first step is lr * sign(g): here, without bias "
      "correction, it is about 3 lr * sign(g)", "bf16-reduction", _adam_without_bias_correction)


def _reduce_dtype_ignored():
    def patch(m):
        post_init = m.StageConfig.__post_init__

        def __post_init__(self):
            post_init(self)
            self.reduce_dtype = None
        m.StageConfig.__post_init__ = __post_init__
    when_imported("zeronb.zero.config", patch)


world("12_practice", "stages that ignore reduce_dtype", "reduce_dtype bf16 halves the gradient bytes: here every "
      "stage reduces in its own dtype whatever it is asked", "bf16-reduction", _reduce_dtype_ignored)


world("12_practice", "a backend that carries bf16 as fp32", "bf16 halves the bytes on the wire: here the backend sends "
      "bf16 collectives as fp32 (the ledger still credits bf16)", "bf16-reduction",
      lambda: _below_every_ledger(_bf16_as_fp32_mode))


# --- activation checkpointing --------------------------------------------------------------------------------------

def _checkpointing_wraps_nothing():
    replace("zeronb.models", "checkpoint_activations", lambda original: lambda model: model)


world("12_practice", "activation checkpointing that wraps nothing", "a checkpointed unit saves its input only: here "
      "checkpoint_activations leaves the units as they are", "checkpointing", _checkpointing_wraps_nothing)


def _loss_saves_a_one_hot():
    """Cross-entropy written as one-hot targets times log-softmax: autograd keeps the one-hot matrix too."""
    def patch(m):
        import torch.nn.functional as F

        def loss(logits, target):
            flat = logits.reshape(-1, logits.shape[-1])
            one_hot = F.one_hot(target.reshape(-1), logits.shape[-1]).to(logits.dtype)
            return -(one_hot * F.log_softmax(flat, dim=-1)).sum(-1).mean()
        m.TinyGPT.loss = staticmethod(loss)
    when_imported("zeronb.models", patch)


world("12_practice", "a loss that keeps one-hot targets", "outside the units only the loss's log-probabilities are "
      "saved: here the loss multiplies them by one-hot targets, which autograd keeps too", "checkpointing",
      _loss_saves_a_one_hot)


world("12_practice", "a ZeRO-3 that checkpoints its units on its own", "activations are the same at every stage: "
      "here zeronb's ZeRO-3 turns on activation checkpointing itself", "checkpointing", _zero3_checkpoints_its_units)


def _zero3_keeps_units_in_backward():
    """zeronb's ZeRO-3 does not free a unit when its forward ends inside backward (a recompute), as FSDP2's
    post_forward does not reshard during backward."""
    def patch(m):
        import torch

        after = m.ZeRO3.post_forward

        def post_forward(self, u, out):
            if torch._C._current_graph_task_id() != -1:
                return
            after(self, u, out)
        m.ZeRO3.post_forward = post_forward
    when_imported("zeronb.zero.zero3", patch)


world("12_practice", "a zeronb ZeRO-3 that keeps units gathered in backward", "a region over two units costs zeronb's "
      "ZeRO-3 one more gather: here its post-forward hook keeps the unit during backward", "checkpointing",
      _zero3_keeps_units_in_backward)


def _fsdp2_reshards_in_backward():
    def patch(m):
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        def post_forward(self, module, input, output):
            self.reshard()
            if not m.is_bw():
                self._record_post_forward()
            self._training_state = TrainingState.IDLE
            return output
        m.FSDPParamGroup.post_forward = post_forward
    when_imported("torch.distributed.fsdp._fully_shard._fsdp_param_group", patch)


world("12_practice", "an FSDP2 that reshards after the recompute's forward", "a region over two units costs FSDP2 "
      "no gather: here its post-forward reshards during backward too", "checkpointing", _fsdp2_reshards_in_backward)


# --- sharded checkpoints -------------------------------------------------------------------------------------------

def _checkpoint_of_whole_tensors():
    def patch(m):
        import torch.distributed as dist

        def whole(v):
            if isinstance(v, dict):
                return {k: whole(x) for k, x in v.items()}
            return v.full_tensor() if hasattr(v, "full_tensor") else v

        def save(stage, directory, info):
            m.dcp.save(whole(stage.checkpoint_state()), checkpoint_id=directory)
            if dist.get_rank() == 0:
                import json
                import os
                with open(os.path.join(directory, m.INFO), "w") as f:
                    json.dump({**info, "world_size": dist.get_world_size(), "buckets": stage.checkpoint_layout()}, f)
            dist.barrier()
        m.save = save
    when_imported("zeronb.checkpoint", patch)


world("12_practice", "a checkpoint of whole tensors", "each rank writes its own pieces, none the whole: here every "
      "tensor is gathered whole and written once (a full state dict)", "sharded-checkpoints",
      _checkpoint_of_whole_tensors)


def _resume_with_fresh_moments():
    def load(original):
        def fresh(stage, directory):
            info = original(stage, directory)
            opt = getattr(stage.optimizer, "optimizer", stage.optimizer)
            for state in opt.state.values():
                for v in state.values():
                    if hasattr(v, "zero_"):
                        v.zero_()
            return info
        return fresh
    replace("zeronb.checkpoint", "load", load)


world("12_practice", "a resume that restarts Adam from zero moments", "a resumed run continues exactly: here the "
      "optimizer's moments and step count restart from zero", "sharded-checkpoints", _resume_with_fresh_moments)


def _export_in_float32():
    replace("zeronb.checkpoint", "export", lambda original: lambda directory, path=None: {
        k: v.float() for k, v in original(directory, path).items()})


world("12_practice", "an export in float32", "the export equals the saved parameters bit for bit: here it is cast "
      "to float32", "sharded-checkpoints", _export_in_float32)


def _checkpoint_without_early_stop():
    def patch(m):
        m._enable_checkpoint_early_stop = False
    when_imported("torch.utils.checkpoint", patch)


world("12_practice", "a checkpoint that recomputes every region to its end", "the non-reentrant checkpoint stops "
      "recomputing once backward has what it needs: here it runs every region's forward to its end", "checkpointing",
      _checkpoint_without_early_stop)



def _zero3_gathers_again_in_the_recompute():
    """Activation checkpointing as torch's checkpoint_wrapper applies it, each unit's whole call (its hooks
    too) inside the checkpoint and run again by the recompute; and a ZeRO-3 whose pre-forward hook gathers
    whether or not the unit is gathered already. Together: the recompute gathers each unit once more."""
    def checkpoint_activations(original):
        def around(model):
            from torch.utils.checkpoint import checkpoint

            def forward(idx):
                x = checkpoint(model.embed, idx, use_reentrant=False)
                for block in model.blocks:
                    x = checkpoint(block, x, use_reentrant=False)
                return checkpoint(model.head, x, use_reentrant=False)
            model.forward = forward
            return model
        return around
    replace("zeronb.models", "checkpoint_activations", checkpoint_activations)

    def patch(m):
        before = m.ZeRO3.pre_forward

        def pre_forward(self, u):
            if u.state == "unsharded":
                u.state = "sharded"  # gather again, even if the unit is here
            before(self, u)
        m.ZeRO3.pre_forward = pre_forward
    when_imported("zeronb.zero.zero3", patch)


world("12_practice", "a ZeRO-3 that gathers again in the recompute", "with checkpointing per unit, ZeRO-3 gathers "
      "nothing more: here each unit's call, hooks and all, is recomputed, and its pre-forward hook gathers again",
      "checkpointing", _zero3_gathers_again_in_the_recompute)
