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


def _configs(models, stages, rounds, steps, precision, variants) -> list:
    """Every (model, stage, variant), `rounds` times, interleaved: [(key, RunConfig)]."""
    return [((model, stage, name), RunConfig(model=model, stage=stage, steps=steps, precision=precision, **changes))
            for _ in range(rounds) for model in models for stage in stages for name, changes in variants.items()]


def zero(world_size=4, models=("mlp", "gpt"), stages=(0, 1, 2, 3), rounds=3, steps=6, precision="float32",
         accum=4) -> list:
    """Per model, stage and variant (practice_variants): median step time, bytes sent per step (by
    the ledger, and on the wire where the OS counts them), model-state bytes held on rank 0, the
    gradient bytes held between micro-batches, and each against the plain step of the same stage
    and against DDP's - all measured in one run on one pool, the variants interleaved."""
    keyed = _configs(models, stages, rounds, steps, precision, practice_variants(accum))
    with Cluster(world_size, verbose=False) as c:
        reports = run_many([config for _, config in keyed], c)
    runs = {}
    for (k, _), report in zip(keyed, reports):
        runs.setdefault(k, []).append(report)
    rows = []
    for (model, st, name), reps in runs.items():
        # a step takes as long as its slowest rank
        step_ms = statistics.median(max(r.step_ms for r in rep.ranks) for rep in reps)
        r0 = reps[-1].ranks[0]
        held_between = r0.grad_bytes_after_micro_batch
        rows.append({"model": model, "stage": st, "variant": name, "step_ms": step_ms,
                     "sent": sum(r0.sent_bytes_per_step.values()), "wire": r0.wire_bytes_per_step,
                     "held": sum(r0.bytes.values()), "expected_held": sum(r0.expected_bytes.values()),
                     "grads_between": held_between[0] if held_between and len(held_between) > 1 else None,
                     "num_params": r0.num_params})
    by = {(r["model"], r["stage"], r["variant"]): r for r in rows}
    for r in rows:
        plain = by[r["model"], r["stage"], "plain"]
        r["vs_ddp"] = r["step_ms"] / by[r["model"], stages[0], "plain"]["step_ms"]
        r["sent_vs_plain"] = r["sent"] / plain["sent"] if plain["sent"] else None
        r["wire_vs_plain"] = r["wire"] / plain["wire"] if r["wire"] and plain["wire"] else None
    return rows


def print_zero(rows, world_size, precision) -> None:
    print(f"ZeRO stages on {world_size} ranks, {precision}: rank 0's model states and traffic, median step time")
    print(f"{'model':>5} {'stage':>5} {'params':>8} {'held KiB':>9} {'formula KiB':>11} {'sent KiB/step':>14} "
          f"{'sent / psi*b':>12} {'step ms':>8} {'vs DDP':>7}")
    b = precision_spec(precision).param_bytes
    for r in rows:
        if r["variant"] == "plain":
            print(f"{r['model']:>5} {r['stage']:>5} {r['num_params']:>8} {r['held'] / 1024:>9.1f} "
                  f"{r['expected_held'] / 1024:>11.1f} {r['sent'] / 1024:>14.1f} {r['sent'] / (r['num_params'] * b):>12.3f} "
                  f"{r['step_ms']:>8.1f} {r['vs_ddp']:>6.2f}x")
    print("\nTraining in practice, the same run: each variant against the plain step of its stage "
          "(grads between = gradient bytes held after the first micro-batch)")
    print(f"{'model':>5} {'stage':>5} {'variant':>16} {'sent KiB':>9} {'x plain':>8} {'wire KiB':>9} {'x plain':>8} "
          f"{'grads between KiB':>18} {'/ psi*b':>8} {'step ms':>8}")
    def fmt(value, spec):  # "-" where a variant has no such number (no micro-batches; no wire count)
        return "-".rjust(int(spec.split(".")[0])) if value is None else format(value, spec)

    for r in rows:
        between = r["grads_between"]
        print(f"{r['model']:>5} {r['stage']:>5} {r['variant']:>16} {r['sent'] / 1024:>9.1f} {fmt(r['sent_vs_plain'], '8.2f')} "
              f"{fmt(r['wire'] and r['wire'] / 1024, '9.1f')} {fmt(r['wire_vs_plain'], '8.2f')} "
              f"{fmt(between and between / 1024, '18.1f')} {fmt(between and between / (r['num_params'] * b), '8.2f')} "
              f"{r['step_ms']:>8.1f}")
