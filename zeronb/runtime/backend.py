"""Which backend and device each rank uses.

Everything that depends on the machine (GPUs or not) lives here, so that the rest of zeronb, the
notebooks and the tests can stay the same everywhere. (What depends on the torch version is in
zeronb.runtime.compat; the process groups in zeronb.runtime.groups.)
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .compat import backend_config

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


def join_torchrun_group() -> None:
    """Under torchrun: join its process group (env:// reads RANK, WORLD_SIZE, MASTER_ADDR/PORT),
    on this node's GPU LOCAL_RANK where every local rank has one, on the CPU otherwise."""
    local_rank, per_node = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if dist.is_nccl_available() and cuda_device_count() >= per_node:  # one GPU per local rank, as for a pool
        join_group("nccl", torch.device("cuda", local_rank))
    else:
        join_group("gloo", torch.device("cpu"))


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
    config = backend_config(group)
    per_device = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
    return per_device.get(kind, config if ":" not in config else "")
