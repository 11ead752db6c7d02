"""The claims of the course's source notes, as data: one record per claim - what a note says (in
the book's words), which measurement settles it, and the rule that computes the verdict from that
measurement. Chapter 14 measures (the `Evidence`), `judge` computes every verdict from it, and
`table` shows them: the page changes when the measurements do. The sentences that explain a verdict
are the book's, in zeronb.book.claims_text; the bytes per parameter are zeronb.precision's.

Verdicts: "true", "false", "only when" (true in a setting the claim does not name, which the
explanation names), "not measured" (a measurement this backend cannot make: the OS counts no NCCL
traffic). No verdict rests on a byte count the ledger credits to a built-in collective, which is a
formula: traffic verdicts use the wire, where the operating system counted. One rule reaches past
the page's N: "percentages" carries the measured fractions to other N by the memory formula, and
only where that formula matches the storage measured here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from ..memory import bytes_per_parameter, model_state_bytes
from .claims_text import WHY
from .display import table as html_table

WIRE = "bytes on the wire (the OS's TCP counters)"
VALUES = "values on the ranks"
MEMORY = "tensor storage on rank 0"
CALLS = "collectives called (the ledger's record)"
RUN = "the note's code, run on the ranks"
PARTS = ("params", "grads", "optimizer")
ADAM = {"fp32 Adam": bytes_per_parameter("float32"),  # bytes per parameter: (p, g, K)
        "mixed-precision Adam": bytes_per_parameter("bf16-mixed")}
CLAIMED_SHARE = {1: 0.75, 2: 0.50, 3: 1 / 3}  # "DDP 100%, ZeRO-1 ~75%, ZeRO-2 ~50%, ZeRO-3 ~33%"
CLAIMED_Z2 = (2, 16)  # "2Ψ + 16Ψ/N"


@dataclass
class Evidence:
    """What chapter 14 measured, as the rules read it. Reports are RankReports of rank 0 (float64
    unless named otherwise); the GPT is the model throughout."""
    world_size: int
    tensor_bytes: int        # S: the float64 tensor all-reduced two ways
    two_ways: list           # per rank: {"diff", "ring_diff", "wire": {collective: bytes} or None}, the
                             # collectives gloo's, zeronb's ring ("ring_..."), the naive one through rank 0
                             # ("naive_all_reduce") and the direct one, every rank to every other ("direct_...")
    runs: dict               # stage name -> report of a traced step (phases, memory trace, activations);
                             # "ZeRO-3, per layer": ZeRO-3 with one unit per module that owns parameters
    ring_runs: dict          # stage name -> report, the stages' reduce-scatters run as zeronb's ring
    bf16: dict               # stage name -> report in bf16-mixed (2 + 2 + 12 bytes, the ZeRO paper's fp16 count)
    z2_fp32_shard: object    # ZeRO-2 in bf16-mixed with its reduced gradient shard kept in fp32
    units: int               # the GPT's units
    seed_ring: dict          # steps -> per rank: the shards complete after each step of note 000's ring
    seed_code: dict          # note 001's pseudo-code, run on rank 0 ("uneven": a list reduce-scatter of unequal inputs)
    no_master: dict          # note 004: one Adam step added in bf16 against an fp32 master copy
    step_ms: dict = field(default_factory=dict)  # stage name -> median step time of the slowest rank

    @property
    def on_wire(self) -> bool:
        return self.runs["DDP"].wire_bytes_per_step is not None

    @property
    def psi(self) -> int:
        return self.runs["DDP"].num_params


@dataclass
class Finding:
    measured: str            # what this page measured for the claim
    verdict: str             # "true", "false", "only when", "not measured"
    values: dict = field(default_factory=dict)  # the numbers behind the verdict, for the explanation and the checks
    because: Optional[str] = ""  # the explanation in claims_text.WHY: "" the claim's own, None none


@dataclass(frozen=True)
class Claim:
    key: str
    words: str               # the claim, in the book's words (a note's number where it is one note's)
    measured_with: str
    judge: Callable          # Evidence -> Finding


def not_on_wire() -> Finding:
    return Finding("–", "not measured", because="not on the wire")


def close(a, b) -> bool:
    return abs(a - b) <= 0.03  # "~": within 3 percentage points (or 3%)


def wire(report) -> int:
    return report.wire_bytes_per_step


def fraction(n, stage, per) -> float:
    return model_state_bytes(1, n, stage, *per) / model_state_bytes(1, n, 0, *per)


def phase(report, name, what="calls"):
    return report.phases[name][what]


def _ops_text(ops) -> str:
    return " + ".join(f"{op.replace('_', '-')} ×{n}" for op, n in ops.items()) or "nothing"


# --- the rules, one per claim ----------------------------------------------------------------------

def _all_reduce_is_two_halves(e: Evidence) -> Finding:
    worst = max(t["diff"] for t in e.two_ways)
    n = e.world_size
    if not e.on_wire:
        return Finding(f"largest difference between the two results on {n} ranks: {worst:.1e}",
                       "true" if worst <= 1e-12 else "false", {"worst": worst}, "all-reduce, not on the wire")
    w = e.two_ways[0]["wire"]
    ring_two, gloo_two = w["ring_reduce_scatter"] + w["ring_all_gather"], w["reduce_scatter"] + w["all_gather"]
    same_bytes = abs(ring_two / w["ring_all_reduce"] - 1) < 0.01
    return Finding(f"largest difference between the two results on {n} ranks: {worst:.1e}; on the wire, rank 0: "
                   f"ring all-reduce {w['ring_all_reduce']:,} bytes, ring reduce-scatter + all-gather {ring_two:,}; "
                   f"gloo's reduce-scatter + all-gather {gloo_two:,} against its all-reduce {w['all_reduce']:,}",
                   "true" if worst <= 1e-12 and same_bytes else "false",
                   {"worst": worst, "ring_two": ring_two, "same_bytes": same_bytes,
                    "gloo_over_all_reduce": gloo_two / w["all_reduce"]})


def _ring_sends_twice(e: Evidence) -> Finding:
    if not e.on_wire:
        return not_on_wire()
    n, ring = e.world_size, e.two_ways[0]["wire"]["ring_all_reduce"] / e.tensor_bytes
    formula_holds = abs(ring / (2 * (n - 1) / n) - 1) < 0.01
    return Finding(f"ring all-reduce of S = {e.tensor_bytes:,} bytes: {e.two_ways[0]['wire']['ring_all_reduce']:,} "
                   f"bytes left rank 0 = {ring:.3f} S; 2(N−1)/N = {2 * (n - 1) / n:.3f}",
                   "false" if not formula_holds else ("true" if ring > 1.9 else "only when"), {"ring": ring, "n": n})


def _what_is_sharded(e: Evidence) -> Finding:
    full = {p: b * e.psi for p, b in zip(PARTS, bytes_per_parameter("float64"))}  # what DDP holds
    after = {s: next(h for ev, _, h in e.runs[s].memory_trace if ev == "backward pass done")
             for s in ("ZeRO-1", "ZeRO-2", "ZeRO-3")}
    share = {s: {p: after[s][p] / full[p] for p in PARTS} for s in after}
    sharded = {s: {p for p in PARTS if share[s][p] < 0.5} for s in share}
    note_table = {"ZeRO-1": {"grads", "optimizer"}, "ZeRO-2": {"grads", "optimizer", "params"}, "ZeRO-3": set(PARTS)}
    other_notes = {"ZeRO-1": {"optimizer"}, "ZeRO-2": {"grads", "optimizer"}, "ZeRO-3": set(PARTS)}
    return Finding("held ÷ full model on rank 0 when backward ends: " + "; ".join(
                       f"{s} " + ", ".join(f"{p} {share[s][p]:.2f}" for p in PARTS) for s in share),
                   "false" if sharded != note_table else "true",
                   {"share": share, "sharded": sharded, "note_table": note_table, "other_notes": other_notes},
                   "" if sharded == other_notes else "sharded, neither")


def _percentages(e: Evidence) -> Finding:
    n = e.world_size
    names = {1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
    measured = {s: e.bf16[names[s]].held_bytes / e.bf16["DDP"].held_bytes for s in names}
    formula = {s: fraction(n, s, ADAM["mixed-precision Adam"]) for s in names}
    matches = all(close(measured[s], formula[s]) for s in names)  # else the formula may not speak for other N
    where = {s: [(k, a) for a, per in ADAM.items() for k in range(2, 1025) if close(fraction(k, s, per), CLAIMED_SHARE[s])]
             for s in CLAIMED_SHARE}
    together = [(k, a) for a, per in ADAM.items() for k in range(2, 1025)
                if all(close(fraction(k, s, per), CLAIMED_SHARE[s]) for s in CLAIMED_SHARE)]

    def settings(pairs):
        by_n = {}
        for k, a in pairs:
            by_n.setdefault(k, []).append(a)
        return ", ".join(f"N = {k} " + ("with either Adam" if len(a) == len(ADAM) else f"with {a[0]}")
                         for k, a in by_n.items())

    holds_now = all(close(measured[s], CLAIMED_SHARE[s]) for s in CLAIMED_SHARE)
    return Finding(f"mixed precision, N = {n}: " + ", ".join(f"{names[s]} {measured[s]:.1%}" for s in names)
                   + " of DDP; the formula (2 + 2 + 12 bytes per parameter): "
                   + ", ".join(f"{formula[s]:.1%}" for s in names),
                   "true" if holds_now else ("only when" if together and matches else "false"),
                   {"measured": measured, "formula_matches": matches, "together": together,
                    "settings": "; ".join(f"{CLAIMED_SHARE[s]:.0%} for ZeRO-{s}: {settings(where[s])}"
                                          for s in CLAIMED_SHARE)},
                   None if not matches else "" if together else "percentages, never")


def _zero2_2_plus_16(e: Evidence) -> Finding:
    n = e.world_size
    z2, z2_fp32 = e.bf16["ZeRO-2"].held_bytes / e.psi, e.z2_fp32_shard.held_bytes / e.psi
    note, paper = CLAIMED_Z2[0] + CLAIMED_Z2[1] / n, model_state_bytes(1, n, 2, *ADAM["mixed-precision Adam"])
    return Finding(f"ZeRO-2, mixed precision, N = {n}: {z2:.2f} Ψ bytes with a bf16 gradient shard (the paper's), "
                   f"{z2_fp32:.2f} Ψ with the shard kept in fp32; 2 + 16/N = {note:.2f}; 2 + 14/N = {paper:.2f}",
                   "only when" if close(z2_fp32 / note, 1) and close(z2 / paper, 1) else "false",
                   {"z2": z2, "z2_fp32": z2_fp32, "note": note, "paper": paper})


def _zero2_six_to_eight(e: Evidence) -> Finding:
    n = e.world_size
    z1_over_z2 = e.bf16["ZeRO-1"].held_bytes / e.bf16["ZeRO-2"].held_bytes
    ddp_over_z2 = e.bf16["DDP"].held_bytes / e.bf16["ZeRO-2"].held_bytes
    six_from = next(k for k in range(2, 10**6) if 1 / fraction(k, 2, ADAM["mixed-precision Adam"]) >= 6)
    return Finding(f"mixed precision, N = {n}: ZeRO-1 ÷ ZeRO-2 = {z1_over_z2:.2f}×; DDP ÷ ZeRO-2 = {ddp_over_z2:.2f}×",
                   "true" if z1_over_z2 >= 6 else "false",
                   {"z1_over_z2": z1_over_z2, "ddp_over_z2": ddp_over_z2, "six_from": six_from})


def _zero3_fifty(e: Evidence) -> Finding:
    n = e.world_size
    reduction = {"float64": e.runs["DDP"].held_bytes / e.runs["ZeRO-3"].held_bytes,
                 "bf16-mixed": e.bf16["DDP"].held_bytes / e.bf16["ZeRO-3"].held_bytes}
    return Finding(f"DDP ÷ ZeRO-3 at N = {n}: " + ", ".join(f"{v:.2f}× ({d})" for d, v in reduction.items()),
                   "only when" if all(close(v / n, 1) for v in reduction.values()) else "false",
                   {"reduction": reduction})


def _activations(e: Evidence) -> Finding:
    acts = {s: e.runs[s].activation_bytes for s in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")}
    return Finding("activations saved for backward on rank 0: " + ", ".join(f"{s} {a / 1024:.1f} KiB" for s, a in acts.items()),
                   "only when" if len(set(acts.values())) == 1 else "false", {"acts": acts})


def _zero2_all_reduce(e: Evidence) -> Finding:
    calls = phase(e.runs["ZeRO-2"], "backward")
    z2 = {op: calls.get(op, 0) for op in ("all_reduce", "reduce_scatter")}
    text = f"ZeRO-2's backward calls: {z2['all_reduce']} all-reduces, {z2['reduce_scatter']} reduce-scatters"
    values = {"calls": z2}
    if e.on_wire:
        values["backward_vs_ddp"] = phase(e.runs["ZeRO-2, ring reduce-scatter"], "backward", "wire") / wire(e.ring_runs["DDP"])
        text += (f"; with a real (ring) reduce-scatter its backward put {values['backward_vs_ddp']:.2f}× DDP's "
                 "all-reduce bytes on the wire")
    return Finding(text, "true" if z2["all_reduce"] > 0 else "false", values)


def _broadcast_after_step(e: Evidence) -> Finding:
    step_ops = {s: phase(e.runs[s], "step") for s in ("ZeRO-1", "ZeRO-2", "ZeRO-3", "PyTorch ZeRO-1")}
    ours = [s for s in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
            if any(phase(e.runs[s], p).get("broadcast") for p in ("forward", "backward", "step"))]
    text = "collectives called during the optimizer step: " + "; ".join(f"{s}: {_ops_text(o)}" for s, o in step_ops.items())
    if e.on_wire:
        text += f"; ZeRO-3's step put {phase(e.runs['ZeRO-3'], 'step', 'wire'):,} bytes on the wire"
    return Finding(text, "true" if all(o.get("broadcast") for o in step_ops.values()) else "false",
                   {"step_ops": step_ops, "zeronb_broadcasts": ours})


def _zero3_two_gathers(e: Evidence) -> Finding:
    gathers = {s: (phase(e.runs[s], "forward").get("all_gather", 0), phase(e.runs[s], "backward").get("all_gather", 0))
               for s in ("ZeRO-3", "FSDP2")}
    u, counts = e.units, set(gathers.values())
    text = {s: f"{f} / {b}" for s, (f, b) in gathers.items()}
    return Finding(f"all-gather calls for the GPT's {u} units, forward / backward: "
                   + "; ".join(f"{s} {t}" for s, t in text.items()),
                   "true" if counts == {(u, u)} else "only when" if counts <= {(u, u), (u, u - 1)} else "false",
                   {"gathers": gathers, "z3": text["ZeRO-3"], "fsdp2": text["FSDP2"]})


def _zero3_one_and_a_half(e: Evidence) -> Finding:
    if not e.on_wire:
        return not_on_wire()
    z3_ring = wire(e.ring_runs["ZeRO-3"]) / wire(e.ring_runs["DDP"])
    fsdp2_gloo = wire(e.runs["FSDP2"]) / wire(e.runs["DDP"])
    return Finding(f"on the wire per step ÷ DDP's: zeronb's ZeRO-3 with a ring reduce-scatter {z3_ring:.3f}; "
                   f"FSDP2 with gloo's collectives {fsdp2_gloo:.3f}",
                   "only when" if 1.35 < z3_ring < 1.55 else "false", {"z3_ring": z3_ring, "fsdp2_gloo": fsdp2_gloo})


def _zero1_free(e: Evidence) -> Finding:
    if not e.on_wire:
        return not_on_wire()
    z1_ring = wire(e.ring_runs["ZeRO-1"]) / wire(e.ring_runs["DDP"])
    z1_gloo = wire(e.runs["ZeRO-1"]) / wire(e.runs["DDP"])
    torch_z1 = wire(e.runs["PyTorch ZeRO-1"]) / wire(e.runs["DDP"])
    return Finding(f"on the wire per step ÷ DDP's: ZeRO-1 with a ring reduce-scatter {z1_ring:.3f}, with gloo's "
                   f"{z1_gloo:.3f}; PyTorch's ZeroRedundancyOptimizer {torch_z1:.3f}",
                   "only when" if abs(z1_ring - 1) < 0.03 else "false",
                   {"z1_ring": z1_ring, "z1_gloo": z1_gloo, "torch_z1": torch_z1})


def _seed_ring(e: Evidence) -> Finding:
    n = e.world_size
    drawn, full = e.seed_ring[2], e.seed_ring[n - 1]
    return Finding(f"that schedule, run: complete shards per rank after 2 steps {[c[-1] for c in drawn]}, after "
                   f"{n - 1} steps {[c[-1] for c in full]}",
                   "false" if any(c[-1] != [r] for r, c in enumerate(full)) or any(c[-1] for c in drawn) else "true",
                   {"steps": n - 1, "drawn": [c[-1] for c in drawn], "full": [c[-1] for c in full]})


def _seed_pseudocode(e: Evidence) -> Finding:
    c = e.seed_code
    return Finding(f"the GPT has {c['parameters']} parameter tensors of {c['distinct_shapes']} shapes for "
                   f"{c['ranks']} ranks; the call, as written: " + (c["error"] or "no error"),
                   "false" if c["error"] or c["parameters"] != c["ranks"] else "true", {"uneven": "not tried", **c})


def _fsdp_groups(e: Evidence) -> Finding:
    layer, block, fsdp2 = e.runs["ZeRO-3, per layer"], e.runs["ZeRO-3"], e.runs["FSDP2"]
    calls = {name: sum(r.calls_per_step.values()) for name, r in (("layer", layer), ("block", block), ("FSDP2", fsdp2))}
    ms = {name: e.step_ms.get(name, r.step_ms) for name, r in
          (("ZeRO-3, per layer", layer), ("ZeRO-3", block), ("FSDP2", fsdp2))}  # the slowest rank's
    text = (f"ZeRO-3 gathering layer by layer: {calls['layer']} collectives a step, {ms['ZeRO-3, per layer']:.0f} ms; "
            f"by block (the model's units): {calls['block']}, {ms['ZeRO-3']:.0f} ms; FSDP2 by block: "
            f"{calls['FSDP2']}, {ms['FSDP2']:.0f} ms (one median each)")
    values, because = {"calls": calls}, "fsdp groups, not on the wire"
    if e.on_wire:
        values.update(same_bytes=wire(layer) / wire(block), wire_ratio=wire(fsdp2) / wire(block))
        text += (f"; on the wire, per layer ÷ per block {values['same_bytes']:.3f}, FSDP2 ÷ zeronb's ZeRO-3 by block "
                 f"{values['wire_ratio']:.3f}")
        because = "" if abs(values["same_bytes"] - 1) < 0.1 else None  # "for the same bytes", or no explanation
    return Finding(text, "only when" if calls["layer"] > calls["block"] else "false", values, because)


def _memory_for_bytes(e: Evidence) -> Finding:
    if not e.on_wire:
        return not_on_wire()
    trade = {s: wire(e.ring_runs[s]) / wire(e.ring_runs["DDP"]) for s in ("ZeRO-1", "ZeRO-2", "ZeRO-3")}
    return Finding("on the wire per step ÷ DDP's, with a real reduce-scatter: "
                   + ", ".join(f"{s} {v:.3f}" for s, v in trade.items()),
                   "only when" if abs(trade["ZeRO-1"] - 1) < 0.03 and abs(trade["ZeRO-2"] - 1) < 0.03
                   and trade["ZeRO-3"] > 1.3 else "false", {"trade": trade})


def _two_halves_cut_traffic(e: Evidence) -> Finding:
    if not e.on_wire:
        return not_on_wire()
    halves = [t["wire"]["ring_reduce_scatter"] + t["wire"]["ring_all_gather"] for t in e.two_ways]
    naive, direct = ([t["wire"][k] for t in e.two_ways] for k in ("naive_all_reduce", "direct_all_reduce"))
    busiest, total = max(naive) / max(halves), sum(naive) / sum(halves)
    every = min(d / h for d, h in zip(direct, halves))  # the direct one against the ring, on the rank it sends least

    def per_rank(sent):
        return " / ".join(f"{v / e.tensor_bytes:.2f}" for v in sent)
    return Finding(f"on the wire, S = {e.tensor_bytes:,} bytes, ranks 0, 1, …: ring reduce-scatter + all-gather "
                   f"{per_rank(halves)} S; the naive all-reduce through rank 0 {per_rank(naive)} S: its busiest rank "
                   f"{busiest:.2f}× the ring's, all ranks together {total:.2f}×; the direct one, every rank to every "
                   f"other, {per_rank(direct)} S: at least {every:.2f}× the ring's on every rank",
                   "only when" if busiest > 1.2 and abs(total - 1) < 0.03 and every > 1.2 else "false",
                   {"busiest": busiest, "total": total, "direct": every})


def _zero1_order(e: Evidence) -> Finding:
    z1 = e.runs["ZeRO-1"]
    order = [op for p in ("forward", "backward", "step") for op in phase(z1, p)]
    return Finding("ZeRO-1's collectives, in the order called: " + " then ".join(op.replace("_", "-") for op in order),
                   "false" if order == ["reduce_scatter", "all_gather"] else "true", {"order": order})


def _no_master(e: Evidence) -> Finding:
    m = e.no_master
    lost = m["lost"] / m["total"]
    return Finding(f"one Adam step on the GPT's bf16 weights: {lost:.1%} of the {m['total']:,} updates were rounded "
                   f"away entirely when added in bf16, {m['master_lost']} when added to the fp32 master copy",
                   "only when" if lost > 0 else "true", {"lost": lost, "master_lost": m["master_lost"]})


CLAIMS = [
    Claim("all-reduce", "An all-reduce is a reduce-scatter followed by an all-gather.", f"{VALUES}; {WIRE}",
          _all_reduce_is_two_halves),
    Claim("ring 2x", "In a ring all-reduce each rank sends about twice the tensor (\"total data per rank ≈ 2× the "
                     "tensor size\").", WIRE, _ring_sends_twice),
    Claim("sharded", "ZeRO-1 shards the gradients as well as the optimizer states, and ZeRO-2 also shards the "
                     "parameters during backward. (The other notes: ZeRO-1 shards optimizer states, ZeRO-2 adds "
                     "gradients, ZeRO-3 adds parameters.)", MEMORY, _what_is_sharded),
    Claim("percentages", "Memory per GPU: DDP 100%, ZeRO-1 ~75%, ZeRO-2 ~50%, ZeRO-3 ~33%.", MEMORY, _percentages),
    Claim("2+16/N", "ZeRO-2 needs 2Ψ + 16Ψ/N bytes per GPU.", MEMORY, _zero2_2_plus_16),
    Claim("6-8x", "ZeRO-2 fits models 6–8× larger than ZeRO-1.", MEMORY, _zero2_six_to_eight),
    Claim("50x", "ZeRO-3 reduces memory 50×.", MEMORY, _zero3_fifty),
    Claim("activations", "ZeRO gives no savings in activation memory.",
          "activations saved by autograd (its hooks), rank 0", _activations),
    Claim("zero2 all-reduce", "ZeRO-2 needs an all-reduce after each backward pass.", f"{CALLS}; {WIRE}", _zero2_all_reduce),
    Claim("broadcast", "A broadcast is required after the optimizer step in all ZeRO variants.", CALLS,
          _broadcast_after_step),
    Claim("two gathers", "ZeRO-3 all-gathers every layer twice: in forward and again in backward.", CALLS,
          _zero3_two_gathers),
    Claim("1.5x", "ZeRO-3 sends 1.5× the bytes of DDP.", WIRE, _zero3_one_and_a_half),
    Claim("zero1 free", "ZeRO-1 is free in bandwidth: it sends what DDP sends.", WIRE, _zero1_free),
    Claim("note 000 ring", "(note 000) A ring reduce-scatter on four ranks takes the two steps drawn, rank r sending "
                           "shard r first, and leaves rank r with the reduced shard r.", VALUES, _seed_ring),
    Claim("note 001 code", "(note 001) In ZeRO-1 each GPU owns the parameter list(model.parameters())[rank], and "
                           "reduce_scatter(my_gradient_shard, all_gradients) sums the gradients into it.", RUN,
          _seed_pseudocode),
    Claim("fsdp groups", "(note 002) FSDP is a more efficient ZeRO-3: it communicates in groups rather than individual "
                         "layers, reducing the communication overhead.", f"{CALLS}; step time; {WIRE}", _fsdp_groups),
    Claim("memory for bytes", "(notes 002, 003) ZeRO trades memory for communication.", WIRE, _memory_for_bytes),
    Claim("two halves", "(note 003) Reduce-scatter then all-gather cuts traffic and memory compared with a naive "
                        "all-reduce.", WIRE, _two_halves_cut_traffic),
    Claim("zero1 order", "(note 004) ZeRO-1's optimizer step: gather the gradients, scatter the updated weights.",
          CALLS, _zero1_order),
    Claim("master copy", "(note 004) ZeRO-1 keeps two copies of the weights (bf16 and the fp32 master), which is not "
                         "necessarily required.", "one Adam step, in this process", _no_master),
]
RULES = {c.key: c.judge for c in CLAIMS}  # claim key -> its rule (Evidence -> Finding)

VERDICT_COLOURS = {"true": "#2ca02c", "false": "#d62728", "only when": "#e6550d", "not measured": "#7f7f7f"}


def judge(evidence: Evidence) -> dict:
    """{claim key: (Claim, Finding)}, every verdict computed from the evidence."""
    return {c.key: (c, c.judge(evidence)) for c in CLAIMS}


def why(claim: Claim, finding: Finding) -> str:
    """The book's explanation of the verdict (claims_text.WHY) with the measured values filled in; "" when
    the rule names none, or when the explanation was written for another verdict than the one found."""
    if finding.because is None:
        return ""
    verdict, text = WHY[finding.because or claim.key]
    return text.format(**finding.values) if verdict == finding.verdict else ""


def table(findings: dict):
    """The claims with what was measured for each and its verdict, as an HTML table."""
    def verdict(c: Claim, f: Finding) -> str:
        word, text = f'<b style="color:{VERDICT_COLOURS[f.verdict]}">{f.verdict}</b>', why(c, f)
        return word if not text else (f"{word} {text}" if f.verdict == "only when" else f"{word}: {text}")

    return html_table(["", "the claim (from one of the notes)", "measured on this page", "measured with", "verdict"],
                      [[i, c.words, f.measured, c.measured_with, verdict(c, f)]
                       for i, (c, f) in enumerate(findings.values(), 1)])
