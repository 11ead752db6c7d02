"""Chapter 14's rules (zeronb.book.claims) on evidence made by hand, no ranks: the measurements the
chapter makes give the chapter's verdicts, and evidence that contradicts a claim's verdict gives
another - a rule that cannot fail would be a sentence, not a measurement."""
import pytest

from zeronb.book import claims
from zeronb.book.claims_text import WHY
from zeronb.memory import model_state_breakdown
from zeronb.train.runs import RankReport

N, PSI, UNITS = 4, 1000, 5
PSI_B = 8 * PSI                      # float64
S = 1 << 19                          # bytes of the tensor all-reduced two ways
DDP_WIRE = 2 * (N - 1) * PSI_B // N  # a ring all-reduce of the gradients: 1.5 Ψb at N = 4

# what the chapter finds (its checks assert the measurements behind these)
VERDICTS = {"all-reduce": "true", "ring 2x": "only when", "sharded": "false", "percentages": "false",
            "2+16/N": "only when", "6-8x": "false", "50x": "only when", "activations": "only when",
            "zero2 all-reduce": "false", "broadcast": "false", "two gathers": "only when", "1.5x": "only when",
            "zero1 free": "only when", "note 000 ring": "false", "note 001 code": "false", "fsdp groups": "only when",
            "memory for bytes": "only when", "two halves": "only when", "zero1 order": "false",
            "master copy": "only when"}


def report(held=None, wire=DDP_WIRE, phases=None, calls=None, sent=None, after_backward=None, activations=4096):
    held = held or {"params": 8 * PSI, "grads": 8 * PSI, "optimizer": 16 * PSI}
    phases = {p: {"calls": c, "sent": {}, "wire": w} for p, (c, w) in (phases or {}).items()}
    trace = None if after_backward is None else [("backward pass", 0, held), ("backward pass done", 0, after_backward)]
    return RankReport(rank=0, device="cpu", num_params=PSI, steps_taken=4, final_loss=1.0, step_ms=10.0, bytes=held,
                      expected_bytes=held, sent_bytes_per_step=sent or {"all_reduce": DDP_WIRE},
                      calls_per_step=calls or {"all_reduce": 1}, wire_bytes_per_step=wire, activation_bytes=activations,
                      memory_trace=trace, phases=phases)


def mixed(stage, grads=None):
    held = model_state_breakdown(PSI, N, stage)  # 2 + 2 + 12 bytes per parameter
    return report(held=held if grads is None else {**held, "grads": grads})


def measured() -> claims.Evidence:
    """Evidence shaped like chapter 14's on four ranks under gloo, with the numbers the stages give."""
    p, g, k = 8 * PSI, 8 * PSI, 16 * PSI
    runs = {
        "DDP": report(phases={"forward": ({}, 0), "backward": ({"all_reduce": 1}, DDP_WIRE), "step": ({}, 0)}),
        "ZeRO-1": report({"params": p, "grads": g, "optimizer": k // N}, wire=3 * DDP_WIRE // 2,
                         phases={"forward": ({}, 0), "backward": ({"reduce_scatter": 1}, DDP_WIRE),
                                 "step": ({"all_gather": 1}, DDP_WIRE // 2)},
                         after_backward={"params": p, "grads": g + g // N, "optimizer": k // N}),
        "ZeRO-2": report({"params": p, "grads": g // N, "optimizer": k // N}, wire=3 * DDP_WIRE // 2,
                         phases={"forward": ({}, 0), "backward": ({"reduce_scatter": UNITS}, DDP_WIRE),
                                 "step": ({"all_gather": 1}, DDP_WIRE // 2)},
                         after_backward={"params": p, "grads": g // N, "optimizer": k // N}),
        "ZeRO-3": report({"params": p // N, "grads": g // N, "optimizer": k // N}, wire=2 * DDP_WIRE,
                         phases={"forward": ({"all_gather": UNITS}, DDP_WIRE // 2),
                                 "backward": ({"all_gather": UNITS - 1, "reduce_scatter": UNITS}, 3 * DDP_WIRE // 2),
                                 "step": ({}, 0)},
                         calls={"all_gather": 2 * UNITS - 1, "reduce_scatter": UNITS},
                         sent={"all_gather": DDP_WIRE, "reduce_scatter": DDP_WIRE // 2},
                         after_backward={"params": p // N, "grads": g // N, "optimizer": k // N}),
        "FSDP2": report({"params": p // N, "grads": g // N, "optimizer": k // N}, wire=2 * DDP_WIRE,
                        phases={"forward": ({"all_gather": UNITS}, 0), "backward": ({"all_gather": UNITS}, 0),
                                "step": ({}, 0)},
                        calls={"all_gather": 2 * UNITS, "reduce_scatter": UNITS},
                        sent={"all_gather": DDP_WIRE, "reduce_scatter": DDP_WIRE // 2}),
        "PyTorch ZeRO-1": report(wire=19 * DDP_WIRE // 10,
                                 phases={"forward": ({}, 0), "backward": ({"all_reduce": 1}, DDP_WIRE),
                                         "step": ({"broadcast": 12}, 0)}),
        "ZeRO-2, ring reduce-scatter": report(phases={"backward": ({"reduce_scatter": UNITS}, DDP_WIRE // 2)}),
        "ZeRO-3, per layer": report(wire=2 * DDP_WIRE, calls={"all_gather": 50, "reduce_scatter": 26},
                                    sent={"all_gather": DDP_WIRE, "reduce_scatter": DDP_WIRE // 2}),
    }
    ring_runs = {"DDP": report(), "ZeRO-1": report(), "ZeRO-2": report(), "ZeRO-3": report(wire=17 * DDP_WIRE // 12)}
    gloo = {"all_reduce": 3 * S // 2, "reduce_scatter": 3 * S // 2, "all_gather": 3 * S // 4,  # gloo's: an all-reduce
            "ring_all_reduce": 3 * S // 2, "ring_reduce_scatter": 3 * S // 4, "ring_all_gather": 3 * S // 4}
    two_ways = [{"diff": 0.0, "ring_diff": 0.0, "wire": {**gloo, "naive_all_reduce": 3 * S if r == 0 else S,
                                                         "direct_all_reduce": (N - 1) * S}} for r in range(N)]
    return claims.Evidence(
        world_size=N, tensor_bytes=S, two_ways=two_ways, runs=runs, ring_runs=ring_runs,
        bf16={"DDP": mixed(0), "ZeRO-1": mixed(1), "ZeRO-2": mixed(2), "ZeRO-3": mixed(3)},
        z2_fp32_shard=mixed(2, grads=4 * PSI // N), units=UNITS,
        seed_ring={2: [[[], []] for _ in range(N)], N - 1: [[[], [], [(r + 1) % N]] for r in range(N)]},
        seed_code={"parameters": 26, "ranks": N, "distinct_shapes": 7, "error": "ValueError: sizes differ",
                   "uneven": "unequal sizes work (inputs of 1, 2, 3 and 4 elements here, summed right)"},
        no_master={"lost": 300, "master_lost": 0, "total": 1000, "master_moved": 1000})


def test_the_chapters_measurements_give_the_chapters_verdicts():
    found = claims.judge(measured())
    assert {key: f.verdict for key, (_, f) in found.items()} == VERDICTS
    html = claims.table(found).data
    assert all(claims.why(c, f) for c, f in found.values()), "every verdict found is explained"
    assert "2(N−1)/N · S (plus gloo's message headers), 1.50 S at N = 4" in html
    assert "its two halves send 1.50× its all-reduce" in html
    assert "rank i's output: unequal sizes work (inputs of 1, 2, 3 and 4 elements here, summed right)" in html
    assert "for nearly the same bytes (1.000× on the wire" in html and "every rank sends less (2.00×)" in html


def _set(path, value):
    def change(e):
        *where, last = path
        target = e
        for k in where:
            target = getattr(target, k) if isinstance(k, str) and hasattr(target, k) else target[k]
        if isinstance(last, str) and hasattr(target, last):
            setattr(target, last, value)
        else:
            target[last] = value
    return change


def _each_rank(key, value):
    def change(e):
        for t in e.two_ways:
            t["wire"][key] = value(t["wire"])
    return change


# (claim, what the contradicting evidence would be, how to make it, the verdict it must give instead)
CONTRADICTIONS = [
    ("all-reduce", "the two ways give different sums", lambda e: [t.update(diff=1e-3) for t in e.two_ways], "false"),
    ("all-reduce", "the ring's halves send more than its all-reduce",
     _each_rank("ring_all_gather", lambda w: w["ring_all_reduce"]), "false"),
    ("ring 2x", "a ring rank sends S, not 2(N−1)/N S", _each_rank("ring_all_reduce", lambda w: S), "false"),
    ("sharded", "the note's table: ZeRO-1 shards gradients, ZeRO-2 parameters",
     lambda e: [e.runs["ZeRO-1"].memory_trace[-1][2].update(grads=2000),
                e.runs["ZeRO-2"].memory_trace[-1][2].update(params=2000)], "true"),
    ("percentages", "75%, 50% and 33% of DDP",
     lambda e: [setattr(e.bf16[s], "bytes", {"params": 16 * PSI * f, "grads": 0, "optimizer": 0})
                for s, f in (("ZeRO-1", 0.75), ("ZeRO-2", 0.5), ("ZeRO-3", 1 / 3))], "true"),
    ("2+16/N", "the fp32 shard holds what the bf16 one does", lambda e: setattr(e, "z2_fp32_shard", mixed(2)), "false"),
    ("6-8x", "ZeRO-2 holds a seventh of ZeRO-1", _set(("bf16", "ZeRO-2", "bytes"), {"params": 1000, "grads": 0,
                                                                                   "optimizer": 0}), "true"),
    ("50x", "ZeRO-3 holds half of DDP", _set(("runs", "ZeRO-3", "bytes"), {"params": 16 * PSI, "grads": 0,
                                                                          "optimizer": 0}), "false"),
    ("activations", "ZeRO-3 saves fewer activations", _set(("runs", "ZeRO-3", "activation_bytes"), 1024), "false"),
    ("zero2 all-reduce", "ZeRO-2's backward all-reduces",
     lambda e: e.runs["ZeRO-2"].phases["backward"]["calls"].update(all_reduce=1), "true"),
    ("broadcast", "every stage broadcasts after its step",
     lambda e: [e.runs[s].phases["step"]["calls"].update(broadcast=1) for s in ("ZeRO-1", "ZeRO-2", "ZeRO-3")], "true"),
    ("two gathers", "FSDP2 keeps every unit from forward to backward",
     lambda e: e.runs["FSDP2"].phases["backward"]["calls"].update(all_gather=0), "false"),
    ("two gathers", "zeronb's ZeRO-3 gathers its last unit again too",
     lambda e: e.runs["ZeRO-3"].phases["backward"]["calls"].update(all_gather=UNITS), "true"),
    ("1.5x", "ZeRO-3 sends twice DDP's bytes", _set(("ring_runs", "ZeRO-3", "wire_bytes_per_step"), 2 * DDP_WIRE),
     "false"),
    ("zero1 free", "ZeRO-1 sends 1.5× DDP's bytes with a ring",
     _set(("ring_runs", "ZeRO-1", "wire_bytes_per_step"), 3 * DDP_WIRE // 2), "false"),
    ("note 000 ring", "the drawn schedule works", _set(("seed_ring", N - 1), [[[], [], [r]] for r in range(N)]), "true"),
    ("note 001 code", "one tensor per rank, and the call runs",
     lambda e: e.seed_code.update(parameters=N, error=None), "true"),
    ("fsdp groups", "gathering layer by layer makes no more calls",
     _set(("runs", "ZeRO-3, per layer", "calls_per_step"), {"all_gather": 9, "reduce_scatter": 5}), "false"),
    ("memory for bytes", "ZeRO-3 sends what DDP sends", _set(("ring_runs", "ZeRO-3", "wire_bytes_per_step"), DDP_WIRE),
     "false"),
    ("two halves", "the naive all-reduce spreads its bytes like the ring",
     _each_rank("naive_all_reduce", lambda w: 3 * S // 2), "false"),
    ("two halves", "the direct all-reduce sends what the ring sends", _each_rank("direct_all_reduce", lambda w: 3 * S // 2),
     "false"),
    ("zero1 order", "ZeRO-1 gathers, then scatters",
     lambda e: [e.runs["ZeRO-1"].phases["backward"].update(calls={"all_gather": 1}),
                e.runs["ZeRO-1"].phases["step"].update(calls={"reduce_scatter": 1})], "true"),
    ("master copy", "no update is lost in bf16", lambda e: e.no_master.update(lost=0), "true"),
]


@pytest.mark.parametrize("key, what, change, verdict", CONTRADICTIONS, ids=[f"{c[0]}: {c[1]}" for c in CONTRADICTIONS])
def test_evidence_against_a_verdict_changes_it(key, what, change, verdict):
    e = measured()
    assert claims.RULES[key](e).verdict == VERDICTS[key]
    change(e)
    assert claims.RULES[key](e).verdict == verdict != VERDICTS[key], what


def test_every_rule_can_be_contradicted():
    assert {c[0] for c in CONTRADICTIONS} == set(claims.RULES)


def test_an_explanation_shows_only_beside_the_verdict_it_was_written_for():
    e = measured()
    claim = next(c for c in claims.CLAIMS if c.key == "zero1 order")
    assert claims.why(claim, claim.judge(e)).startswith("the order holds but the operations are swapped")
    next(change for key, _, change, _ in CONTRADICTIONS if key == "zero1 order")(e)
    assert claims.why(claim, claim.judge(e)) == ""
    assert all(verdict in claims.VERDICT_COLOURS for verdict, _ in WHY.values())


def test_without_counts_on_the_wire_the_traffic_claims_are_not_measured():
    e = measured()
    for rep in [*e.runs.values(), *e.ring_runs.values()]:
        rep.wire_bytes_per_step = None
    found = claims.judge(e)
    assert {k for k, (_, f) in found.items() if f.verdict == "not measured"} == {
        "ring 2x", "1.5x", "zero1 free", "memory for bytes", "two halves"}
    assert found["all-reduce"][1].verdict == "true" and "not counted" in claims.why(*found["all-reduce"])
    assert "not measured" in claims.table(found).data


def test_an_explanation_resting_on_a_measurement_is_withdrawn_when_the_measurement_does_not_bear_it():
    e = measured()
    claim = {c.key: c for c in claims.CLAIMS}
    assert "never all three" in claims.why(claim["percentages"], claims.RULES["percentages"](e))
    e.bf16["ZeRO-1"].bytes = {"params": 10 * PSI, "grads": 0, "optimizer": 0}  # storage the formula does not predict
    assert claims.why(claim["percentages"], claims.RULES["percentages"](e)) == ""  # so it says nothing of other N
    e = measured()
    e.runs["ZeRO-3, per layer"].wire_bytes_per_step = 3 * e.runs["ZeRO-3"].wire_bytes_per_step  # not "the same bytes"
    found = claims.RULES["fsdp groups"](e)
    assert found.verdict == "only when" and claims.why(claim["fsdp groups"], found) == ""


def test_bytes_per_parameter_are_the_precision_modules():
    assert claims.ADAM == {"fp32 Adam": (4, 4, 8), "mixed-precision Adam": (2, 2, 12)}


def test_a_watched_step_lies_on_the_machines_clock():
    from zeronb.book.watched import watched_step

    rank = report(held={"params": 10, "grads": 20, "optimizer": 30})
    rank.events = [("forward pass", 0, 0.0), ("backward pass done", 0, 0.5)]
    rank.memory_trace = [("forward pass", 0, {"params": 40}), ("backward pass done", 0, {"params": 40, "grads": 20})]
    rank.timeline, rank.timeline_origin = [("forward", 0, 0.1, 0.2)], 100.0
    step = watched_step(rank)
    assert (step.t0, step.shards, step.peak_bytes) == (100.0, 60, 60)
    assert step.memory == [(100.0, 40), (100.5, 60)] and step.events == [("forward", 0, 100.1, 100.2)]
    with pytest.raises(ValueError):
        watched_step(report())
