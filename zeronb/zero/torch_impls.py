"""PyTorch's own counterparts of the stages, behind the same Stage interface as zeronb.zero's, so
that `python -m zeronb.train --impl torch` and the chapters can run them side by side.

    stage 0: TorchDDP    torch.nn.parallel.DistributedDataParallel
    stage 1: TorchZeRO1  DDP + torch.distributed.optim.ZeroRedundancyOptimizer
    stage 2: TorchFSDP   FSDP2 fully_shard(reshard_after_forward=False)   (parameters stay gathered until backward)
    stage 3: TorchFSDP   FSDP2 fully_shard(reshard_after_forward=True)
    with a replica group (HSDP): FSDP2 on a 2-D mesh, replicas on dimension 0, shards on dimension 1

Checkpoints go through torch.distributed.checkpoint.state_dict (FSDP2's parameters are DTensors
already). ZeroRedundancyOptimizer keeps each parameter's Adam state on the one rank that owns the
parameter; that rank saves it under the parameter's name, and on resume each rank loads the states
of the parameters it owns then.

One class per counterpart, each applying PyTorch's wrapper in its constructor (as torchtitan applies
each parallelism in its own function); `torch_stage(model, stage, config)` picks one by stage.

DDP all-reduces from C++, out of sight of zeronb.ledger; a communication hook that calls
dist.all_reduce from Python (what DDP's default hook does: divide by N, then all-reduce the sum)
makes it visible. The same hook keeps a reference to the reducer's bucket buffers (C++ too), so
that a sweep of what the stage holds (zeronb.memory.resident_bytes) counts them; `state_tensors`
lists each parameter's `.grad` only.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from .. import memory
from ..checkpoint import MODEL, OPTIM, optimizer_key
from ..precision import optimizer_class
from ..runtime.backend import device
from ..runtime.compat import dtensor, fsdp2_unsharded_grads, fully_shard, mixed_precision_policy
from ..runtime.groups import device_mesh
from ..runtime.topology import Topology
from .optim import init_state
from .stage import Stage


HPZ_NEEDS = "hpz is stage 3's, and needs a pool on several nodes"


class _HookState:
    """What `_allreduce_hook` is handed: the reduce dtype and group, and `buckets`, the flat buffers
    of DDP's reducer as the hook was last handed them ({bucket index: tensor}). The reducer keeps
    them in C++, where no sweep of Python objects reaches; held here (they are the reducer's own
    tensors: no copy), they are counted with everything else the stage holds. With DDP's default
    `gradient_as_bucket_view=False` they are a second copy of the gradients, beside each `.grad`."""

    def __init__(self, reduce_dtype, group):
        self.reduce_dtype, self.group, self.buckets = reduce_dtype, group, {}


def _allreduce_hook(state, bucket):
    """DDP's communication as its Python default hook does it (default_hooks.allreduce_hook in
    torch.distributed.algorithms.ddp_comm_hooks: divide by N, all-reduce the sum; with no hook
    registered, DDP's C++ reducer instead scales by 1/N while copying each gradient into its bucket,
    the same bits for N a power of two), from Python so that the ledger counts it; in the reduce dtype
    of `state` (a _HookState) if one is given, as its bf16_compress_hook does. It notes the bucket's
    buffer in `state.buckets` (the reducer hands its buckets over in index order: bucket 0 begins a
    backward)."""
    buf = bucket.buffer()
    if bucket.index() == 0:
        state.buckets.clear()
    state.buckets[bucket.index()] = buf
    reduce_dtype, group = state.reduce_dtype, state.group
    n = dist.get_world_size(group)
    send = buf.div_(n) if reduce_dtype in (None, buf.dtype) else buf.to(reduce_dtype).div_(n)
    work = dist.all_reduce(send, group=group, async_op=True).get_future()
    return work.then(lambda fut: fut.value()[0] if send is buf else buf.copy_(fut.value()[0]))


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an FSDP2 DTensor gathered from its shards, any other as it is."""
    DTensor, _, _ = dtensor()
    return t.full_tensor() if isinstance(t, DTensor) else t


class TorchStage(Stage):
    """What PyTorch's counterparts share: the wrapped model computes the loss, the optimizer is
    torch's own (on the whole model, or on this rank's part of it), clipping is torch's."""

    def __init__(self, model, config=None, observers=()):
        super().__init__(model, config, observers)
        self._norm = None

    def loss(self, x, y):
        return self.model.loss(self.wrapped(x), y)

    def detach(self):
        raise ValueError("PyTorch's DDP and fully_shard cannot be taken off a model: build a new model "
                         "(zeronb.models.make_model) for another stage")

    def step(self):
        params = list(self.model.parameters())
        self.tell("optimizer step", [p.grad for p in params])  # (before clipping, as zeronb's stages tell it)
        if self.config.clip_norm is not None:  # FSDP2's gradients are DTensors: the norm over every shard
            self._norm = torch.nn.utils.clip_grad_norm_(params, self.config.clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)  # (the gradients stay allocated, as DDP's buckets do)

    @property
    def last_grad_norm(self):
        return None if self._norm is None else _full(self._norm).item()

    def full_parameters(self):
        return {name: _full(p).detach().clone() for name, p in self.model.named_parameters()}

    def state_tensors(self):
        return {"params": list(self.model.parameters()), "grads": [p.grad for p in self.model.parameters()],
                "optimizer": memory.optimizer_tensors(self.optimizer)}

    def shard_pieces(self, tensors):
        """Whole gradients, one per parameter."""
        return {name: (0, t.numel(), t.reshape(-1)) for (name, _), t in zip(self.model.named_parameters(), tensors)}

    def checkpoint_state(self):
        """The model's and optimizer's state dicts as DCP expects them (torch.distributed.checkpoint.state_dict)."""
        return {MODEL: get_model_state_dict(self.model), OPTIM: get_optimizer_state_dict(self.model, self.optimizer)}

    def load_checkpoint_state(self, state):
        set_model_state_dict(self.model, state[MODEL])
        set_optimizer_state_dict(self.model, self.optimizer, state[OPTIM])


class TorchDDP(TorchStage):
    """Stage 0: DistributedDataParallel, its all-reduce through `_allreduce_hook` (so the ledger counts it)."""

    stage = 0

    def __init__(self, model, config=None, observers=()):
        super().__init__(model, config, observers)
        dev = device()
        group = None if self.replica_group is not None else self.shard_group  # every replica averages
        self.wrapped = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                                               process_group=group)
        self.comm_state = _HookState(self.config.reduce_dtype, group)  # (its buckets: swept with the stage)
        self.wrapped.register_comm_hook(self.comm_state, _allreduce_hook)
        self.optimizer = self.make_optimizer()
        self.claim_model()

    def make_optimizer(self):
        return optimizer_class(self.config.optimizer)(self.model.parameters(), lr=self.config.lr, foreach=False)

    def gradient_sync(self, sync):
        """Skipping the gradient sync on all but the last micro-batch: DDP's `no_sync()`."""
        return contextlib.nullcontext() if sync else self.wrapped.no_sync()


class TorchZeRO1(TorchDDP):
    """Stage 1: DDP's all-reduce, and ZeroRedundancyOptimizer: each rank keeps the optimizer state
    of its share of the parameters, steps them, and broadcasts them to the others."""

    stage = 1

    def make_optimizer(self):
        return ZeroRedundancyOptimizer(self.model.parameters(), optimizer_class=optimizer_class(self.config.optimizer),
                                       process_group=self.shard_group, lr=self.config.lr, foreach=False)

    def state_tensors(self):
        held = super().state_tensors()
        held["optimizer"] = memory.optimizer_tensors(self.optimizer.optim)  # its local optimizer: this rank's share
        return held

    def checkpoint_state(self):
        """ZeroRedundancyOptimizer keeps the state of the parameters this rank owns, in its local
        optimizer: saved under their names, loaded in place by whichever rank owns them then."""
        local = self.optimizer.optim
        init_state(local)
        names = {p: n for n, p in self.model.named_parameters()}
        owned = {optimizer_key(names[p], k): v for group in local.param_groups for p in group["params"]
                 for k, v in local.state[p].items()}
        return {MODEL: get_model_state_dict(self.model), **owned}

    def load_checkpoint_state(self, state):
        set_model_state_dict(self.model, state[MODEL])  # (the optimizer's states were loaded in place)


class TorchFSDP(TorchStage):
    """Stages 2 and 3: FSDP2's `fully_shard` on every unit and on the whole model."""

    def __init__(self, model, stage: int, config=None, observers=(), reshard_last_unit: bool = True,
                 hpz: bool = False):
        """`reshard_last_unit` (stage 3): False keeps the last unit's parameters gathered from its
        forward to its backward, as zeronb's ZeRO-3 does. `hpz` (stage 3): after forward, reshard
        each unit to the ranks of one node (reshard_after_forward=g), so that backward gathers within
        the node: FSDP2's counterpart of ZeRO++'s hpZ. (FSDP2 then makes a mesh of the node's ranks for
        each unit itself: `reshard_after_forward` takes a number, not a mesh.)"""
        super().__init__(model, config, observers)
        self.stage = stage
        if self.shard_group is not None and self.replica_group is None:
            raise ValueError("FSDP2 here shards over all ranks, or over groups of consecutive ranks with "
                             "replicas (zeronb.runtime.groups.sharding_groups)")
        mesh = device_mesh(self.num_shards, self.data_parallel // self.num_shards)
        if self.replica_group is not None and (mesh.get_group("shard"), mesh.get_group("replicate")) != \
                (self.shard_group, self.replica_group):
            raise ValueError("FSDP2 shards and replicates over the device mesh's groups: take them from "
                             "zeronb.runtime.groups.sharding_groups")
        reshard = stage == 3
        if hpz:
            if stage != 3 or Topology.from_env().nodes == 1:
                raise ValueError(HPZ_NEEDS)
            reshard = Topology.from_env().per_node  # the node's ranks: backward gathers within it
        self.wrapped = self.fully_shard(model, mesh, reshard, reshard_last_unit)
        self.optimizer = optimizer_class(self.config.optimizer)(model.parameters(), lr=self.config.lr, foreach=False)
        self.claim_model()

    def fully_shard(self, model, mesh, reshard_after_forward: bool | int, reshard_last_unit: bool = True):
        """FSDP2's wrapping: `fully_shard` on each unit, bottom-up, then on the whole model. Each
        call makes its module one group whose parameters are gathered and reduce-scattered together."""
        shard = fully_shard()  # torch.distributed.fsdp.fully_shard (elsewhere before torch 2.6)
        kw = {"mp_policy": mixed_precision_policy()(reduce_dtype=self.config.reduce_dtype)} if self.config.reduce_dtype else {}
        units = model.units()
        for unit in units:
            keep = unit is units[-1] and not reshard_last_unit
            shard(unit, mesh=mesh, reshard_after_forward=False if keep else reshard_after_forward, **kw)
        shard(model, mesh=mesh, reshard_after_forward=bool(reshard_after_forward), **kw)
        return model

    def gradient_sync(self, sync):
        """Skipping the gradient sync on all but the last micro-batch: `set_requires_gradient_sync(False)`."""
        self.model.set_requires_gradient_sync(sync)
        if self.replica_group is not None:  # HSDP: the replicas' all-reduce once per step (MiCS's two hops)
            self.model.set_requires_all_reduce(self.last_micro_batch)
        return contextlib.nullcontext()

    def state_tensors(self):
        held = super().state_tensors()
        held["grads"] += fsdp2_unsharded_grads(self.model)  # accumulating without sync: full gradients apart
        return held

    def shard_pieces(self, tensors):
        """Each parameter's dim-0 shard (torch.chunk's rows), a DTensor whose local part this rank holds."""
        DTensor, _, _ = dtensor()
        out = {}
        for (name, p), t in zip(self.model.named_parameters(), tensors):
            if isinstance(t, DTensor):
                local = t.to_local()
                rows = -(-p.shape[0] // self.num_shards)  # per rank
                start = self.shard_rank * rows * (p.numel() // p.shape[0])
                out[name] = (start, start + local.numel(), local.reshape(-1))
            else:
                out[name] = (0, t.numel(), t.reshape(-1))
        return out


def torch_stage(model, stage: int, config=None, observers=(), **fsdp) -> TorchStage:
    """PyTorch's counterpart of zeronb's stage `stage` (0-3) on `model`; `fsdp`: TorchFSDP's own
    arguments (reshard_last_unit, hpz) for stages 2 and 3."""
    if stage in (0, 1):
        if fsdp.get("hpz"):
            raise ValueError(HPZ_NEEDS)
        return (TorchDDP if stage == 0 else TorchZeRO1)(model, config, observers)
    return TorchFSDP(model, stage, config, observers, **fsdp)
