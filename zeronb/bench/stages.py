"""`python -m zeronb.bench zero`: the ZeRO stages side by side on one pool - memory held, bytes
sent, step time against DDP's - and what accumulation and bf16 reduction change, per stage."""
import statistics

from ..pool.cluster import Cluster
from ..precision import precision as precision_spec
from ..train.runner import run_many
from ..train.runs import RunConfig


def practice_variants(k: int = 4) -> dict:
    """Training in practice, per stage: what each variant `bench zero` measures beside the plain
    step changes in the run (accumulation over k micro-batches, synced every micro-batch or after
    the last; gradients reduced in bf16)."""
    return {"plain": {}, f"accum {k}, every": dict(grad_accum=k, sync_each_micro_batch=True),
            f"accum {k}, last": dict(grad_accum=k, sync_each_micro_batch=False), "bf16 reduce": dict(reduce_dtype="bf16")}


IMPLS = ("zeronb", "torch", "deepspeed")


def _configs(models, stages, rounds, steps, precision, variants, impls) -> list:
    """Every (model, stage, variant, impl), `rounds` times, interleaved: [(key, RunConfig)]. The
    variants are zeronb's; PyTorch's and DeepSpeed's engines run the plain step, at the stages and
    precisions they have (RunConfig refuses the rest)."""
    keyed = []
    for _ in range(rounds):
        for model in models:
            for stage in stages:
                for impl in impls:
                    for name, changes in (variants.items() if impl == "zeronb" else [("plain", {})]):
                        try:
                            config = RunConfig(model=model, stage=stage, steps=steps, precision=precision, impl=impl,
                                               **changes)
                        except ValueError:
                            continue  # (DeepSpeed has no stage 0 here, PyTorch's engines no bf16-mixed)
                        keyed.append(((model, stage, name, impl), config))
    return keyed


def zero(world_size=4, models=("mlp", "gpt"), stages=(0, 1, 2, 3), rounds=3, steps=6, precision="float32",
         accum=4, impls=IMPLS) -> list:
    """Per model, stage, variant (practice_variants) and implementation: median step time, bytes
    sent per step (by the ledger, and on the wire where the OS counts them), model-state bytes held
    on rank 0, the gradient bytes held between micro-batches, and each against the plain step of the
    same stage, against DDP's and against the faster of PyTorch's and DeepSpeed's engines - all
    measured in one run on one pool, interleaved."""
    keyed = _configs(models, stages, rounds, steps, precision, practice_variants(accum), impls)
    with Cluster(world_size, verbose=False) as c:
        reports = run_many([config for _, config in keyed], c)
    runs = {}
    for (k, _), report in zip(keyed, reports):
        runs.setdefault(k, []).append(report)
    rows = []
    for (model, st, name, impl), reps in runs.items():
        # a step takes as long as its slowest rank
        times = [max(r.step_ms for r in rep.ranks) for rep in reps]
        r0 = reps[-1].ranks[0]
        held_between = r0.grad_bytes_after_micro_batch
        rows.append({"model": model, "stage": st, "variant": name, "impl": impl, "step_ms": statistics.median(times),
                     "step_ms_range": (min(times), max(times)),
                     "sent": sum(r0.sent_bytes_per_step.values()), "wire": r0.wire_bytes_per_step,
                     "held": sum(r0.bytes.values()), "expected_held": sum(r0.expected_bytes.values()),
                     "grads_between": held_between[0] if held_between and len(held_between) > 1 else None,
                     "num_params": r0.num_params})
    by = {(r["model"], r["stage"], r["variant"], r["impl"]): r for r in rows}
    for r in rows:
        plain, ddp = by.get((r["model"], r["stage"], "plain", r["impl"])), by.get((r["model"], stages[0], "plain", "zeronb"))
        r["vs_ddp"] = r["step_ms"] / ddp["step_ms"] if ddp else None
        r["sent_vs_plain"] = r["sent"] / plain["sent"] if plain["sent"] else None
        r["wire_vs_plain"] = r["wire"] / plain["wire"] if r["wire"] and plain["wire"] else None
        production = [by[k]["step_ms"] for k in ((r["model"], r["stage"], "plain", i) for i in ("torch", "deepspeed"))
                      if k in by]
        r["vs_fastest_production"] = r["step_ms"] / min(production) if production else None
    return rows


def print_zero(rows, world_size, precision) -> None:
    print(f"ZeRO stages on {world_size} ranks, {precision}: rank 0's model states and traffic, median step time")
    print(f"{'model':>5} {'stage':>5} {'params':>8} {'held KiB':>9} {'formula KiB':>11} {'sent KiB/step':>14} "
          f"{'sent / psi*b':>12} {'step ms':>8} {'vs DDP':>7}")
    b = precision_spec(precision).param_bytes
    for r in rows:
        if r["variant"] == "plain" and r["impl"] == "zeronb":
            print(f"{r['model']:>5} {r['stage']:>5} {r['num_params']:>8} {r['held'] / 1024:>9.1f} "
                  f"{r['expected_held'] / 1024:>11.1f} {r['sent'] / 1024:>14.1f} {r['sent'] / (r['num_params'] * b):>12.3f} "
                  f"{r['step_ms']:>8.1f} {r['vs_ddp']:>6.2f}x")
    print("\nTraining in practice, the same run: each variant against the plain step of its stage "
          "(grads between = gradient bytes held after the first micro-batch)")
    print(f"{'model':>5} {'stage':>5} {'variant':>16} {'sent KiB':>9} {'x plain':>8} {'wire KiB':>9} {'x plain':>8} "
          f"{'grads between KiB':>18} {'/ psi*b':>8} {'step ms':>8}")
    def fmt(value, spec):  # "-" where a variant has no such number (no micro-batches; no wire count)
        return "-".rjust(int(spec.split(".")[0])) if value is None else format(value, spec)

    for r in (r for r in rows if r["impl"] == "zeronb"):
        between = r["grads_between"]
        print(f"{r['model']:>5} {r['stage']:>5} {r['variant']:>16} {r['sent'] / 1024:>9.1f} {fmt(r['sent_vs_plain'], '8.2f')} "
              f"{fmt(r['wire'] and r['wire'] / 1024, '9.1f')} {fmt(r['wire_vs_plain'], '8.2f')} "
              f"{fmt(between and between / 1024, '18.1f')} {fmt(between and between / (r['num_params'] * b), '8.2f')} "
              f"{r['step_ms']:>8.1f}")
    print_implementations(rows)


def print_implementations(rows) -> None:
    """The plain step of each stage by zeronb, PyTorch and DeepSpeed: step time (median and range of
    the interleaved rounds) as a ratio to the faster production engine, bytes on the wire as a
    ratio to zeronb's."""
    plain = [r for r in rows if r["variant"] == "plain"]
    if len({r["impl"] for r in plain}) < 2:
        return
    print("\nImplementations, the same run: the plain step (x fastest = step time / the faster of PyTorch's "
          "and DeepSpeed's; wire x zeronb = wire bytes / zeronb's)")
    print(f"{'model':>5} {'stage':>5} {'impl':>9} {'step ms':>8} {'range':>13} {'x fastest':>9} {'wire KiB':>9} "
          f"{'wire x zeronb':>13} {'held KiB':>9}")
    by = {(r["model"], r["stage"], r["impl"]): r for r in plain}
    for r in plain:
        ours = by.get((r["model"], r["stage"], "zeronb"))
        wire_ratio = r["wire"] / ours["wire"] if ours and r["wire"] and ours["wire"] else None
        lo, hi = r["step_ms_range"]
        print(f"{r['model']:>5} {r['stage']:>5} {r['impl']:>9} {r['step_ms']:>8.1f} {f'{lo:.1f}-{hi:.1f}':>13} "
              f"{'-' if r['vs_fastest_production'] is None else format(r['vs_fastest_production'], '.2f'):>9} "
              f"{'-' if r['wire'] is None else format(r['wire'] / 1024, '.1f'):>9} "
              f"{'-' if wire_ratio is None else format(wire_ratio, '.2f'):>13} {r['held'] / 1024:>9.1f}")
