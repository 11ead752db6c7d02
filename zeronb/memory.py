"""Where training memory goes: the ZeRO paper's formulas, and measuring the tensors a rank keeps.

Model states, per parameter (Rajbhandari et al. 2020, section 3.1): in the paper's mixed-precision
recipe (zeronb's bf16-mixed), Adam keeps 2 bytes of bf16/fp16 parameters, 2 bytes of gradients, and
K = 12 bytes of optimizer state (an fp32 master copy of the parameters, Adam's momentum and variance,
the uncentred second moment the paper calls the variance): 16 bytes for every parameter, on every
data-parallel rank. (torch.autocast and FSDP2's MixedPrecisionPolicy split the same 16 as 4 + 4 + 8:
fp32 parameters and gradients, no separate master.) The ZeRO stages divide parts of it by the
number of ranks N (their N_d):

    stage 0 (DDP)   (2 + 2 + K) * psi
    stage 1         (2 + 2) * psi + K * psi / N                optimizer states sharded
    stage 2         2 * psi + (2 + K) * psi / N                  + gradients
    stage 3         (2 + 2 + K) * psi / N                        + parameters

Activations are not model states: they depend on the batch each rank processes, and ZeRO does not
shard them (chapter 6 measures them separately). The bytes per parameter of each precision and
optimizer are zeronb.precision's.
"""
from __future__ import annotations

import contextlib
from contextlib import contextmanager

import torch

from .precision import precision as _precision


def bytes_per_parameter(precision: str, optimizer: str = "adam") -> tuple:
    """(p, g, K): bytes of parameter, gradient and optimizer state per parameter, for a precision
    ("float32", "float64", "bf16-mixed") and optimizer (zeronb.precision holds the facts)."""
    return _precision(precision).bytes_per_parameter(optimizer)


def model_state_bytes(num_params: float, world_size: int, stage: int, param_bytes: float = 2,
                      grad_bytes: float = 2, optimizer_bytes: float = 12) -> float:
    """Bytes of model states per device for ZeRO stage 0..3 (0 = plain data parallelism)."""
    p, g, k = (b * num_params for b in (param_bytes, grad_bytes, optimizer_bytes))
    n = world_size
    if stage == 0:
        return p + g + k
    if stage == 1:
        return p + g + k / n
    if stage == 2:
        return p + (g + k) / n
    if stage == 3:
        return (p + g + k) / n
    raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, not {stage!r}")


def model_state_breakdown(num_params: float, world_size: int, stage: int, param_bytes: float = 2,
                          grad_bytes: float = 2, optimizer_bytes: float = 12) -> dict:
    """The same formula, split into {"params", "grads", "optimizer"} bytes per device."""
    n = world_size
    shard = {"params": stage >= 3, "grads": stage >= 2, "optimizer": stage >= 1}
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, not {stage!r}")
    per = {"params": param_bytes, "grads": grad_bytes, "optimizer": optimizer_bytes}
    return {k: per[k] * num_params / (n if shard[k] else 1) for k in per}


def reduction_factor(world_size: int, stage: int, optimizer_bytes: float = 12, param_bytes: float = 2,
                     grad_bytes: float = 2) -> float:
    """How many times less memory than stage 0 (DDP) a stage needs: e.g. 4x for stage 1 at large N."""
    kw = dict(param_bytes=param_bytes, grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes)
    return model_state_bytes(1, world_size, 0, **kw) / model_state_bytes(1, world_size, stage, **kw)


def paper_table(params=(7.5e9, 128e9, 1e12), dp_degrees=(1, 4, 16, 64, 256, 1024), k: float = 12) -> list[dict]:
    """The ZeRO paper's Table 1: GB per device of model states, for each model size, DP degree and
    stage (GB = 1e9 bytes, as the paper uses)."""
    rows = []
    for psi in params:
        for n in dp_degrees:
            rows.append({"params": psi, "dp": n,
                         **{f"stage{s}_GB": model_state_bytes(psi, n, s, optimizer_bytes=k) / 1e9 for s in range(4)}})
    return rows


# --- measuring -------------------------------------------------------------------------------------

def tensor_bytes(tensors) -> int:
    """Bytes of the storage behind `tensors`, each storage counted once (a view, or two parameters
    in one flat buffer, share storage). Storage, not numel: padding and freed buffers count as they
    really are (a storage resized to 0 holds nothing)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # a DTensor (PyTorch FSDP2): what this rank holds is its local shard
            t = t.to_local()
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def reachable_tensors(*roots, limit: int = 200_000) -> list:
    """Every tensor reachable from `roots` (an engine, a model, an optimizer, ...) by following
    object attributes, containers, closures and each tensor's `.grad`: what a rank really holds
    through them, found from outside, not from an inventory the code keeps of itself. A tensor that
    no list names (a second copy of the gradients, a buffer a hook closes over) is found all the
    same. It does not follow into modules, classes or a function's globals (the rest of the
    program), nor into tensors' autograd graphs. `tensor_bytes` of the result is what they hold."""
    import gc
    import types

    skip = (type, types.ModuleType, types.FrameType, types.CodeType, str, bytes, int, float, bool)
    seen, found, todo = set(), [], list(roots)
    while todo and len(seen) < limit:
        obj = todo.pop()
        if obj is None or id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            if obj.grad is not None:
                todo.append(obj.grad)
            continue
        if isinstance(obj, (types.FunctionType, types.MethodType)):  # a hook: what it closes over, its self
            todo += [c.cell_contents for c in (getattr(obj, "__closure__", None) or ()) if _filled(c)]
            todo += [getattr(obj, "__self__", None)] + list(getattr(obj, "__defaults__", None) or ())
            continue
        if isinstance(obj, torch.optim.Optimizer):
            todo += [obj.state, obj.param_groups]
        todo += gc.get_referents(obj)
    return found


def _filled(cell) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:  # an empty cell
        return False


def held_bytes(*roots) -> int:
    """Bytes of every storage reachable from `roots` (reachable_tensors), each counted once."""
    return tensor_bytes(reachable_tensors(*roots))


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list:
    """Every tensor an optimizer keeps in its state (Adam: exp_avg, exp_avg_sq; a step counter)."""
    out = []
    for state in optimizer.state.values():
        out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out


def measure(params=(), grads=(), optimizer=()) -> dict:
    """{"params", "grads", "optimizer"} bytes, from the tensors a rank holds in each role."""
    return {"params": tensor_bytes(params), "grads": tensor_bytes(grads), "optimizer": tensor_bytes(optimizer)}


def reset_cuda_peak(device) -> None:
    """Start a new peak for `cuda_memory` (the allocator's peak otherwise spans every earlier
    measurement in the process)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def cuda_memory(device) -> dict:
    """On a GPU: what the caching allocator says of `device` - allocated now, and the peak since
    `reset_cuda_peak`. Nothing on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    return {"cuda_allocated": torch.cuda.memory_allocated(device), "cuda_peak": torch.cuda.max_memory_allocated(device)}


def _storage_ptr(t):
    """Where a tensor's storage lives (a DTensor's: its local piece's), or None if it has none."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:  # a storage that was freed or swapped out (FSDP's sharded parameters)
        return None


_counting: list = []  # the saved_activations contexts open now, outermost first


def _pack(t):
    storage = t.untyped_storage()
    ptr = storage.data_ptr()
    for counter in _counting:  # nested contexts each count what was saved while they were open
        params = counter["exclude"]() if callable(counter["exclude"]) else counter["exclude"]
        if storage.nbytes() and ptr not in counter["seen"] and ptr not in {_storage_ptr(p) for p in params}:
            counter["seen"].add(ptr)
            counter["result"]["bytes"] += storage.nbytes()
            counter["result"]["tensors"] += 1
    return t


@contextmanager
def saved_activations(exclude=()):
    """Count the bytes autograd saves for backward while the context is open: the activations.

    Tensors whose storage belongs to `exclude` (the parameters: autograd saves weights too, but
    they are model states, not activations) are not counted. `exclude` may be a callable such as
    `model.parameters`, read again at each save: ZeRO-3 and FSDP2 swap the tensors behind the
    parameters as they gather them. Contexts nest (autograd keeps one pair of hooks; the outermost
    context installs it and every open context counts). Yields a dict whose "bytes" is filled in
    as the forward pass runs."""
    counter = {"exclude": exclude if callable(exclude) else list(exclude), "seen": set(),
               "result": {"bytes": 0, "tensors": 0}}
    outermost = not _counting
    _counting.append(counter)
    try:
        if outermost:
            with torch.autograd.graph.saved_tensors_hooks(_pack, lambda t: t):
                yield counter["result"]
        else:
            yield counter["result"]
    finally:
        # by identity: two counters can be equal as dicts (list.remove would take the wrong one)
        del _counting[next(i for i, c in enumerate(_counting) if c is counter)]


@contextmanager
def saved_activations_per_module(modules, exclude=()):
    """`saved_activations` for each of `modules` (a model's units, say): what autograd saves while
    that module's forward runs, its own submodules included. Yields {index: {"bytes", "tensors"}},
    filled in as the forward pass reaches each module."""
    counts, open_ = {}, {}

    def enter(i):
        def hook(module, args):
            open_[i] = contextlib.ExitStack()
            counts[i] = open_[i].enter_context(saved_activations(exclude))
        return hook

    def leave(i):
        def hook(module, args, output):
            open_.pop(i).close()
        return hook

    handles = [h for i, m in enumerate(modules)
               for h in (m.register_forward_pre_hook(enter(i)), m.register_forward_hook(leave(i)))]
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


def resident_bytes(*roots) -> int:
    """Bytes of every storage reachable from `roots` (reachable_tensors), each counted once, less
    tensors on the "meta" device, which have a size and no memory (DeepSpeed keeps one per
    parameter as a template of its layout): what a rank really holds through them."""
    return tensor_bytes([t for t in reachable_tensors(*roots) if t.device.type != "meta"])
