"""DeepSpeed's own ZeRO, stages 1, 2 and 3, behind the same Stage interface as zeronb's and
PyTorch's, so that `python -m zeronb.train --impl deepspeed` and the chapters run it beside them.

    config = deepspeed_config(stage=2, world_size=4, global_batch=16)   # the keys DeepSpeed reads
    stage = DeepSpeedStage(model, 2, StageConfig(lr=1e-3), config)

DeepSpeed is driven as its users drive it: `deepspeed.initialize(model, optimizer, config)` with a
torch optimizer, then `engine(x)`, `engine.backward(loss)`, `engine.step()`. `deepspeed_config` is the
one place where zeronb's settings become DeepSpeed's keys. Nothing is compiled: on the CPU DeepSpeed
runs with its CPU accelerator over the pool's gloo group, and what needs one of its compiled ops
(DeepSpeedCPUAdam, FusedAdam, the quantized gathers and reductions of ZeRO++, offload) is refused
by `check_runs_here`, saying so.

What a rank holds is read from DeepSpeed's own tensors (`state_tensors`): the parameters the model
computes with (stage 3: each one's `ds_tensor`, its partition), the flat fp32 partitions its
optimizer updates and their state, and its gradient buffers. The gradients the optimizer steps with
are read by a pre-step hook on that optimizer, and placed in the parameters by DeepSpeed's own
layout (stages 1 and 2: each parameter's `_hp_mapping`; stage 3: `grad_position`).
"""
from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from ..precision import optimizer_class
from ..runtime.backend import device
from .config import StageConfig
from .stage import Stage

# What needs one of DeepSpeed's compiled ops, which zeronb never builds (the CPU wheel has none).
NEEDS_COMPILED_OPS = {
    "offload_optimizer": ("offloading the optimizer wants DeepSpeedCPUAdam, a compiled op (a torch optimizer runs there "
                          "only with zero_force_ds_cpu_optimizer: false, on the CPU, which is not the lesson)"),
    "offload_param": "offloading parameters needs DeepSpeed's compiled async I/O and pinned-memory ops",
    "zero_quantized_weights": "ZeRO++'s qwZ quantizes with compiled CUDA kernels",
    "zero_quantized_gradients": "ZeRO++'s qgZ quantizes with compiled CUDA kernels",
    "zero_quantized_nontrainable_weights": "quantized weights need compiled CUDA kernels",
}
ELEMENTS_PER_BUCKET = 16 << 10  # zeronb's buckets are 64 KiB of float32: DeepSpeed's sizes count elements
NEVER = 2**62  # more elements than any model has: a limit DeepSpeed never reaches


def deepspeed_config(stage: int, world_size: int, global_batch: int, *, precision: str = "float32",
                     micro_batches: int = 1, clip_norm: float | None = None, reduce_dtype: str | None = None,
                     prefetch: bool = False, reshard_after_forward: bool = True, hpz_ranks: int | None = None,
                     bucket_elements: int = ELEMENTS_PER_BUCKET, overrides: dict | None = None) -> dict:
    """The DeepSpeed config of a run: zeronb's settings under DeepSpeed's names. DeepSpeed's own
    defaults are for large models (500M-element buckets; stage 3 keeps every tensor of at most 100,000
    elements whole, and keeps parameters gathered from forward to backward while the elements between
    the two uses stay under 1e9, which holds for models of up to about half that); these make its
    reduce buckets the size of zeronb's and its stage 3 gather and free each unit as the chapters'
    ZeRO-3 does. (`allgather_bucket_size` is left out: stages 1-2 gather the whole flat buffer in one
    all_gather_into_tensor whatever it says, runtime/utils.py's all_gather_dp_groups.)
    `overrides`: DeepSpeed keys laid over the result (nested dicts merged)."""
    micro = global_batch // (world_size * micro_batches)
    zero = {
        "stage": stage,
        "reduce_bucket_size": bucket_elements,        # gradients reduced together (elements)
        "overlap_comm": False,                        # reduce in the backward's own order, on its stream
        "contiguous_gradients": True,                 # copy each reduced gradient into one flat buffer
    }
    if stage == 3:
        zero.update({
            "stage3_param_persistence_threshold": 0,  # partition every tensor, however small
            "stage3_prefetch_bucket_size": bucket_elements if prefetch else 0,  # gather the next unit early
            "stage3_max_live_parameters": NEVER,      # no limit on the parameters gathered at once
            # 0: free each module's parameters once it is done; NEVER: keep them until its backward (the
            # distance counts the elements of every module used in between, about 2 psi for the first)
            "stage3_max_reuse_distance": NEVER if not reshard_after_forward else 0,
        })
        if hpz_ranks:
            zero["zero_hpz_partition_size"] = hpz_ranks  # ZeRO++'s hpZ: a second copy within the node
    config = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": micro_batches,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,        # a plain torch optimizer (SGD too), not DeepSpeed's fused ones
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16-mixed":
        config["bf16"] = {"enabled": True}           # bf16 parameters, an fp32 copy in the optimizer
    # DeepSpeed clips to a norm of 1.0 unless told (runtime/constants.py: GRADIENT_CLIPPING_DEFAULT); 0 clips nothing
    config["gradient_clipping"] = 0.0 if clip_norm is None else clip_norm
    if reduce_dtype is not None:
        config["communication_data_type"] = reduce_dtype
    return _merged(config, overrides or {})


def _merged(base: dict, top: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in top.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def check_runs_here(config: dict) -> None:
    """Raise ValueError, saying why, for a DeepSpeed config that would need a compiled op."""
    zero = config.get("zero_optimization", {})
    for key, why in NEEDS_COMPILED_OPS.items():
        value = zero.get(key, config.get(key))
        if value not in (None, False, {}) and not (isinstance(value, dict) and value.get("device", "none") == "none"):
            raise ValueError(f"{key}: {why}, which zeronb does not build (pip's deepspeed has none compiled); "
                             "leave it out")
    if "optimizer" in config:
        raise ValueError("a DeepSpeed 'optimizer' section builds DeepSpeed's fused or CPU Adam (compiled ops); "
                         "zeronb passes a torch optimizer instead: leave the section out")
    if zero.get("stage") not in (1, 2, 3):
        raise ValueError("impl 'deepspeed' runs DeepSpeed's ZeRO stages 1, 2 and 3")


def import_deepspeed(dev: torch.device):
    """deepspeed, imported for this rank's device: its CPU accelerator on the CPU, CUDA's on a GPU
    (DeepSpeed picks an accelerator once per process, at import, from DS_ACCELERATOR), and none of
    its compiled ops (an empty table of compatible ops: nothing is built, not even the CPU's
    shared-memory all-reduce, which its inference alone uses)."""
    want = "cpu" if dev.type == "cpu" else "cuda"
    os.environ.setdefault("DS_ACCELERATOR", want)
    import deepspeed  # (deferred: 3 s, and only after DS_ACCELERATOR is set)
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    if get_accelerator().device_name() != want:
        raise RuntimeError(f"DeepSpeed's accelerator here is {get_accelerator().device_name()!r} (DS_ACCELERATOR="
                           f"{os.environ.get('DS_ACCELERATOR')}) but this rank computes on {dev}: unset DS_ACCELERATOR")
    deepspeed.ops.__compatible_ops__ = dict.fromkeys(ALL_OPS, False)
    _quiet(deepspeed)
    return deepspeed


def _quiet(deepspeed) -> None:
    """DeepSpeed logs its config and a warning per engine at INFO/WARNING; a notebook wants neither."""
    import logging

    deepspeed.utils.logger.setLevel(logging.ERROR)


def _tensors(value, depth=3):
    """The tensors in an attribute: a tensor, or inside lists, tuples, dicts and objects' fields."""
    if isinstance(value, torch.Tensor):
        yield value
        if value.grad is not None:
            yield value.grad
    elif depth and isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v, depth - 1)
    elif depth and isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v, depth - 1)
    elif depth and hasattr(value, "__dict__") and type(value).__module__.startswith("deepspeed"):
        for v in vars(value).values():
            yield from _tensors(v, depth - 1)


class DeepSpeedStage(Stage):
    """DeepSpeed's ZeRO stage 1, 2 or 3 on `model`, with the config `ds_config` (deepspeed_config's)."""

    def __init__(self, model, stage: int, config: StageConfig | None = None, ds_config: dict | None = None,
                 observers=()):
        super().__init__(model, config, observers)
        if self.replica_group is not None or self.shard_group is not None:
            raise ValueError("impl 'deepspeed' shards over every rank here (its MiCS and hpZ groups are its own)")
        self.stage = stage
        self.ds_config = ds_config or deepspeed_config(stage, dist.get_world_size(), dist.get_world_size())
        check_runs_here(self.ds_config)
        ds = import_deepspeed(device())
        opt = optimizer_class(self.config.optimizer)(model.parameters(), lr=self.config.lr, foreach=False)
        self.engine, self.optimizer, _, _ = ds.initialize(model=model, optimizer=opt, config=self.ds_config,
                                                          dist_init_required=False)
        self.micro_batches = self.ds_config["gradient_accumulation_steps"]
        self._ds = ds
        self._hook = opt.register_step_pre_hook(self._before_optimizer_step)
        self.claim_model()

    # -- the step: DeepSpeed's own loop ---------------------------------------------------------

    def train_step(self, x, y, micro_batches: int = 1) -> float:
        """One step: for each micro-batch `engine(x)`, `engine.backward(loss)` (which divides the
        loss by gradient_accumulation_steps itself) and `engine.step()` (which steps the optimizer
        after the last micro-batch only); the local loss, as zeronb's stages return it."""
        if micro_batches != self.micro_batches:
            raise ValueError(f"DeepSpeed fixes the micro-batches per step in its config (gradient_accumulation_steps "
                             f"= {self.micro_batches}); build the stage with {micro_batches}")
        losses = []
        try:
            for i, (xi, yi) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
                self.last_micro_batch = i == micro_batches - 1
                self.tell("forward pass", i)
                loss = self.model.loss(self.engine(xi), yi)
                self.tell("backward pass", i)
                self.engine.backward(loss)
                self.tell("backward pass done", i)
                self.engine.step()
                losses.append(loss.detach() / micro_batches)
        except BaseException:
            self.tell("step failed")
            raise
        self.tell("step done")
        return torch.stack(losses).sum().item()

    def _before_optimizer_step(self, optimizer, args, kwargs):
        """DeepSpeed's optimizer is about to step: its parameters' gradients are the averaged (and
        clipped) gradients of this rank's partitions."""
        if self.observers:
            self.tell("optimizer step", [p.grad for g in optimizer.param_groups for p in g["params"]])

    def detach(self):
        raise ValueError("DeepSpeed's engine cannot be taken off a model: build a new model for another stage")

    def close(self) -> None:
        """DeepSpeed's engine lets go of its hooks and buffers (before another engine on this rank)."""
        self._hook.remove()
        self.engine.destroy()

    @property
    def last_grad_norm(self):
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    # -- what it holds ----------------------------------------------------------------------------

    def _partitions(self) -> list:
        """The flat fp32 partitions DeepSpeed's optimizer updates, one per parameter group."""
        opt = self.optimizer
        return list(opt.fp32_partitioned_groups_flat if self.stage == 3 else opt.single_partition_of_fp32_groups)

    def state_tensors(self):
        """From DeepSpeed's own tensors: parameters (stages 1-2: the flat buffer the model's
        parameters are views of; stage 3: each one's partition, `ds_tensor`, and any still gathered),
        the optimizer's fp32 partitions and their state, and every gradient buffer it keeps."""
        opt, params = self.optimizer, list(self.model.parameters())
        held = [p.ds_tensor for p in params] if self.stage == 3 else list(opt.bit16_groups_flat)
        held += [p.data for p in params if p.data.numel()]  # (stage 3: a parameter gathered right now)
        fp32 = self._partitions()
        state = [t for s in opt.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        grads = [p.grad for p in params if p.grad is not None] + [t.grad for t in fp32 if t.grad is not None]
        known = {id(t) for t in held + fp32 + state + grads}
        grads += [t for name, v in vars(opt).items() if "grad" in name or "ipg" in name
                  for t in _tensors(v) if id(t) not in known]
        return {"params": held, "grads": grads, "optimizer": fp32 + state}

    def full_parameters(self):
        params = list(self.model.parameters())
        with self._ds.zero.GatheredParameters(params, enabled=self.stage == 3):
            return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def shard_pieces(self, tensors):
        """Which elements of each parameter the optimizer's partitions hold, `tensors` laid out like
        them: stages 1-2 by each parameter's `_hp_mapping` (where its fragment of this rank's flat
        partition starts, in the parameter and in the partition), stage 3 by `grad_position` (each
        parameter's own partition: elements [rank * size, (rank + 1) * size) of it, padded)."""
        opt, out = self.optimizer, {}
        if self.stage == 3:
            for group, flat in zip(opt.fp16_groups, tensors):
                for p in group:
                    _, offset, size = opt.grad_position[opt.get_param_id(p)]
                    start = min(self.shard_rank * size, p.ds_numel)
                    stop = min(start + size, p.ds_numel)
                    out[self.names[p]] = (start, stop, flat[offset:offset + stop - start])
            return out
        for group, flat in zip(opt.bit16_groups, tensors):
            for p in group:
                mapping = getattr(p, "_hp_mapping", None)
                if mapping is None:
                    continue  # no element of it in this rank's partition
                lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
                out[self.names[p]] = (lp.start, lp.start + lp.numel, flat[hp.start:hp.start + hp.numel])
        return out

    def checkpoint_state(self):
        raise ValueError("impl 'deepspeed' saves with DeepSpeed's engine.save_checkpoint, not zeronb's checkpoints")
