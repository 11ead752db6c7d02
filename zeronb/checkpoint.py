"""Sharded checkpoints with torch.distributed.checkpoint (DCP): every rank writes only what it
holds, and a run resumes on any number of ranks.

A stage presents its state (its `checkpoint_state`) as tensors and DTensors under the names this
module defines: a DTensor sharded over the ranks is written piece by piece with its offsets, and on
load each rank reads the pieces that overlap what it holds *now*, whatever the number of ranks that
wrote them; a plain tensor, the same on every rank, is written once. (How zeronb's flat stages and
PyTorch's counterparts present theirs: zeronb.zero.saving, zeronb.zero.torch_impls.)

Beside DCP's files, `zeronb.json` records what the caller says about the run (the trainer: its
settings and steps taken), the number of ranks, and a flat stage's layout - which parameter lies
where in each bucket - so that a resume can check that it continues the same run, and `export` can
turn the checkpoint into one file of full tensors in one process, no ranks.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


INFO = "zeronb.json"
# The names a checkpoint's tensors go by, which the stages write (zeronb.zero.saving, .torch_impls)
# and `export` reads back: a flat stage's bucket tensors (PARAMS: the parameters) and its optimizer's
# step count; PyTorch's state dicts under MODEL and OPTIM. A flat stage also records its layout,
# {bucket: [[parameter name, shape, offset in the bucket], ...]} (None: the tensors go by name).
MODEL, OPTIM, STEP, PARAMS = "model", "optim", "optimizer.step", "params"


def bucket_key(bucket: str, kind: str) -> str:
    """The name of a flat stage's tensor: `kind` (PARAMS, "exp_avg", "master", ...) of `bucket`."""
    return f"{bucket}.{kind}"


def layout_entry(parameter: str, shape, offset: int) -> list:
    """One parameter in a flat stage's layout: its name, shape and offset in its bucket's flat tensor."""
    return [parameter, list(shape), offset]


def optimizer_key(parameter: str, kind: str) -> str:
    """The name of one parameter's optimizer state `kind` ("exp_avg", ...), saved by the rank that owns it."""
    return f"{OPTIM}.{parameter}.{kind}"


# --- save, load, read, export ---------------------------------------------------------------------------

def save(stage, directory: str, info: dict) -> None:
    """Save a stage's parameters and optimizer state to `directory`, each rank its own part;
    rank 0 adds `info` (the run's settings, the steps taken) and the layout as zeronb.json."""
    dcp.save(stage.checkpoint_state(), checkpoint_id=directory)
    if dist.get_rank() == 0:
        layout = stage.checkpoint_layout()
        with open(os.path.join(directory, INFO), "w") as f:
            json.dump({**info, "world_size": dist.get_world_size(), "buckets": layout}, f, indent=1)
    dist.barrier()  # zeronb.json is there before any rank goes on (and reads it, say)


def read_info(directory: str) -> dict:
    """The saved run's settings (zeronb.json), with a clear error where there is no checkpoint."""
    path = os.path.join(directory, INFO)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{directory!r} holds no zeronb checkpoint (no {INFO}); give the directory "
                                "that a run with --checkpoint wrote")
    with open(path) as f:
        return json.load(f)


def load(stage, directory: str) -> dict:
    """Load a checkpoint written by `save` into a stage, on any number of ranks; returns its info."""
    info = read_info(directory)
    state = stage.checkpoint_state()
    dcp.load(state, checkpoint_id=directory)
    stage.load_checkpoint_state(state)
    return info


def export(directory: str, path: str | None = None) -> dict:
    """The whole model as {name: full tensor}, read from a sharded checkpoint in this one process
    (no ranks, no process group): what inference needs. With `path`, also torch.save it there."""
    info = read_info(directory)
    sizes = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    if info["buckets"] is None:  # the model's state dict, by name
        wanted = {k: torch.empty(sizes[k].size, dtype=sizes[k].properties.dtype)
                  for k in sizes if k.startswith(MODEL + ".")}
    else:  # each bucket's flat parameters, to be cut into the parameters it holds
        keys = [bucket_key(b, PARAMS) for b in info["buckets"]]
        wanted = {k: torch.empty(sizes[k].size, dtype=sizes[k].properties.dtype) for k in keys}
    with warnings.catch_warnings():  # ("no process group: loading in one process" - as meant)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(wanted, checkpoint_id=directory, no_dist=True)
    if info["buckets"] is None:
        full = {k.removeprefix(MODEL + "."): v for k, v in wanted.items()}
    else:
        full = {}
        for bucket, params in info["buckets"].items():
            flat = wanted[bucket_key(bucket, PARAMS)]
            for name, shape, offset in params:
                full[name] = flat[offset:offset + torch.Size(shape).numel()].view(shape).clone()
    if path is not None:
        torch.save(full, path)
    return full


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m zeronb.checkpoint",
                                description="Export a sharded checkpoint (python -m zeronb.train --checkpoint DIR) "
                                            "as one torch.save file of {name: full tensor}, in one process.")
    p.add_argument("directory")
    p.add_argument("output")
    args = p.parse_args(argv)
    try:
        full = export(args.directory, args.output)
    except FileNotFoundError as e:
        p.error(str(e))
    info = read_info(args.directory)
    size = sum(t.numel() * t.element_size() for t in full.values())
    recorded = ", ".join(f"{k} {v}" for k, v in info.items() if k not in ("world_size", "buckets"))
    print(f"{args.output}: {len(full)} tensors, {size / 1024:.1f} KiB, saved by {info['world_size']} rank(s) "
          f"({recorded})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
