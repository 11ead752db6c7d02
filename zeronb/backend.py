"""Which backend and device each rank uses, and the torch-version shims.

Everything that depends on the machine (GPUs or not) or on the torch version lives here, so that
the rest of zeronb, the notebooks and the tests can stay the same everywhere.
"""
from __future__ import annotations

import os
import socket
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist

BACKENDS = ("auto", "gloo", "nccl")


def cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_backend(world_size: int, backend: str = "auto") -> tuple[str, str]:
    """Return (backend, why): the backend a pool of `world_size` ranks uses, and one line saying why.

    NCCL needs one GPU per rank (two ranks on one GPU fail with "Duplicate GPU detected"), so "auto"
    picks NCCL only when there are at least `world_size` GPUs, and gloo on CPU otherwise.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, not {backend!r}")
    if not dist.is_available():
        raise RuntimeError("this build of torch has no torch.distributed; install a build that has it")
    gpus = cuda_device_count()
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise ValueError("backend='nccl' asked for, but this torch build has no NCCL "
                             "(a CPU build?). Use backend='gloo' or 'auto'.")
        if gpus < world_size:
            raise ValueError(f"backend='nccl' needs one GPU per rank: {world_size} ranks, but "
                             f"{gpus} GPU(s) visible. Use fewer ranks, or backend='gloo' to run on CPU.")
        return "nccl", f"nccl: {world_size} ranks on {world_size} of {gpus} GPU(s), one GPU per rank"
    if backend == "auto" and gpus >= world_size and dist.is_nccl_available():
        return "nccl", f"nccl: {gpus} GPU(s) for {world_size} ranks, one GPU per rank"
    if not dist.is_gloo_available():
        raise RuntimeError("this torch build has no gloo backend, and gloo is what runs on CPU")
    if backend == "gloo":
        why = "gloo on CPU, as asked"
    elif gpus == 0:
        why = "gloo on CPU: no GPU visible"
    else:
        why = f"gloo on CPU: {world_size} ranks need {world_size} GPUs for nccl, {gpus} visible"
    return "gloo", why


def rank_device(backend: str, rank: int) -> torch.device:
    """The device a rank computes on: its own GPU under NCCL (all ranks on one machine, so the
    global rank picks it), the CPU under gloo."""
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def group_backend(backend: str) -> str:
    """What `init_process_group` is given. An NCCL pool is a group per device type: CUDA tensors go
    over NCCL, CPU tensors over gloo, so that a lesson's small CPU tensor (a count, a flag) never
    fails with "No backend type associated with device type cpu". Inside such a group,
    `dist.get_backend()` reads "cpu:gloo,cuda:nccl"; `backend_for(tensor)` says which one a tensor
    takes."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


_rank_device: torch.device | None = None  # set once by join_group: the same in every thread


def join_group(backend: str, device: torch.device, *, store=None, rank: int = -1, world_size: int = -1,
               timeout=None) -> None:
    """Join the default process group as rank `rank` on `device`: what every rank does once (a
    pool's rank, a torchrun process). Under NCCL the rank binds its GPU first (`set_device` and
    `device_id`), so that NCCL never guesses it from the rank number."""
    global _rank_device
    kw = {"timeout": timeout} if timeout is not None else {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kw["device_id"] = device
    dist.init_process_group(group_backend(backend), store=store, rank=rank, world_size=world_size, **kw)
    _rank_device = device


def device() -> torch.device:
    """Inside a rank: the device this rank's tensors should live on - its GPU in an NCCL group,
    the CPU otherwise. It does not depend on the calling thread (unlike torch.cuda.current_device)."""
    if _rank_device is not None and dist.is_initialized():
        return _rank_device
    if dist.is_initialized() and backend_for("cuda") == "nccl":  # a group zeronb did not create
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    return torch.device("cpu")


def backend_for(what="cpu", group=None) -> str:
    """The backend that carries tensors of this kind (a tensor, a device or "cpu"/"cuda") in the
    group: "gloo" or "nccl". Ask this rather than compare `dist.get_backend()` with "nccl", which
    reads "cpu:gloo,cuda:nccl" in a group with a backend per device."""
    kind = what.device.type if isinstance(what, torch.Tensor) else torch.device(what).type
    config = str(dist.get_backend_config(group)) if hasattr(dist, "get_backend_config") else dist.get_backend(group)
    per_device = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
    return per_device.get(kind, config if ":" not in config else "")


def loopback_interface() -> str:
    """Name of the loopback interface, for GLOO_SOCKET_IFNAME (gloo otherwise binds to whatever the
    hostname resolves to, which may be a public address)."""
    try:
        for _, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    except OSError:
        pass
    return "lo0" if sys.platform == "darwin" else "lo"


def loopback_store(world_size: int, timeout) -> dist.TCPStore:
    """The rendezvous store, hosted by the calling process on 127.0.0.1 and a free port.

    TCPStore binds every interface when it opens its own socket; handing it a socket already bound
    to 127.0.0.1 keeps it off the network. Port 0 lets the OS pick a free port, so two notebooks
    never collide (and nothing races between choosing a port and binding it).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(max(64, world_size))
    port = sock.getsockname()[1]
    # the store owns the listening socket from here on (detach: Python must not close it)
    kw = dict(world_size=None, is_master=True, timeout=timeout, wait_for_workers=False,
              master_listen_fd=sock.detach())
    try:
        store = dist.TCPStore("127.0.0.1", port, **kw)
    except (RuntimeError, ValueError):  # older libuv stores do not take a listening fd
        store = dist.TCPStore("127.0.0.1", port, use_libuv=False, **kw)
    return store


# --- torch-version shims: the only place that looks at the torch version ---------------------
# torch 2.13 added all_gather_single / reduce_scatter_single and deprecated the *_tensor names.

if hasattr(dist, "all_gather_single"):
    def all_gather_single(output, input, group=None, async_op=False):
        return dist.all_gather_single(output, input, group=group, async_op=async_op)

    def _torch_reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return dist.reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)
else:
    def all_gather_single(output, input, group=None, async_op=False):
        return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)

    def _torch_reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)

all_gather_single.__doc__ = "all-gather into one flat tensor (all_gather_single, or its pre-2.13 name)"

_reduce_scatter_by_ring = False  # a module flag, not a context variable: autograd hooks run in other threads


def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """Reduce-scatter one flat tensor (reduce_scatter_single, or its pre-2.13 name), or, inside
    `ring_reduce_scatter()`, zeronb's ring."""
    if _reduce_scatter_by_ring and group is None and not async_op and op == dist.ReduceOp.SUM:
        from .collectives import ring_reduce_scatter

        output.copy_(ring_reduce_scatter(input))
        return None
    return _torch_reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


@contextmanager
def ring_reduce_scatter():
    """Run the stages' reduce-scatters as zeronb's ring (point-to-point sends) while the context is
    open. PyTorch's gloo group carries out a reduce-scatter as a whole all-reduce, twice the bytes;
    the ring sends the (N-1)/N of the tensor a reduce-scatter needs, so that bytes on the wire
    measure the algorithm rather than gloo's shortcut."""
    global _reduce_scatter_by_ring
    before, _reduce_scatter_by_ring = _reduce_scatter_by_ring, True
    try:
        yield
    finally:
        _reduce_scatter_by_ring = before


def fully_shard():
    """PyTorch FSDP2's `fully_shard` (torch.distributed.fsdp from 2.6; the _composable path before)."""
    try:
        from torch.distributed.fsdp import fully_shard as fn
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard as fn
    return fn


def mixed_precision_policy():
    """FSDP2's `MixedPrecisionPolicy` (torch.distributed.fsdp from 2.6; the _composable path before)."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy as cls
    except ImportError:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy as cls
    return cls


def sharded_1d(local: torch.Tensor, numel: int, mesh) -> torch.Tensor:
    """A DTensor of `numel` elements, Shard(0) over a 1-D `mesh`, of which this rank holds `local`
    (torch.chunk's piece: zeronb.shards.bounds). torch.distributed.tensor from 2.5; _tensor before."""
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:
        from torch.distributed._tensor import DTensor, Shard
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(numel,), stride=(1,))
