"""zeronb's stages beside PyTorch's and DeepSpeed's, on one pool and one model (chapters 8-11, 14).

    rows = side_by_side(pool, RunConfig(stage=2, model="gpt", optimizer="sgd"))
    implementations_table(rows)      # parity, bytes held against the formula, bytes on the wire, step time

Every number is the run's own: parity against one process on the whole batch (parameters, and the
averaged gradients each rank's optimizer stepped with), the bytes rank 0's tensors hold (zeronb's
memory.measure over the tensors each implementation lists, `held`; every storage reachable from it,
swept from outside, `swept`) against the ZeRO formula, the bytes the OS
counted on rank 0's connections in the watched step, and the median step time over interleaved
rounds, with its range.

`knob_map()`: which DeepSpeed keys each of the chapters' settings sets, read off
zeronb.zero.deepspeed_engine.deepspeed_config by changing one setting at a time.
"""
from __future__ import annotations

import statistics

from ..runtime.backend import device
from ..train import RunConfig, grad_diff, max_diff, run_many, train_single
from ..zero.deepspeed_engine import import_deepspeed

IMPLEMENTATIONS = ("zeronb", "torch", "deepspeed")
NAMES = {"zeronb": "zeronb", "torch": "PyTorch", "deepspeed": "DeepSpeed"}
TORCH_NAMES = {0: "DDP", 1: "DDP + ZeroRedundancyOptimizer", 2: "FSDP2 (reshard_after_forward=False)",
               3: "FSDP2 (reshard_after_forward=True)"}


def side_by_side(pool, config: RunConfig, impls=IMPLEMENTATIONS, rounds: int = 3) -> list[dict]:
    """Run `config` with each implementation on `pool`, `rounds` times interleaved; one row each."""
    config = config.replace(nproc=pool.world_size)
    configs = [config.replace(impl=impl) for _ in range(rounds) for impl in impls]
    reports = run_many(configs, pool)
    ref = train_single(config)
    rows = []
    for impl in impls:
        reps = [rep for c, rep in zip(configs, reports) if c.impl == impl]
        last, times = reps[-1], [max(r.step_ms for r in rep.ranks) for rep in reps]  # a step lasts its slowest rank
        r0 = last.ranks[0]
        rows.append({
            "impl": impl, "stage": config.stage,
            "param_diff": max_diff(last.params, ref.params),
            "grad_diff": grad_diff(last.ranks, ref.ranks[0]) if config.clip_norm is None else None,
            "held": sum(r0.bytes.values()), "held_by_role": dict(r0.bytes), "swept": r0.swept_bytes,
            "formula": sum(r0.expected_bytes.values()), "formula_by_role": dict(r0.expected_bytes),
            "wire": r0.wire_bytes_per_step, "credited": dict(r0.sent_bytes_per_step),
            "calls": dict(r0.calls_per_step), "elements": dict(r0.elements_per_step or {}),
            "step_ms": statistics.median(times),
            "step_ms_range": (min(times), max(times)), "num_params": r0.num_params,
        })
    return rows


def implementations_table(rows, swept: bool = False):
    """The rows of `side_by_side` as an HTML table. What rank 0 holds is what each implementation's
    tensors list (`held`), or with `swept` every storage reachable from it, found from outside."""
    from .display import kib, table  # (inside: display imports IPython)

    def name(r):
        return NAMES[r["impl"]] + (f" ({TORCH_NAMES[r['stage']]})" if r["impl"] == "torch" else "")

    held = "swept" if swept else "held"
    return table(
        ["implementation", "max |param diff| vs 1 process", "max |grad diff|",
         "rank 0 holds, swept (KiB)" if swept else "rank 0 holds (KiB)",
         "ZeRO formula (KiB)", "held / formula", "wire KiB / step (OS count)", "collectives credited",
         "step ms (median, range)"],
        [[name(r), f"{r['param_diff']:.1e}", "-" if r["grad_diff"] is None else f"{r['grad_diff']:.1e}",
          kib(r[held]), kib(r["formula"]), f"{r[held] / r['formula']:.2f}",
          "-" if r["wire"] is None else kib(r["wire"]),
          ", ".join(f"{op} {kib(b) + ' KiB' if b >= 1024 else f'{b} B'}" for op, b in sorted(r["credited"].items())),
          f"{r['step_ms']:.1f} ({r['step_ms_range'][0]:.1f}-{r['step_ms_range'][1]:.1f})"] for r in rows])


KNOBS = {  # the chapters' setting: (RunConfig changes, FSDP2's counterpart)
    "precision bf16, fp32 master (ch. 6)": (dict(precision="bf16-mixed"), "MixedPrecisionPolicy(param_dtype=bf16)"),
    "gradient accumulation (ch. 12)": (dict(grad_accum=2), "set_requires_gradient_sync(False) between"),
    "gradient clipping (ch. 12)": (dict(clip_norm=1.0), "torch.nn.utils.clip_grad_norm_ (on DTensors)"),
    "reduce in bf16 (ch. 12)": (dict(reduce_dtype="bf16"), "MixedPrecisionPolicy(reduce_dtype=bf16)"),
    "prefetch the next unit (ch. 11)": (dict(stage=3, prefetch=True), "implicit forward prefetch, backward "
                                        "prefetch on by default; set_modules_to_forward_prefetch"),
    "keep parameters from forward to backward (ch. 10)": (dict(stage=3, reshard_after_forward=False),
                                                          "fully_shard(reshard_after_forward=False)"),
    "hpZ: a second copy within the node (ch. 13)": (dict(stage=3, hpz=True, nodes=2),
                                                     "fully_shard(reshard_after_forward=<ranks per node>)"),
}


def _flat(d: dict, prefix="") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def knob_map(world_size: int = 4) -> list[tuple]:
    """[(setting, DeepSpeed keys it sets, FSDP2's counterpart)]: the DeepSpeed side read off
    deepspeed_config, each setting against the same run without it."""
    rows = []
    for knob, (changes, fsdp2) in KNOBS.items():
        base = RunConfig(impl="deepspeed", stage=changes.get("stage", 2), nproc=world_size, nodes=changes.get("nodes"))
        before = _flat(base.deepspeed_config(world_size))
        after = _flat(base.replace(**changes).deepspeed_config(world_size))
        diff = {k: v for k, v in after.items() if before.get(k) != v}
        rows.append((knob, diff, fsdp2))
    return rows


def deepspeed_defaults(*keys) -> dict:
    """DeepSpeed's own defaults for these keys of its ZeRO config (DeepSpeedZeroConfig), read where
    DeepSpeed runs: on a rank (`pool.run(deepspeed_defaults, "reduce_bucket_size")`)."""
    import_deepspeed(device())  # as the runs import it on this rank
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # (deferred: after the accelerator is chosen)

    defaults = DeepSpeedZeroConfig()
    return {key: getattr(defaults, key) for key in keys}


def tensors_reaching_into(sizes: list, partition: int, rank: int) -> list:
    """The sizes of the tensors (laid end to end, in this order) that reach into elements
    [rank * partition, (rank + 1) * partition): what DeepSpeed's ZeRO-1/2 copies whole after backward."""
    lo, hi, out, offset = rank * partition, (rank + 1) * partition, [], 0
    for k in sizes:
        if offset < hi and offset + k > lo:
            out.append(k)
        offset += k
    return out
