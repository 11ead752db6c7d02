"""The ZeRO stages against single-process training: parity, memory held, bytes sent."""
import argparse
import itertools

import pytest
import torch

from zeronb import Cluster, memory
from zeronb.ledger import ring_bytes
from zeronb.train import parse_args, train_rank, train_single

STEPS = 5


def _args(**kw) -> argparse.Namespace:
    a = parse_args([])
    a.steps = STEPS
    a.clip = None
    for k, v in kw.items():
        setattr(a, k, v)
    return a


@pytest.fixture(scope="module", params=[2, 4])
def results(request):
    """Every (model, dtype, stage, impl) on one pool of N ranks, plus the single-process references."""
    n = request.param
    combos = list(itertools.product(["mlp", "gpt"], ["float64", "float32"], [0, 1, 2, 3], ["zeronb", "torch"]))
    refs = {(m, d): train_single(_args(model=m, dtype=d, stage=0)) for m in ("mlp", "gpt") for d in ("float64", "float32")}

    def all_runs(combos):
        return [train_rank(_args(model=m, dtype=d, stage=s, impl=i)) for m, d, s, i in combos]

    with Cluster(n, backend="gloo", verbose=False) as c:
        per_rank = c.run(all_runs, combos, echo=False, timeout=900)
    return n, combos, per_rank, refs


def test_parity_with_single_process_training(results):
    n, combos, per_rank, refs = results
    for k, (model, dtype, stage, impl) in enumerate(combos):
        ref = refs[(model, dtype)]["params"]
        got = per_rank[0][k]["params"]
        assert set(got) == set(ref)
        err = max((got[name] - ref[name]).abs().max().item() for name in ref)
        tol = 1e-10 if dtype == "float64" else 1e-5
        assert err <= tol, f"{model} {dtype} stage {stage} {impl} at N={n}: max error {err:.3g}"
        # the global-batch loss agrees too
        assert abs(per_rank[0][k]["final_loss"] - refs[(model, dtype)]["losses"][-1]) <= 1e3 * tol


def test_memory_held_matches_the_formula(results):
    n, combos, per_rank, _ = results
    for k, (model, dtype, stage, impl) in enumerate(combos):
        if impl != "zeronb":
            continue
        for rank in range(n):
            rep = per_rank[rank][k]
            for part in ("params", "grads", "optimizer"):
                got, want = rep["bytes"][part], rep["expected_bytes"][part]
                assert abs(got - want) <= 0.03 * want, (model, dtype, stage, rank, part, got, want)


def test_bytes_sent_per_step(results):
    n, combos, per_rank, _ = results
    for k, (model, dtype, stage, impl) in enumerate(combos):
        if impl != "zeronb":
            continue
        rep = per_rank[0][k]
        psi, b = rep["num_params"], torch.tensor([], dtype=getattr(torch, dtype)).element_size()
        sent = sum(rep["sent_bytes_per_step"].values())
        two = 2 * (n - 1) / n * psi * b  # what one all-reduce of the gradients sends
        if stage in (0, 1, 2):
            # padding each bucket to a multiple of N adds at most N-1 elements per bucket
            assert two <= sent <= two * 1.02, (model, dtype, stage, sent, two)
        else:
            three = 3 * (n - 1) / n * psi * b
            assert two < sent <= three * 1.02, (model, dtype, stage, sent, three)


def test_stage_3_skips_exactly_the_last_units_second_gather(results):
    n, combos, per_rank, _ = results
    k = combos.index(("gpt", "float64", 3, "zeronb"))
    rep = per_rank[0][k]
    from zeronb.models import Config, make_model

    units = make_model(Config(kind="gpt"), torch.float64).units()
    sizes = [sum(p.numel() for p in u.parameters()) for u in units]
    per_unit = [ring_bytes("all_gather", s * 8, n, 8) for s in sizes]
    assert rep["sent_bytes_per_step"]["all_gather"] == 2 * sum(per_unit) - per_unit[-1]
    assert rep["sent_bytes_per_step"]["reduce_scatter"] == sum(per_unit)


def test_zero1_sends_what_ddp_sends(results):
    n, combos, per_rank, _ = results
    for model in ("mlp", "gpt"):
        ddp = per_rank[0][combos.index((model, "float64", 0, "zeronb"))]["sent_bytes_per_step"]
        z1 = per_rank[0][combos.index((model, "float64", 1, "zeronb"))]["sent_bytes_per_step"]
        assert z1["reduce_scatter"] + z1["all_gather"] == ddp["all_reduce"]


def _activations_and_bf16_memory():
    import torch.distributed as dist

    from zeronb.memory import saved_activations
    from zeronb.models import Config, local_batch, make_model
    from zeronb.zero import STAGES

    rank, n = dist.get_rank(), dist.get_world_size()
    out = {"activations": {}, "bf16": {}}
    for stage, Engine in STAGES.items():
        cfg = Config(kind="gpt")
        model = make_model(cfg, torch.float32)
        engine = Engine(model, precision="float32")
        x, y = local_batch(cfg, 0, rank, n)
        with saved_activations(exclude=list(model.parameters())) as saved:
            loss = engine.loss(x, y)
        loss.backward()
        engine.step()
        out["activations"][stage] = saved["bytes"]
        # the paper's accounting: bf16 parameters and gradients, fp32 master + Adam states (2+2+12)
        model = make_model(cfg, torch.bfloat16)
        engine = Engine(model, precision="bf16-mixed")
        engine.train_step(*local_batch(cfg, 0, rank, n, torch.bfloat16))
        out["bf16"][stage] = (memory.measure(**engine.state_tensors()),
                              memory.model_state_breakdown(sum(p.numel() for p in model.parameters()), n, stage))
    return out


def test_activations_are_not_sharded_and_bf16_mixed_holds_2_2_12():
    with Cluster(2, backend="gloo", verbose=False) as c:
        res = c.run(_activations_and_bf16_memory, echo=False)
    for rank_out in res:
        acts = rank_out["activations"]
        assert len(set(acts.values())) == 1 and acts[0] > 0, acts  # the same at every stage
        for stage, (got, want) in rank_out["bf16"].items():
            for part in ("params", "grads", "optimizer"):
                assert abs(got[part] - want[part]) <= 0.03 * want[part], (stage, part, got, want)


def _zero2_fp32_grad_shard():
    import torch.distributed as dist

    from zeronb.models import Config, local_batch, make_model
    from zeronb.zero import ZeRO2

    rank, n = dist.get_rank(), dist.get_world_size()
    cfg = Config(kind="gpt")
    out = {}
    for dtype in (None, torch.float32):
        model = make_model(cfg, torch.bfloat16)
        engine = ZeRO2(model, precision="bf16-mixed", grad_shard_dtype=dtype)
        for step in range(2):
            engine.train_step(*local_batch(cfg, step, rank, n, torch.bfloat16))
        out[str(dtype)] = (memory.measure(**engine.state_tensors()), sum(p.numel() for p in model.parameters()),
                           {k: v.clone() for k, v in engine.full_parameters().items()})
    return out


def test_zero2_with_an_fp32_gradient_shard_holds_2_plus_16_over_n_and_trains_the_same():
    n = 2
    with Cluster(n, backend="gloo", verbose=False) as c:
        res = c.run(_zero2_fp32_grad_shard, echo=False)
    for out in res:
        (paper, psi, p_paper), (recipe, _, p_recipe) = out["None"], out["torch.float32"]
        assert abs(paper["grads"] - 2 * psi / n) <= 0.03 * 2 * psi / n      # the paper's bf16 shard
        assert abs(recipe["grads"] - 4 * psi / n) <= 0.03 * 4 * psi / n     # fp32: 2 + (4 + 12) / N in all
        assert recipe["params"] == paper["params"] and recipe["optimizer"] == paper["optimizer"]
        assert all(torch.equal(p_paper[k], p_recipe[k]) for k in p_paper)  # the same bf16 sums, upcast


def _accumulate(model, dtype):
    from zeronb.train import parse_args, train_rank

    out = {}
    for stage in range(4):
        for impl in ("zeronb", "torch"):
            for sync in ("every", "last"):
                args = parse_args(["--model", model, "--stage", str(stage), "--impl", impl, "--dtype", dtype,
                                   "--steps", "2", "--grad-accum", "2", "--accum-sync", sync])
                rep = train_rank(args)
                out[stage, impl, sync] = {k: rep[k] for k in ("params", "calls_per_step", "wire_bytes_per_step",
                                                               "grad_bytes_after_micro_batch", "num_params")}
    return out


@pytest.mark.parametrize("ranks", [2, 4])
def test_gradient_accumulation_matches_one_process_on_the_whole_batch_for_every_stage_and_choice(ranks):
    with Cluster(ranks, backend="gloo", verbose=False) as c:
        res = c.run(_accumulate, "gpt", "float64", echo=False, timeout=600)
    ref = train_single(_args(model="gpt", dtype="float64", stage=0, steps=2))["params"]
    for (stage, impl, sync), r in res[0].items():
        err = max((r["params"][k] - ref[k]).abs().max().item() for k in ref)
        assert err <= 1e-10, (stage, impl, sync, err)
    psi_b = res[0][0, "zeronb", "every"]["num_params"] * 8
    for out in res:  # every rank
        z = {key: r for key, r in out.items() if key[1] == "zeronb"}
        # sync every micro-batch: the gradient collective twice (K = 2); after the last only: once
        assert z[0, "zeronb", "every"]["calls_per_step"]["all_reduce"] == 2 * z[0, "zeronb", "last"]["calls_per_step"]["all_reduce"]
        for stage in (2, 3):
            assert z[stage, "zeronb", "every"]["calls_per_step"]["reduce_scatter"] == \
                2 * z[stage, "zeronb", "last"]["calls_per_step"]["reduce_scatter"]
        # on the wire (the OS's count): DDP's every-micro-batch sync sends about twice the bytes
        ratio = z[0, "zeronb", "every"]["wire_bytes_per_step"] / z[0, "zeronb", "last"]["wire_bytes_per_step"]
        assert 1.9 < ratio < 2.1, ratio
        # memory between micro-batches: ZeRO-2/3 keeping full gradients hold them all (Ψb); reduce-
        # scattering every micro-batch holds only shards
        for stage in (2, 3):
            every = z[stage, "zeronb", "every"]["grad_bytes_after_micro_batch"][0]
            last = z[stage, "zeronb", "last"]["grad_bytes_after_micro_batch"][0]
            assert every < 0.6 * psi_b <= psi_b <= last, (stage, every, last, psi_b)
        # DDP divides by N before its all-reduce (as PyTorch's does): the next micro-batch adds into
        # the synced average, so syncing every micro-batch holds no more than syncing after the last
        every, last = (z[0, "zeronb", sync]["grad_bytes_after_micro_batch"][0] for sync in ("every", "last"))
        assert every == last and psi_b <= last <= 1.01 * psi_b, (every, last, psi_b)  # (+ the buckets' padding)


def _clipped(clip):
    from zeronb.train import parse_args, train_rank

    out = {}
    for stage in range(4):
        for impl in ("zeronb", "torch"):
            argv = ["--model", "gpt", "--stage", str(stage), "--impl", impl, "--dtype", "float64", "--steps", "3"]
            rep = train_rank(parse_args(argv + (["--clip", str(clip)] if clip else [])))
            out[stage, impl] = (rep["params"], rep["grad_norm"])
    return out


@pytest.mark.parametrize("ranks", [2, 4])
def test_global_norm_clipping_over_shards_matches_clip_grad_norm_on_one_process(ranks):
    clip = 0.05  # well below this model's gradient norm (~0.4): every step is clipped
    with Cluster(ranks, backend="gloo", verbose=False) as c:
        res = c.run(_clipped, clip, echo=False, timeout=600)
        unclipped = c.run(_clipped, None, echo=False, timeout=600)[0]
    ref = train_single(_args(model="gpt", dtype="float64", stage=0, steps=3, clip=clip))
    plain = train_single(_args(model="gpt", dtype="float64", stage=0, steps=3))["params"]
    assert max((ref["params"][k] - plain[k]).abs().max().item() for k in plain) > 1e-6  # clipping mattered
    for key, (params, norm) in res[0].items():
        err = max((params[k] - ref["params"][k]).abs().max().item() for k in ref["params"])
        assert err <= 1e-10, (key, err)
        assert abs(norm - ref["ranks"][0]["grad_norm"]) <= 1e-12 * norm, (key, norm)
        assert unclipped[key][1] is None
    for out in res[1:]:  # every rank saw the same norm: one all-reduce of the partial sums
        for key, (_, norm) in out.items():
            assert abs(norm - res[0][key][1]) <= 1e-15 * norm, key


def _reduce_dtypes():
    from zeronb.train import parse_args, train_rank

    out = {}
    for stage in range(4):
        for impl in ("zeronb", "torch"):
            for rd in (None, "fp32", "bf16"):
                argv = ["--model", "gpt", "--stage", str(stage), "--impl", impl, "--dtype", "float32", "--steps", "3"]
                rep = train_rank(parse_args(argv + (["--reduce-dtype", rd] if rd else [])))
                out[stage, impl, rd] = (rep["params"], rep["wire_bytes_per_step"])
    return out


@pytest.mark.parametrize("ranks", [2, 4])
def test_reducing_in_bf16_halves_the_bytes_and_costs_precision_against_float64(ranks):
    with Cluster(ranks, backend="gloo", verbose=False) as c:
        res = c.run(_reduce_dtypes, echo=False, timeout=600)
    ref = train_single(_args(model="gpt", dtype="float64", stage=0, steps=3))["params"]

    def error(params):  # against float64 training: what float32 training, and the reduction, cost
        return max((params[k].double() - ref[k]).abs().max().item() for k in ref)

    r0 = res[0]
    for stage in range(4):
        for impl in ("zeronb", "torch"):
            default, fp32, bf16 = (r0[stage, impl, rd] for rd in (None, "fp32", "bf16"))
            assert all(torch.equal(default[0][k], fp32[0][k]) for k in ref), (stage, impl)  # fp32 grads: no change
            assert error(bf16[0]) > 2 * error(fp32[0]) and error(bf16[0]) < 1e-2, (stage, impl, error(bf16[0]))
    # on the wire: DDP's all-reduce of bf16 gradients sends half the bytes
    for out in res:
        ratio = out[0, "zeronb", "bf16"][1] / out[0, "zeronb", "fp32"][1]
        assert 0.45 < ratio < 0.56, ratio


def _checkpointed():
    from zeronb.train import parse_args, train_rank

    out = {}
    for stage in range(4):
        for impl in ("zeronb", "torch"):
            for ac in (False, True):
                argv = ["--model", "gpt", "--stage", str(stage), "--impl", impl, "--dtype", "float64", "--steps", "2"]
                rep = train_rank(parse_args(argv + (["--activation-checkpointing"] if ac else [])))
                out[stage, impl, ac] = (rep["params"], rep["activation_bytes"], rep["calls_per_step"])
    return out


@pytest.mark.parametrize("ranks", [2, 4])
def test_activation_checkpointing_keeps_less_and_trains_the_same(ranks):
    with Cluster(ranks, backend="gloo", verbose=False) as c:
        res = c.run(_checkpointed, echo=False, timeout=600)
    ref = train_single(_args(model="gpt", dtype="float64", stage=0, steps=2))["params"]
    for (stage, impl, ac), (params, act, calls) in res[0].items():
        assert max((params[k] - ref[k]).abs().max().item() for k in ref) <= 1e-10, (stage, impl, ac)
        if ac:
            plain_act, plain_calls = res[0][stage, impl, False][1:]
            assert 0 < act < 0.25 * plain_act, (stage, impl, act, plain_act)  # the units' insides: recomputed
            assert calls == plain_calls  # zeronb's ZeRO-3 recomputes inside the unit's backward: no extra gather
