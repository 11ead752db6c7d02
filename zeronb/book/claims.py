"""The claims of the course's source notes, as data: one record per claim - what a note says (in
the book's words), which measurement settles it, and how the verdict follows from that
measurement. Chapter 14 measures (the `Evidence`), `judge` computes every verdict from it, and
`table` shows them: the page changes when the measurements do.

Verdicts: "true", "false", "only when" (true in a setting the claim does not name, which `why`
names), "not measured" (a measurement this backend cannot make: the OS counts no NCCL traffic).
No verdict rests on a byte count the ledger credits to a built-in collective, which is a formula:
traffic verdicts use the wire, where the operating system counted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..memory import model_state_bytes

WIRE = "bytes on the wire (the OS's TCP counters)"
VALUES = "values on the ranks"
MEMORY = "tensor storage on rank 0"
CALLS = "collectives called (the ledger's record)"
RUN = "the note's code, run on the ranks"
PARTS = ("params", "grads", "optimizer")
ADAM = {"fp32 Adam": (4, 4, 8), "mixed-precision Adam": (2, 2, 12)}  # bytes per parameter: p, g, K
CLAIMED_SHARE = {1: 0.75, 2: 0.50, 3: 1 / 3}  # "DDP 100%, ZeRO-1 ~75%, ZeRO-2 ~50%, ZeRO-3 ~33%"


@dataclass
class Evidence:
    """What chapter 14 measured, as the judges read it. Reports are RankReports of rank 0 (float64
    unless named otherwise); the GPT is the model throughout."""
    world_size: int
    tensor_bytes: int        # S: the float64 tensor all-reduced two ways
    two_ways: list           # per rank: {"diff", "ring_diff", "wire": {collective: bytes} or None}, the
                             # collectives gloo's, zeronb's ring ("ring_...") and the naive one through rank 0
    runs: dict               # stage name -> report of a traced step (phases, memory trace, activations);
                             # "ZeRO-3, per layer": ZeRO-3 with one unit per module that owns parameters
    ring_runs: dict          # stage name -> report, the stages' reduce-scatters run as zeronb's ring
    bf16: dict               # stage name -> report in bf16-mixed (the ZeRO paper's 2 + 2 + 12)
    z2_fp32_shard: object    # ZeRO-2 in bf16-mixed with its reduced gradient shard kept in fp32
    units: int               # the GPT's units
    seed_ring: dict          # steps -> per rank: the shards complete after each step of note 000's ring
    seed_code: dict          # note 001's pseudo-code, run on rank 0
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
    why: str = ""
    values: dict = field(default_factory=dict)  # the numbers behind the verdict, for the chapter's checks


@dataclass(frozen=True)
class Claim:
    key: str
    words: str               # the claim, in the book's words (a note's number where it is one note's)
    measured_with: str
    judge: Callable          # Evidence -> Finding


NOT_ON_WIRE = Finding("–", "not measured", "under NCCL the operating system counts no GPU traffic; traffic "
                                           "verdicts need gloo")


def close(a, b) -> bool:
    return abs(a - b) <= 0.03  # "~": within 3 percentage points (or 3%)


def held(report) -> int:
    return sum(report.bytes.values())


def wire(report) -> int:
    return report.wire_bytes_per_step


def fraction(n, stage, per) -> float:
    return model_state_bytes(1, n, stage, *per) / model_state_bytes(1, n, 0, *per)


def phase(report, name, what="calls"):
    return report.phases[name][what]


def _ops_text(ops) -> str:
    return " + ".join(f"{op.replace('_', '-')} ×{n}" for op, n in ops.items()) or "nothing"


# --- the judges, one per claim ---------------------------------------------------------------------

def _all_reduce_is_two_halves(e: Evidence) -> Finding:
    worst = max(t["diff"] for t in e.two_ways)
    n = e.world_size
    if not e.on_wire:
        return Finding(f"largest difference between the two results on {n} ranks: {worst:.1e}",
                       "true" if worst <= 1e-12 else "false", "the same result (bytes: not counted under NCCL)",
                       {"worst": worst})
    w = e.two_ways[0]["wire"]
    ring_two, gloo_two = w["ring_reduce_scatter"] + w["ring_all_gather"], w["reduce_scatter"] + w["all_gather"]
    same_bytes = abs(ring_two / w["ring_all_reduce"] - 1) < 0.01
    return Finding(f"largest difference between the two results on {n} ranks: {worst:.1e}; on the wire, rank 0: "
                   f"ring all-reduce {w['ring_all_reduce']:,} bytes, ring reduce-scatter + all-gather {ring_two:,}; "
                   f"gloo's reduce-scatter + all-gather {gloo_two:,} against its all-reduce {w['all_reduce']:,}",
                   "true" if worst <= 1e-12 and same_bytes else "false",
                   "the same result, and the same bytes with a real reduce-scatter (gloo's is an all-reduce, so "
                   f"its two halves send {gloo_two / w['all_reduce']:.2f}× its all-reduce)",
                   {"worst": worst, "ring_two": ring_two, "same_bytes": same_bytes})


def _ring_sends_twice(e: Evidence) -> Finding:
    if not e.on_wire:
        return NOT_ON_WIRE
    n, ring = e.world_size, e.two_ways[0]["wire"]["ring_all_reduce"] / e.tensor_bytes
    formula = abs(ring / (2 * (n - 1) / n) - 1) < 0.01
    return Finding(f"ring all-reduce of S = {e.tensor_bytes:,} bytes: {e.two_ways[0]['wire']['ring_all_reduce']:,} "
                   f"bytes left rank 0 = {ring:.3f} S; 2(N−1)/N = {2 * (n - 1) / n:.3f}",
                   "false" if not formula else ("true" if ring > 1.9 else "only when"),
                   f"N is large: each rank sends 2(N−1)/N · S (plus gloo's message headers), {ring:.2f} S at "
                   f"N = {n}, and within 5% of 2S only from N = 20 on, the same rule that makes \"50×\" a "
                   "property of 50 ranks", {"ring": ring})


def _what_is_sharded(e: Evidence) -> Finding:
    full = {"params": 8 * e.psi, "grads": 8 * e.psi, "optimizer": 16 * e.psi}  # float64 Adam: 8 + 8 + 2 × 8
    after = {s: next(h for ev, _, h in e.runs[s].memory_trace if ev == "backward pass done")
             for s in ("ZeRO-1", "ZeRO-2", "ZeRO-3")}
    share = {s: {p: after[s][p] / full[p] for p in PARTS} for s in after}
    sharded = {s: {p for p in PARTS if share[s][p] < 0.5} for s in share}
    note_table = {"ZeRO-1": {"grads", "optimizer"}, "ZeRO-2": {"grads", "optimizer", "params"}, "ZeRO-3": set(PARTS)}
    other_notes = {"ZeRO-1": {"optimizer"}, "ZeRO-2": {"grads", "optimizer"}, "ZeRO-3": set(PARTS)}
    return Finding("held ÷ full model on rank 0 when backward ends: " + "; ".join(
                       f"{s} " + ", ".join(f"{p} {share[s][p]:.2f}" for p in PARTS) for s in share),
                   "false" if sharded != note_table else "true",
                   "ZeRO-1 keeps every gradient (and, once it has reduce-scattered them, its summed shard on top) "
                   "and ZeRO-2 every parameter; the other notes' version is what was measured"
                   if sharded == other_notes else "neither version matches",
                   {"share": share, "sharded": sharded, "note_table": note_table, "other_notes": other_notes})


def _percentages(e: Evidence) -> Finding:
    n = e.world_size
    names = {1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
    measured = {s: held(e.bf16[names[s]]) / held(e.bf16["DDP"]) for s in names}
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
    return Finding(f"mixed precision, N = {n}: " + ", ".join(f"{names[s]} {measured[s]:.1%}" for s in names) + " of DDP",
                   "true" if holds_now else ("only when" if together else "false"),
                   "the fractions depend on N and on the optimizer's bytes per parameter; each number holds only in "
                   "one setting (" + "; ".join(f"{CLAIMED_SHARE[s]:.0%} for ZeRO-{s}: {settings(where[s])}"
                                               for s in CLAIMED_SHARE)
                   + ")" + ("" if together else ", never all three at one N"),
                   {"measured": measured, "together": together})


def _zero2_2_plus_16(e: Evidence) -> Finding:
    n = e.world_size
    z2, z2_fp32 = held(e.bf16["ZeRO-2"]) / e.psi, held(e.z2_fp32_shard) / e.psi
    note, paper = 2 + 16 / n, 2 + 14 / n
    return Finding(f"ZeRO-2, mixed precision, N = {n}: {z2:.2f} Ψ bytes with a bf16 gradient shard (the paper's), "
                   f"{z2_fp32:.2f} Ψ with the shard kept in fp32; 2 + 16/N = {note:.2f}; 2 + 14/N = {paper:.2f}",
                   "only when" if close(z2_fp32 / note, 1) and close(z2 / paper, 1) else "false",
                   "the reduced gradient shard is kept in fp32 (4 bytes) beside the 12 of the optimizer; the ZeRO "
                   "paper's ZeRO-2 keeps it in bf16 and needs 2Ψ + 14Ψ/N",
                   {"z2": z2, "z2_fp32": z2_fp32, "note": note, "paper": paper})


def _zero2_six_to_eight(e: Evidence) -> Finding:
    n = e.world_size
    z1_over_z2 = held(e.bf16["ZeRO-1"]) / held(e.bf16["ZeRO-2"])
    ddp_over_z2 = held(e.bf16["DDP"]) / held(e.bf16["ZeRO-2"])
    six_from = next(k for k in range(2, 10**6) if 1 / fraction(k, 2, ADAM["mixed-precision Adam"]) >= 6)
    return Finding(f"mixed precision, N = {n}: ZeRO-1 ÷ ZeRO-2 = {z1_over_z2:.2f}×; DDP ÷ ZeRO-2 = {ddp_over_z2:.2f}×",
                   "true" if z1_over_z2 >= 6 else "false",
                   f"against ZeRO-1 it is at most (2+2)/2 = 2× for any N; 6–8× is against DDP, and only for large N "
                   f"(at least 6× from N = {six_from}, 8× in the limit)",
                   {"z1_over_z2": z1_over_z2, "ddp_over_z2": ddp_over_z2, "six_from": six_from})


def _zero3_fifty(e: Evidence) -> Finding:
    n = e.world_size
    reduction = {"float64": held(e.runs["DDP"]) / held(e.runs["ZeRO-3"]),
                 "bf16-mixed": held(e.bf16["DDP"]) / held(e.bf16["ZeRO-3"])}
    return Finding(f"DDP ÷ ZeRO-3 at N = {n}: " + ", ".join(f"{v:.2f}× ({d})" for d, v in reduction.items()),
                   "only when" if all(close(v / n, 1) for v in reduction.values()) else "false",
                   "N_d = 50: the reduction is the data-parallel degree N_d, whatever the precision",
                   {"reduction": reduction})


def _activations(e: Evidence) -> Finding:
    acts = {s: e.runs[s].activation_bytes for s in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")}
    return Finding("activations saved for backward on rank 0: " + ", ".join(f"{s} {a / 1024:.1f} KiB" for s, a in acts.items()),
                   "only when" if len(set(acts.values())) == 1 else "false",
                   "of ZeRO's data-parallel stages: every stage saved the same activations, from its own slice of "
                   "the batch. ZeRO-R, in the same paper, partitions activation checkpoints across model-parallel "
                   "ranks, which does save activation memory", {"acts": acts})


def _zero2_all_reduce(e: Evidence) -> Finding:
    calls = phase(e.runs["ZeRO-2"], "backward")
    z2 = {op: calls.get(op, 0) for op in ("all_reduce", "reduce_scatter")}
    text = f"ZeRO-2's backward calls: {z2['all_reduce']} all-reduces, {z2['reduce_scatter']} reduce-scatters"
    values = {"calls": z2}
    if e.on_wire:
        values["backward_vs_ddp"] = phase(e.runs["ZeRO-2, ring reduce-scatter"], "backward", "wire") / wire(e.ring_runs["DDP"])
        text += (f"; with a real (ring) reduce-scatter its backward put {values['backward_vs_ddp']:.2f}× DDP's "
                 "all-reduce bytes on the wire")
    return Finding(text, "true" if z2["all_reduce"] > 0 else "false",
                   "ZeRO-2 reduce-scatters, so each rank receives only its shard of the summed gradients: half an "
                   "all-reduce's bytes", values)


def _broadcast_after_step(e: Evidence) -> Finding:
    step_ops = {s: phase(e.runs[s], "step") for s in ("ZeRO-1", "ZeRO-2", "ZeRO-3", "PyTorch ZeRO-1")}
    ours = [s for s in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
            if any(phase(e.runs[s], p).get("broadcast") for p in ("forward", "backward", "step"))]
    text = "collectives called during the optimizer step: " + "; ".join(f"{s}: {_ops_text(o)}" for s, o in step_ops.items())
    if e.on_wire:
        text += f"; ZeRO-3's step put {phase(e.runs['ZeRO-3'], 'step', 'wire'):,} bytes on the wire"
    return Finding(text, "true" if all(o.get("broadcast") for o in step_ops.values()) else "false",
                   "ZeRO-1 and ZeRO-2 all-gather the updated shards (PyTorch's ZeroRedundancyOptimizer broadcasts "
                   "them instead); ZeRO-3 sends nothing, as the next forward gathers what it needs",
                   {"step_ops": step_ops, "zeronb_broadcasts": ours})


def _zero3_two_gathers(e: Evidence) -> Finding:
    gathers = {s: (phase(e.runs[s], "forward").get("all_gather", 0), phase(e.runs[s], "backward").get("all_gather", 0))
               for s in ("ZeRO-3", "FSDP2")}
    u = e.units
    return Finding(f"all-gather calls for the GPT's {u} units, forward / backward: "
                   + "; ".join(f"{s} {f} / {b}" for s, (f, b) in gathers.items()),
                   "true" if gathers["FSDP2"] == (u, u) else "false",
                   "two per unit, except that an implementation may keep the last unit from its forward to its "
                   "backward, which follows at once (zeronb does: one gather fewer)"
                   if gathers["ZeRO-3"] == (u, u - 1) else "", {"gathers": gathers})


def _zero3_one_and_a_half(e: Evidence) -> Finding:
    if not e.on_wire:
        return NOT_ON_WIRE
    z3_ring = wire(e.ring_runs["ZeRO-3"]) / wire(e.ring_runs["DDP"])
    fsdp2_gloo = wire(e.runs["FSDP2"]) / wire(e.runs["DDP"])
    return Finding(f"on the wire per step ÷ DDP's: zeronb's ZeRO-3 with a ring reduce-scatter {z3_ring:.3f}; "
                   f"FSDP2 with gloo's collectives {fsdp2_gloo:.3f}",
                   "only when" if 1.35 < z3_ring < 1.55 else "false",
                   "the reduce-scatter is a real one: two all-gathers and a reduce-scatter, 3(N−1)/N · Ψb against "
                   "2(N−1)/N (a little less when the last unit is kept, as zeronb does); on gloo, whose "
                   "reduce-scatter is an all-reduce, FSDP2 sends about twice DDP's bytes",
                   {"z3_ring": z3_ring, "fsdp2_gloo": fsdp2_gloo})


def _zero1_free(e: Evidence) -> Finding:
    if not e.on_wire:
        return NOT_ON_WIRE
    z1_ring = wire(e.ring_runs["ZeRO-1"]) / wire(e.ring_runs["DDP"])
    z1_gloo = wire(e.runs["ZeRO-1"]) / wire(e.runs["DDP"])
    torch_z1 = wire(e.runs["PyTorch ZeRO-1"]) / wire(e.runs["DDP"])
    return Finding(f"on the wire per step ÷ DDP's: ZeRO-1 with a ring reduce-scatter {z1_ring:.3f}, with gloo's "
                   f"{z1_gloo:.3f}; PyTorch's ZeroRedundancyOptimizer {torch_z1:.3f}",
                   "only when" if abs(z1_ring - 1) < 0.03 else "false",
                   "it reduce-scatters the gradients and all-gathers the parameters with a real reduce-scatter "
                   f"(gloo's own is an all-reduce: {z1_gloo:.2f}×). PyTorch's ZeroRedundancyOptimizer sends "
                   f"{torch_z1:.2f}× DDP's bytes: its broadcasts cost about what ZeRO-1's all-gather does "
                   "(chapter 8), and the excess is DDP's whole all-reduce of the gradients, where a reduce-scatter "
                   "would do", {"z1_ring": z1_ring, "z1_gloo": z1_gloo, "torch_z1": torch_z1})


def _seed_ring(e: Evidence) -> Finding:
    n = e.world_size
    drawn, full = e.seed_ring[2], e.seed_ring[n - 1]
    return Finding(f"that schedule, run: complete shards per rank after 2 steps {[c[-1] for c in drawn]}, after "
                   f"{n - 1} steps {[c[-1] for c in full]}",
                   "false" if any(c[-1] != [r] for r, c in enumerate(full)) or any(c[-1] for c in drawn) else "true",
                   f"a ring needs N − 1 = {n - 1} steps per pass, and with rank r sending shard r first, rank r ends "
                   "with shard r + 1 (zeronb's ring sends shard r − 1 first, so that rank r ends with shard r)")


def _seed_pseudocode(e: Evidence) -> Finding:
    c = e.seed_code
    return Finding(f"the GPT has {c['parameters']} parameter tensors of {c['distinct_shapes']} shapes for "
                   f"{c['ranks']} ranks; the call, as written: " + (c["error"] or "no error"),
                   "false" if c["error"] or c["parameters"] != c["ranks"] else "true",
                   "ZeRO shards a flat buffer into N equal chunks (chapter 8); the pseudo-code assumes one tensor "
                   "per rank, and a reduce-scatter needs N equal-sized inputs")


def _fsdp_groups(e: Evidence) -> Finding:
    layer, block, fsdp2 = e.runs["ZeRO-3, per layer"], e.runs["ZeRO-3"], e.runs["FSDP2"]
    calls = {name: sum(r.calls_per_step.values()) for name, r in (("layer", layer), ("block", block), ("FSDP2", fsdp2))}
    sent = {name: sum(r.sent_bytes_per_step.values()) for name, r in (("layer", layer), ("block", block), ("FSDP2", fsdp2))}
    ms = {name: e.step_ms.get(name, r.step_ms) for name, r in
          (("ZeRO-3, per layer", layer), ("ZeRO-3", block), ("FSDP2", fsdp2))}  # the slowest rank's
    text = (f"ZeRO-3 gathering layer by layer: {calls['layer']} collectives a step, {ms['ZeRO-3, per layer']:.0f} ms; "
            f"by block (the model's units): {calls['block']}, {ms['ZeRO-3']:.0f} ms; FSDP2 by block: "
            f"{calls['FSDP2']}, {ms['FSDP2']:.0f} ms; bytes by the ledger, per layer ÷ per block "
            f"{sent['layer'] / sent['block']:.3f}")
    values = {"calls": calls, "sent": sent}
    if e.on_wire:
        values["wire_ratio"] = wire(fsdp2) / wire(block)
        text += f"; on the wire, FSDP2 ÷ zeronb's ZeRO-3 by block {values['wire_ratio']:.3f}"
    return Finding(text, "only when" if calls["layer"] > calls["block"] else "false",
                   "compared with a ZeRO-3 that gathers layer by layer, as DeepSpeed's fetches the parameters of "
                   "each sub-module as it runs: grouping a block's parameters into one collective cuts the calls, "
                   "and the fixed cost of each, for the same bytes. It is the wrapping that saves, not FSDP: "
                   "zeronb's ZeRO-3 groups by block too, and then makes FSDP2's calls and sends its bytes", values)


def _memory_for_bytes(e: Evidence) -> Finding:
    if not e.on_wire:
        return NOT_ON_WIRE
    trade = {s: wire(e.ring_runs[s]) / wire(e.ring_runs["DDP"]) for s in ("ZeRO-1", "ZeRO-2", "ZeRO-3")}
    return Finding("on the wire per step ÷ DDP's, with a real reduce-scatter: "
                   + ", ".join(f"{s} {v:.3f}" for s, v in trade.items()),
                   "only when" if abs(trade["ZeRO-1"] - 1) < 0.03 and abs(trade["ZeRO-2"] - 1) < 0.03
                   and trade["ZeRO-3"] > 1.3 else "false",
                   "stage 3: stages 1 and 2 save memory at no cost in bytes; only stage 3 pays with about 1.5× the "
                   "traffic", {"trade": trade})


def _two_halves_cut_traffic(e: Evidence) -> Finding:
    if not e.on_wire:
        return NOT_ON_WIRE
    halves = [t["wire"]["ring_reduce_scatter"] + t["wire"]["ring_all_gather"] for t in e.two_ways]
    naive = [t["wire"]["naive_all_reduce"] for t in e.two_ways]
    busiest, total = max(naive) / max(halves), sum(naive) / sum(halves)
    return Finding(f"on the wire, S = {e.tensor_bytes:,} bytes: ring reduce-scatter + all-gather "
                   f"{' / '.join(f'{h / e.tensor_bytes:.2f}' for h in halves)} S on ranks 0, 1, …; the naive "
                   f"all-reduce through rank 0 {' / '.join(f'{v / e.tensor_bytes:.2f}' for v in naive)} S: its busiest "
                   f"rank {busiest:.2f}× the ring's, all ranks together {total:.2f}×",
                   "only when" if busiest > 1.2 and abs(total - 1) < 0.03 else "false",
                   "the traffic is that of the busiest rank, against a naive all-reduce through one rank: the ranks "
                   "together send the same bytes either way (the ring spreads them evenly), and both end with the "
                   "whole reduced tensor on every rank, so no memory is saved unless one stops after the "
                   "reduce-scatter and keeps the shard (ZeRO-2)", {"busiest": busiest, "total": total})


def _zero1_order(e: Evidence) -> Finding:
    z1 = e.runs["ZeRO-1"]
    order = [op for p in ("forward", "backward", "step") for op in phase(z1, p)]
    return Finding("ZeRO-1's collectives, in the order called: " + " then ".join(op.replace("_", "-") for op in order),
                   "false" if order == ["reduce_scatter", "all_gather"] else "true",
                   "the reverse: the gradients are reduce-scattered (each rank gets its summed shard) as backward "
                   "ends, and the updated weights all-gathered after the optimizer step", {"order": order})


def _no_master(e: Evidence) -> Finding:
    m = e.no_master
    lost = m["lost"] / m["total"]
    return Finding(f"one Adam step on the GPT's bf16 weights: {lost:.1%} of the {m['total']:,} updates were rounded "
                   f"away entirely when added in bf16, {m['master_lost']} when added to the fp32 master copy",
                   "only when" if lost > 0 else "true",
                   "read as \"bf16 weights alone will do\": when the training tolerates updates that bf16 cannot "
                   "resolve. Read as \"one fp32 copy will do\", it holds: keep only the fp32 weights and cast them "
                   "to bf16 for each use, as FSDP2's MixedPrecisionPolicy (param_dtype) does, and no update is lost "
                   f"({m['master_lost']} here), for a cast per use", {"lost": lost})


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

VERDICT_COLOURS = {"true": "#2ca02c", "false": "#d62728", "only when": "#e6550d", "not measured": "#7f7f7f"}


def judge(evidence: Evidence) -> dict:
    """{claim key: (Claim, Finding)}, every verdict computed from the evidence."""
    return {c.key: (c, c.judge(evidence)) for c in CLAIMS}


def table(findings: dict):
    """The claims with what was measured for each and its verdict, as an HTML table."""
    from .display import table as html_table

    def verdict(f: Finding) -> str:
        word = f'<b style="color:{VERDICT_COLOURS[f.verdict]}">{f.verdict}</b>'
        return word if not f.why else (f"{word} {f.why}" if f.verdict == "only when" else f"{word}: {f.why}")

    return html_table(["", "the claim (from one of the notes)", "measured on this page", "measured with", "verdict"],
                      [[i, c.words, f.measured, c.measured_with, verdict(f)]
                       for i, (c, f) in enumerate(findings.values(), 1)])
