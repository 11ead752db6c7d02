"""PyTorch's own counterparts of the stages, behind the same Stage interface as zeronb.zero's, so
that `python -m zeronb.train --impl torch` and the chapters can run them side by side.

    stage 0: torch.nn.parallel.DistributedDataParallel
    stage 1: DDP + torch.distributed.optim.ZeroRedundancyOptimizer
    stage 2: FSDP2 fully_shard(reshard_after_forward=False)   (parameters stay gathered until backward)
    stage 3: FSDP2 fully_shard(reshard_after_forward=True)
    with a replica group (HSDP): FSDP2 on a 2-D mesh, replicas on dimension 0, shards on dimension 1

DDP all-reduces from C++, out of sight of zeronb.ledger; a communication hook that calls
dist.all_reduce from Python (what DDP's default hook does: divide by N, then all-reduce the sum)
makes it visible.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import memory
from ..runtime.backend import device
from ..runtime.groups import device_mesh
from ..runtime.compat import dtensor, fsdp2_unsharded_grads, fully_shard, mixed_precision_policy
from .stage import Stage


def _allreduce_hook(state, bucket):
    """DDP's default communication (torch.distributed.algorithms.ddp_comm_hooks.default_hooks:
    divide by N, all-reduce the sum), from Python so that the ledger counts it; in the reduce dtype
    of `state` (reduce_dtype, group) if one is given, as its bf16_compress_hook does."""
    reduce_dtype, group = state
    buf = bucket.buffer()
    n = dist.get_world_size(group)
    send = buf.div_(n) if reduce_dtype in (None, buf.dtype) else buf.to(reduce_dtype).div_(n)
    work = dist.all_reduce(send, group=group, async_op=True).get_future()
    return work.then(lambda fut: fut.value()[0] if send is buf else buf.copy_(fut.value()[0]))


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an FSDP2 DTensor gathered from its shards, any other as it is."""
    DTensor, _, _ = dtensor()
    return t.full_tensor() if isinstance(t, DTensor) else t


class TorchStage(Stage):
    def __init__(self, model, stage: int, config=None, observers=(), reshard_last_unit: bool = True,
                 hpz: bool = False):
        """`reshard_last_unit` (FSDP2, stage 3): False keeps the last unit's parameters gathered from
        its forward to its backward, as zeronb's ZeRO-3 does. `hpz` (stage 3): after forward, reshard
        each unit to the ranks of one node (reshard_after_forward=g), so that backward gathers within
        the node: FSDP2's counterpart of ZeRO++'s hpZ."""
        super().__init__(model, config, observers)
        self.stage, cfg, dev = stage, self.config, device()
        optimizer_class = torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.SGD
        self._norm = None
        if stage in (0, 1):
            from torch.nn.parallel import DistributedDataParallel

            group = None if self.replica_group is not None else self.shard_group  # every replica averages
            self.wrapped = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                                                   process_group=group)
            self.wrapped.register_comm_hook((cfg.reduce_dtype, group), _allreduce_hook)
            if stage == 0:
                self.optimizer = optimizer_class(model.parameters(), lr=cfg.lr, foreach=False)
            else:
                from torch.distributed.optim import ZeroRedundancyOptimizer

                self.optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class,
                                                         process_group=self.shard_group, lr=cfg.lr, foreach=False)
        else:
            if self.shard_group is not None and self.replica_group is None:
                raise ValueError("FSDP2 here shards over all ranks, or over groups of consecutive ranks with "
                                 "replicas (zeronb.runtime.groups.sharding_groups)")
            mesh = device_mesh(self.shards, self.data_parallel // self.shards)
            reshard = stage == 3
            if hpz:
                from ..runtime.topology import Topology

                if stage != 3 or Topology.from_env().nodes == 1:
                    raise ValueError("hpz is stage 3's, and needs a pool on several nodes")
                reshard = Topology.from_env().per_node  # the node's ranks: backward gathers within it
            self.wrapped = self.fully_shard(model, mesh, reshard, reshard_last_unit)
            self.optimizer = optimizer_class(model.parameters(), lr=cfg.lr, foreach=False)
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

    def detach(self):
        raise ValueError("PyTorch's DDP and fully_shard cannot be taken off a model: build a new model "
                         "(zeronb.models.make_model) for another stage")

    def loss(self, x, y):
        return self.model.loss(self.wrapped(x), y)

    def gradient_sync(self, sync):
        """Skipping the gradient sync on all but the last micro-batch: DDP's `no_sync()`, FSDP2's
        `set_requires_gradient_sync(False)`."""
        import contextlib

        if self.stage in (0, 1):
            return contextlib.nullcontext() if sync else self.wrapped.no_sync()
        self.model.set_requires_gradient_sync(sync)
        if self.replica_group is not None:  # HSDP: the replicas' all-reduce once per step (MiCS's two hops)
            self.model.set_requires_all_reduce(self.last_micro_batch)
        return contextlib.nullcontext()

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

    def state_tensors(self):
        local = self.optimizer.optim if self.stage == 1 else self.optimizer  # ZeroRedundancyOptimizer: its shard's
        # FSDP2 accumulating without sync keeps the full gradients apart from the sharded .grad
        accumulated = fsdp2_unsharded_grads(self.model) if self.stage in (2, 3) else []
        return {"params": list(self.model.parameters()), "grads": [p.grad for p in self.model.parameters()] + accumulated,
                "optimizer": memory.optimizer_tensors(local)}

    def full_parameters(self):
        return {name: _full(p).detach().clone() for name, p in self.model.named_parameters()}

    def shard_pieces(self, tensors):
        """DDP and ZeroRedundancyOptimizer: whole gradients. FSDP2: each parameter's dim-0 shard
        (torch.chunk's rows), a DTensor whose local part this rank holds."""
        DTensor, _, _ = dtensor()
        out = {}
        for (name, p), t in zip(self.model.named_parameters(), tensors):
            if isinstance(t, DTensor):
                local = t.to_local()
                rows = -(-p.shape[0] // self.shards)  # per rank
                start = self.rank * rows * (p.numel() // p.shape[0])
                out[name] = (start, start + local.numel(), local.reshape(-1))
            else:
                out[name] = (0, t.numel(), t.reshape(-1))
        return out

    def checkpoint_state(self):
        """The model's and optimizer's state dicts as DCP expects them (torch.distributed.checkpoint.
        state_dict). ZeroRedundancyOptimizer keeps the state of the parameters this rank owns, in its
        local optimizer: saved under their names, loaded in place by whichever rank owns them then."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        from .optim import init_state

        if self.stage != 1:
            return {"model": get_model_state_dict(self.model),
                    "optim": get_optimizer_state_dict(self.model, self.optimizer)}
        local = self.optimizer.optim
        init_state(local)
        names = {p: n for n, p in self.model.named_parameters()}
        owned = {f"optim.{names[p]}.{k}": v for group in local.param_groups for p in group["params"]
                 for k, v in local.state[p].items()}
        return {"model": get_model_state_dict(self.model), **owned}

    def load_checkpoint_state(self, state):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(self.model, state["model"])
        if self.stage != 1:
            set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        # (ZeroRedundancyOptimizer's states were loaded in place, into its local optimizer)
