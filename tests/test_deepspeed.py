"""DeepSpeed's own ZeRO stages 1-3 (impl "deepspeed") on the pool's gloo ranks, against one process
on the whole batch: parameters after SGD and Adam, the averaged gradients its optimizer steps with,
what its own tensors hold against the ZeRO formula, the collectives it runs; training in practice;
what it refuses; and the CLI, on the pool and under torchrun."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from zeronb.ledger import ring_bytes
from zeronb.train import RunConfig, grad_diff, max_diff, run_many, train_single
from zeronb.zero.deepspeed_engine import ELEMENTS_PER_BUCKET, check_runs_here, deepspeed_config

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")

STEPS = 3
COMBOS = [(s, o) for s in (1, 2, 3) for o in ("sgd", "adam")]
SMALL = 16  # bytes: the scalars kept or summed besides (DeepSpeed's gradient norm, Adam's step counter)


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(optimizer, **kw):
        key = (optimizer, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = train_single(RunConfig(model="gpt", optimizer=optimizer, steps=STEPS, **kw))
        return cache[key]
    return get


@pytest.fixture(scope="module")
def ds_runs(gloo_pool):
    cache = {}

    def get(n):
        if n not in cache:
            configs = [RunConfig(model="gpt", stage=s, optimizer=o, impl="deepspeed", steps=STEPS) for s, o in COMBOS]
            cache[n] = dict(zip(COMBOS, run_many(configs, gloo_pool(n))))
        return cache[n]
    return get


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: f"stage{c[0]}-{c[1]}")
def test_deepspeed_equals_one_process_in_parameters_and_gradients(ds_runs, reference, n, combo):
    stage, optimizer = combo
    got, ref = ds_runs(n)[combo], reference(optimizer)
    assert got.ranks[0].steps_taken == STEPS
    assert max_diff(got.params, ref.params) <= 1e-5
    assert grad_diff(got.ranks, ref.ranks[0]) <= 1e-6  # (SGD's parameters and these would see a scaled gradient)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: f"stage{c[0]}-{c[1]}")
def test_what_deepspeeds_tensors_hold_against_the_formula(ds_runs, n, combo):
    """Read from its own tensors: the parameters as the formula says; its optimizer's fp32 partition
    (a copy, even in float32: stage_1_and_2.py clones it .to(master_weights_and_grads_dtype), float32
    by default) on top of the optimizer
    state; between steps stages 1-2 keep no gradient (freed after the step), stage 3 its flat
    gradient partition and one reduce bucket."""
    stage, _ = combo
    for r in ds_runs(n)[combo].ranks:
        held, formula, psi = r.bytes, r.expected_bytes, r.num_params
        partition = 4 * psi // n  # (the GPT's 29,888 elements split evenly: no padding at 2 or 4 ranks)
        assert held["params"] == formula["params"]
        assert 0 <= held["optimizer"] - (formula["optimizer"] + partition) <= SMALL  # (+ Adam's step counter)
        if stage < 3:
            assert held["grads"] <= SMALL
        else:
            assert 0 <= held["grads"] - (formula["grads"] + 4 * ELEMENTS_PER_BUCKET) <= SMALL


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_collectives_deepspeed_runs(ds_runs, n, stage):
    """Stages 1 and 2 all-reduce the whole gradient (each rank keeps its part), not the reduce-scatter
    of the paper; stage 3 gathers every parameter twice (forward, backward) and reduce-scatters the
    gradients once. Credited by the ledger; the wire as the OS counts it is there too."""
    r = ds_runs(n)[stage, "sgd"].ranks[0]
    psi_b = 4 * r.num_params
    sent = r.sent_bytes_per_step
    if stage < 3:
        assert "reduce_scatter" not in sent
        assert 0 <= sent["all_reduce"] - ring_bytes("all_reduce", psi_b, n) <= ring_bytes("all_reduce", SMALL, n)
        assert sent["all_gather"] == ring_bytes("all_gather", psi_b, n)
        assert r.calls_per_step["all_gather"] == 1  # the whole flat buffer at once (allgather_bucket_size: no effect)
    else:
        assert sent["all_gather"] == 2 * ring_bytes("all_gather", psi_b, n)
        assert sent["reduce_scatter"] == ring_bytes("reduce_scatter", psi_b, n)
        assert sent.get("all_reduce", 0) <= ring_bytes("all_reduce", 2 * SMALL, n)  # (a few scalars: norms, flags)
    assert r.wire_bytes_per_step >= sum(sent.values())


def test_training_in_practice_with_deepspeed(gloo_pool, reference):
    """Accumulation over 2 micro-batches (its own schedule: stage 1 reduces after the last, 2 and 3
    after each), clipping to a norm, and bf16 with its fp32 master, on 4 ranks."""
    pool = gloo_pool(4)
    common = dict(model="gpt", steps=STEPS, optimizer="sgd", impl="deepspeed")
    configs = [RunConfig(stage=s, grad_accum=2, sync_each_micro_batch=s != 1, clip_norm=0.05, **common) for s in (1, 2, 3)]
    configs += [RunConfig(stage=s, precision="bf16-mixed", **common) for s in (1, 2, 3)]
    reports = run_many(configs, pool)
    clipped, mixed = reference("sgd", clip_norm=0.05), reference("sgd", precision="bf16-mixed")
    for config, got in zip(configs, reports):
        if config.clip_norm:
            assert max_diff(got.params, clipped.params) <= 1e-5, config.stage
            assert all(abs(r.grad_norm - clipped.ranks[0].grad_norm) <= 1e-5 * r.grad_norm for r in got.ranks)
        else:  # bf16 parameters, and the formula's 2 + 2 + K: its fp32 partition is the master the formula counts
            assert max_diff(got.params, mixed.params) <= 1e-2, config.stage
            r = got.ranks[0]
            assert r.bytes["params"] == r.expected_bytes["params"]
            assert 0 <= r.bytes["optimizer"] - r.expected_bytes["optimizer"] <= SMALL
    once, every = (reports[0].ranks[0].calls_per_step, reports[1].ranks[0].calls_per_step)
    assert once["all_reduce"] < every["all_reduce"]  # stage 1 reduces once per step, stage 2 per micro-batch


@pytest.mark.parametrize("changes,words", [
    (dict(stage=0), "stages 1, 2 and 3"),
    (dict(precision="float64"), "float32"),
    (dict(checkpoint="/tmp/x"), "save_checkpoint"),
    (dict(quantize_weights="int8", stage=3), "qwZ"),
    (dict(shard_size=2, nproc=4), "MiCS"),
    (dict(stage=1, grad_accum=2), "sync_each_micro_batch=False"),
    (dict(deepspeed_overrides={"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}), "DeepSpeedCPUAdam"),
    (dict(deepspeed_overrides={"optimizer": {"type": "Adam"}}), "compiled"),
    (dict(stage=3, deepspeed_overrides={"zero_optimization": {"zero_quantized_gradients": True}}), "qgZ"),
])
def test_deepspeed_refuses_what_it_cannot_run_here_saying_why(changes, words):
    with pytest.raises(ValueError, match=words):
        RunConfig(impl="deepspeed", **{"stage": 2, **changes})


def test_the_config_is_zeronbs_settings_under_deepspeeds_names():
    c = deepspeed_config(3, 4, 16, micro_batches=2, clip_norm=1.0, reduce_dtype="bf16", prefetch=True,
                         precision="bf16-mixed", overrides={"zero_optimization": {"overlap_comm": True}})
    z = c["zero_optimization"]
    assert (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"], c["train_batch_size"]) == (2, 2, 16)
    assert c["gradient_clipping"] == 1.0 and c["communication_data_type"] == "bf16" and c["bf16"] == {"enabled": True}
    assert z["stage3_prefetch_bucket_size"] == z["reduce_bucket_size"] == ELEMENTS_PER_BUCKET
    assert z["stage3_param_persistence_threshold"] == 0 and z["overlap_comm"] is True  # (the override laid over)
    check_runs_here(c)


def _cli(*argv, **kw):
    return subprocess.run([sys.executable, "-m", "zeronb.train", *argv], capture_output=True, text=True, timeout=300, **kw)


def test_the_cli_runs_deepspeed_and_equals_one_process(tmp_path):
    """The issue's own check, on stage 2 with SGD (every stage and optimizer: the tests above)."""
    common = ["--model", "gpt", "--optimizer", "sgd", "--steps", "3"]
    ref = _cli("--nproc", "1", "--stage", "0", *common, "--save-params", str(tmp_path / "ref.pt"))
    got = _cli("--impl", "deepspeed", "--stage", "2", "--nproc", "4", *common, "--save-params", str(tmp_path / "ds.pt"),
               "--report", str(tmp_path / "r.json"))
    assert ref.returncode == 0 and got.returncode == 0, ref.stderr[-2000:] + got.stderr[-2000:]
    assert max_diff(torch.load(tmp_path / "ds.pt"), torch.load(tmp_path / "ref.pt")) <= 1e-5
    ranks = json.load(open(tmp_path / "r.json"))["ranks"]
    assert len(ranks) == 4 and all(r["bytes"]["params"] > 0 and r["bytes"]["optimizer"] > 0 for r in ranks)
    bad = _cli("--impl", "deepspeed", "--stage", "0", "--nproc", "2")
    assert bad.returncode != 0 and "stages 1, 2 and 3" in bad.stderr


def test_deepspeed_under_torchrun_equals_the_pool(tmp_path):
    from test_torchrun import TORCHRUN

    if TORCHRUN is None:
        pytest.skip("torchrun not found")
    common = ["--impl", "deepspeed", "--stage", "3", "--model", "gpt", "--optimizer", "adam", "--steps", "3"]
    pool = _cli("--nproc", "2", *common, "--save-params", str(tmp_path / "pool.pt"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    tr = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "-m", "zeronb.train",
                         *common, "--save-params", str(tmp_path / "tr.pt")], capture_output=True, text=True, timeout=300,
                        env=env)
    assert pool.returncode == 0 and tr.returncode == 0, pool.stderr[-2000:] + tr.stdout[-3000:] + tr.stderr[-3000:]
    assert max_diff(torch.load(tmp_path / "pool.pt"), torch.load(tmp_path / "tr.pt")) <= 1e-7


def test_deepspeeds_hpz_gathers_for_backward_within_the_node(reference):
    """ZeRO++'s hpZ (zero_hpz_partition_size = ranks per node) runs on gloo: the same training, and
    the backward all-gathers on the node's 2 ranks instead of all 4 (credited by the ledger)."""
    from zeronb import Cluster

    config = RunConfig(model="gpt", steps=STEPS, optimizer="sgd", impl="deepspeed", stage=3, nproc=4, nodes=2)
    with Cluster(4, nodes=2, backend="gloo", verbose=False) as pool:
        plain, hpz = run_many([config, config.replace(hpz=True)], pool)
    assert config.replace(hpz=True).deepspeed_config(4)["zero_optimization"]["zero_hpz_partition_size"] == 2
    psi_b = 4 * plain.ranks[0].num_params
    for got in (plain, hpz):
        assert max_diff(got.params, reference("sgd").params) <= 1e-5
    assert plain.ranks[0].sent_bytes_per_step["all_gather"] == 2 * ring_bytes("all_gather", psi_b, 4)
    assert hpz.ranks[0].sent_bytes_per_step["all_gather"] == ring_bytes("all_gather", psi_b, 4) + ring_bytes(
        "all_gather", psi_b, 2)


def _clipping_deepspeed_reads(clip_norm):
    """What DeepSpeed's engine, built from zeronb's config, clips to (run on a rank)."""
    import torch.distributed as dist

    from zeronb import device
    from zeronb.models import Config, make_model
    from zeronb.zero import StageConfig
    from zeronb.zero.deepspeed_engine import DeepSpeedStage

    n = dist.get_world_size()
    stage = DeepSpeedStage(make_model(Config(kind="mlp"), torch.float32, device()), 2, StageConfig(clip_norm=clip_norm),
                           deepspeed_config(2, n, 16, clip_norm=clip_norm))
    try:
        return stage.engine.gradient_clipping()
    finally:
        stage.close()


def test_deepspeed_clips_only_when_asked(gloo_pool):
    """DeepSpeed clips to 1.0 by default: zeronb's config says 0 (none) unless clip_norm is set."""
    pool = gloo_pool(2)
    assert pool.run(_clipping_deepspeed_reads, None, echo=False) == [0.0, 0.0]
    assert pool.run(_clipping_deepspeed_reads, 0.05, echo=False) == [0.05, 0.05]
