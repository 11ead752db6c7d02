"""The torch-version shims: the one place that looks at what the installed torch provides.

zeronb supports torch >= 2.4 (GPU boxes often have an older torch than the CPU build CI uses).
Everything that moved or was renamed between versions is looked up here, once; the rest of zeronb,
the notebooks and the tests call these names. This module imports nothing from zeronb.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# torch 2.13 added all_gather_single / reduce_scatter_single and deprecated the *_tensor names
# (a FutureWarning); 2.11 and 2.12 have only the old names.
if hasattr(dist, "all_gather_single"):
    def all_gather_single(output, input, group=None, async_op=False):
        """All-gather into one flat tensor (`output` holds every rank's `input`, in rank order)."""
        return dist.all_gather_single(output, input, group=group, async_op=async_op)

    def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        """Reduce-scatter one flat tensor (`output` is this rank's chunk of the sum)."""
        return dist.reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)
else:
    def all_gather_single(output, input, group=None, async_op=False):
        """All-gather into one flat tensor (`output` holds every rank's `input`, in rank order)."""
        return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)

    def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        """Reduce-scatter one flat tensor (`output` is this rank's chunk of the sum)."""
        return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


def backend_config(group=None) -> str:
    """The group's backends as a string: "gloo", or "cpu:gloo,cuda:nccl" for a group with one
    backend per device type."""
    return str(dist.get_backend_config(group))


def group_size_of(boxed) -> int | None:
    """The size of a process group as a c10d operator receives it (a ScriptObject): ProcessGroup.unbox
    from torch 2.3; None where it cannot be read (not a process group, or an older torch)."""
    try:
        return dist.ProcessGroup.unbox(boxed).size()
    except (AttributeError, RuntimeError):
        return None


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


def dtensor():
    """(DTensor, Shard, Replicate): torch.distributed.tensor from 2.5; torch.distributed._tensor before."""
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:
        from torch.distributed._tensor import DTensor, Replicate, Shard
    return DTensor, Shard, Replicate


def fsdp2_unsharded_grads(model) -> list:
    """The full gradients FSDP2 holds outside the parameters' own (sharded) `.grad`: while gradient
    sync is off (accumulating without reduce-scattering), each unit keeps its unsharded gradients
    on its FSDPParams (`_unsharded_param.grad`, or `unsharded_accumulated_grad` in reduce_dtype).
    Private attributes of torch.distributed.fsdp's implementation, the same from torch 2.4 to 2.13;
    an empty list where they are not found."""
    out = []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
        for group in groups:
            for fsdp_param in getattr(group, "fsdp_params", []) if group is not None else []:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                out += [t for t in (getattr(unsharded, "grad", None), getattr(fsdp_param, "unsharded_accumulated_grad", None))
                        if t is not None]
    return out


def after_new_group(callback) -> None:
    """Call `callback()` in this process each time torch has made a process group here, before the
    group is handed back: `new_group`, `new_subgroups*` and a DeviceMesh's groups on gloo all go
    through `distributed_c10d._new_process_group_helper` (torch 2.4 to 2.13; only `split_group`,
    which a mesh uses for NCCL communicators, does not). torch offers no public hook for this, so
    the helper is wrapped, once per process; a group's connections exist when it returns."""
    helper = c10d._new_process_group_helper
    if not hasattr(helper, "callbacks"):
        made = helper

        def helper(*args, **kwargs):
            out = made(*args, **kwargs)
            for fn in helper.callbacks:
                fn()
            return out

        helper.callbacks = []
        c10d._new_process_group_helper = helper
    if callback not in helper.callbacks:
        helper.callbacks.append(callback)


def torch_version() -> tuple:
    """The installed torch's (major, minor)."""
    return tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


def expected_avg_outcomes(op: str, backend: str) -> set:
    """What `op=ReduceOp.AVG` does in `op` ("all_reduce" or "reduce_scatter") on `backend` with this
    torch: a subset of {"refused", "ignored: a sum", "honoured"} (zeronb never asks for AVG: chapter 8).
    NCCL averages. gloo's all-reduce gained AVG in pytorch#149781 (merged March 2025: torch 2.8 has it,
    2.7 may) and refuses it before. gloo's reduce-scatter runs an all-reduce of a copy of its input and
    did not hand it the op until pytorch#171458 (merged 2025-12-29: torch 2.11 has it, 2.10 may):
    before, it accepts AVG and sums (pytorch#162338)."""
    version = torch_version()
    if backend == "nccl":
        return {"honoured"}
    if backend != "gloo" or op not in ("all_reduce", "reduce_scatter"):
        return {"refused", "ignored: a sum", "honoured"}
    before, fixed_in = {"all_reduce": ("refused", (2, 8)), "reduce_scatter": ("ignored: a sum", (2, 11))}[op]
    if version >= fixed_in:
        return {"honoured"}
    return {before, "honoured"} if version == (fixed_in[0], fixed_in[1] - 1) else {before}


def default_store():
    """The key-value store the default process group was made with (its rendezvous store): ranks can
    tell each other things outside the group's collectives, with a timeout. torch has had
    `distributed_c10d._get_default_store` since 1.x and no public name for it."""
    return c10d._get_default_store()
