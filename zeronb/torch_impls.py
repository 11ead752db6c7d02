"""PyTorch's own counterparts of the stages, behind the same interface as zeronb.zero's engines,
so that `python -m zeronb.train --impl torch` and the chapters can run them side by side.

    stage 0: torch.nn.parallel.DistributedDataParallel
    stage 1: DDP + torch.distributed.optim.ZeroRedundancyOptimizer
    stage 2: FSDP2 fully_shard(reshard_after_forward=False)   (parameters stay gathered until backward)
    stage 3: FSDP2 fully_shard(reshard_after_forward=True)

DDP all-reduces from C++, out of sight of zeronb.ledger; a communication hook that calls
dist.all_reduce from Python (what DDP's default hook does: sum, then divide by N) makes it visible.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import memory
from .backend import device, fully_shard, mixed_precision_policy


def _allreduce_hook(reduce_dtype, bucket):
    """DDP's default communication (torch.distributed.algorithms.ddp_comm_hooks.default_hooks:
    divide by N, all-reduce the sum), from Python so that the ledger counts it; in `reduce_dtype`
    if one is given (the state DDP hands the hook), as its bf16_compress_hook does."""
    buf = bucket.buffer()
    send = buf.div_(dist.get_world_size()) if reduce_dtype in (None, buf.dtype) else \
        buf.to(reduce_dtype).div_(dist.get_world_size())
    work = dist.all_reduce(send, async_op=True).get_future()
    return work.then(lambda fut: fut.value()[0] if send is buf else buf.copy_(fut.value()[0]))


class TorchStage:
    clip_norm = None  # torch.nn.utils.clip_grad_norm_ before each step (FSDP2's sharded grads too)
    last_grad_norm = None
    measure_memory = False
    activation_bytes = None

    def __init__(self, model, stage: int, lr: float = 1e-3, sync_each_micro_batch: bool = True,
                 reduce_dtype: torch.dtype | None = None):
        self.stage, self.model = stage, model
        self.sync_each_micro_batch = sync_each_micro_batch
        dev = device()
        if stage in (0, 1):
            from torch.nn.parallel import DistributedDataParallel

            ids = [dev.index] if dev.type == "cuda" else None
            self.wrapped = DistributedDataParallel(model, device_ids=ids)
            self.wrapped.register_comm_hook(reduce_dtype, _allreduce_hook)
            if stage == 0:
                self.optimizer = torch.optim.Adam(model.parameters(), lr=lr, foreach=False)
            else:
                from torch.distributed.optim import ZeroRedundancyOptimizer

                self.optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                                         lr=lr, foreach=False)
        else:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
            shard = fully_shard()
            kw = {"mp_policy": mixed_precision_policy()(reduce_dtype=reduce_dtype)} if reduce_dtype else {}
            for unit in model.units():
                shard(unit, mesh=mesh, reshard_after_forward=(stage == 3), **kw)
            shard(model, mesh=mesh, reshard_after_forward=(stage == 3), **kw)
            self.wrapped = model
            self.optimizer = torch.optim.Adam(model.parameters(), lr=lr, foreach=False)

    def train_step(self, x, y, micro_batches: int = 1) -> float:
        """Like the engines': K micro-batches, one step. Skipping the gradient sync on all but the
        last is DDP's `no_sync()` and FSDP2's `set_requires_gradient_sync(False)`."""
        import contextlib

        total = 0.0
        for i, (xi, yi) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
            sync = self.sync_each_micro_batch or i == micro_batches - 1
            context = contextlib.nullcontext()
            if self.stage in (0, 1):
                context = contextlib.nullcontext() if sync else self.wrapped.no_sync()
            else:
                self.model.set_requires_gradient_sync(sync)
            with context:
                measuring = memory.saved_activations(exclude=self.model.parameters) if self.measure_memory \
                    else contextlib.nullcontext({"bytes": None})
                with measuring as saved:  # forward only
                    loss = self.model.loss(self.wrapped(xi), yi) / micro_batches
                self.activation_bytes = saved["bytes"]
                loss.backward()
            total += loss.item()
        if self.clip_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
            self.last_grad_norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()
        self.optimizer.step()
        self._last_grads = [p.grad for p in self.model.parameters()]  # resident until zeroed
        self.optimizer.zero_grad(set_to_none=False)
        return total

    def state_tensors(self):
        return {"params": list(self.model.parameters()), "grads": [p.grad for p in self.model.parameters()],
                "optimizer": memory.optimizer_tensors(getattr(self.optimizer, "optim", self.optimizer))}

    def full_parameters(self):
        out = {}
        for name, p in self.model.named_parameters():
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name.replace("module.", "", 1) if name.startswith("module.") else name] = t.detach().clone()
        return out
