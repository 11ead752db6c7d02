"""The NCCL path, on as many GPUs as the machine has (up to 4; one is enough): a group per device,
CUDA and CPU tensors in one call, the ring on CUDA, every stage and --impl of the train CLI with
torch.cuda's memory figures, SGD and the gradients against one process (DeepSpeed's stages too), the training-in-practice
flags and a checkpoint resumed on another number of ranks, ZeRO-3's prefetch overlapping on the
GPU's own clock, the exercise checkers, a failure and its recovery, and a soak.
Marked `gpu` and skipped where there is no GPU (CI has none). With one GPU, every test runs on a
1-rank NCCL group: what several NCCL ranks do (traffic between GPUs) is for a machine with more.
`bash scripts/gpu_check.sh` runs these, every chapter and the train CLI on a GPU box."""
import importlib.util
import inspect
import json
import os

import psutil
import pytest
import torch
import torch.distributed as dist

import zeronb
from conftest import listening_addresses
from test_faults import _mixed
from zeronb import Cluster, RankError

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
N = min(GPUS, 4)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 1 or not dist.is_nccl_available(),
                                                  reason="needs a CUDA GPU and an NCCL build of torch")]


@pytest.fixture(scope="module")
def pool():
    with Cluster(N, backend="nccl", verbose=False) as c:
        yield c


def _where_am_i():
    import threading

    from zeronb import device
    from zeronb.runtime.backend import backend_for

    t = torch.full((4,), float(dist.get_rank() + 1), device=device())
    dist.all_reduce(t)
    seen = []
    threading.Thread(target=lambda: seen.append(str(device()))).start()  # another thread, same answer
    while not seen:
        pass
    return (dist.get_backend(), backend_for("cpu"), backend_for(t), str(t.device), seen[0],
            torch.cuda.current_device(), t)


def test_auto_picks_nccl_one_gpu_per_rank_with_a_group_per_device(pool):
    assert pool.backend == "nccl" and zeronb.runtime.backend.choose_backend(N)[0] == "nccl"
    for r, (backend, cpu, cuda, dev, dev_other_thread, current, t) in enumerate(pool.run(_where_am_i, echo=False)):
        assert backend == "cpu:gloo,cuda:nccl" and (cpu, cuda) == ("gloo", "nccl")
        assert dev == dev_other_thread == f"cuda:{r}" and current == r
        assert t.device.type == "cpu" and t.tolist() == [N * (N + 1) / 2] * 4  # came back on the CPU


def _both_kinds():
    """Chapter-style code, written once: a count on the CPU and a tensor on the rank's device."""
    from zeronb import device

    count = torch.tensor([1], dtype=torch.int64)              # CPU: goes over gloo
    grad = torch.full((8,), float(dist.get_rank()), device=device())  # the GPU: goes over NCCL
    dist.all_reduce(count)
    dist.all_reduce(grad)
    return count.item(), grad[0].item(), grad.device.type


def test_cpu_and_cuda_tensors_in_one_call(pool):
    assert pool.run(_both_kinds, echo=False) == [(N, N * (N - 1) / 2, "cuda")] * N


def test_every_listener_of_every_rank_is_on_loopback(pool):
    addresses = listening_addresses([os.getpid(), *pool.pids])
    assert addresses and all(a in ("127.0.0.1", "::1") for a in addresses), addresses


def _ring_on_gpu(numel):
    from zeronb import device
    from zeronb.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter
    from zeronb.shards import bounds

    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(device())
    ref = x.clone()
    dist.all_reduce(ref)
    a, b = bounds(numel, n, rank)
    ar, rs = ring_all_reduce(x.clone()), ring_reduce_scatter(x.clone())
    ag = ring_all_gather(ref[a:b].clone(), numel)
    return ((ar - ref).abs().max().item(), (rs - ref[a:b]).abs().max().item(), bool(torch.equal(ag, ref)),
            ar.device.type)


@pytest.mark.parametrize("numel", [5, 1024, 1_000_003])
def test_ring_collectives_on_cuda(pool, numel):
    for ar, rs, ag_ok, dev in pool.run(_ring_on_gpu, numel, echo=False):
        assert ar < 1e-5 and rs < 1e-5 and ag_ok and dev == "cuda"


@pytest.mark.parametrize("stage,impl", [(s, i) for s in range(4) for i in ("zeronb", "torch")])
def test_train_cli_on_cuda_matches_one_process_and_reports_cuda_memory(stage, impl, tmp_path):
    from zeronb.train import max_diff
    from zeronb.train.cli import main

    common = ["--model", "gpt", "--precision", "float64", "--steps", "3"]
    assert main(["--nproc", "1", "--stage", "0", *common, "--report", str(tmp_path / "ref.json"),
                       "--save-params", str(tmp_path / "ref.pt")]) == 0
    assert main(["--nproc", str(N), "--stage", str(stage), "--impl", impl, *common,
                       "--report", str(tmp_path / "r.json"), "--save-params", str(tmp_path / "p.pt")]) == 0
    ref, got = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "p.pt")
    assert max_diff(got, ref) <= 1e-10, (stage, impl)
    for path, ranks in (("ref.json", 1), ("r.json", N)):
        report = json.load(open(tmp_path / path))
        assert [r["device"] for r in report["ranks"]] == [f"cuda:{r}" for r in range(ranks)]
        for r in report["ranks"]:  # the same fields on every path, from torch.cuda's own counters
            assert set(r["bytes"]) == {"params", "grads", "optimizer"} and all(r["bytes"].values())
            assert r["cuda_allocated"] > 0 and r["cuda_peak"] >= r["cuda_allocated"]


@pytest.mark.parametrize("stage,impl", [(s, i) for s in range(4) for i in ("zeronb", "torch")])
def test_sgd_and_the_gradients_on_cuda_match_one_process(stage, impl):
    """Parity that would see a gradient scaled by a constant: plain SGD, and the averaged gradients."""
    from zeronb.train import RunConfig, grad_diff, max_diff, run, train_single

    config = RunConfig(model="gpt", precision="float64", steps=3, optimizer="sgd")
    ref = train_single(config)
    got = run(config.replace(nproc=N, stage=stage, impl=impl))
    assert got.ranks[0].device == "cuda:0"
    assert max_diff(got.params, ref.params) <= 1e-10 and grad_diff(got.ranks, ref.ranks[0]) <= 1e-12


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_on_cuda_matches_one_process_and_holds_what_its_tensors_say(stage):
    """DeepSpeed's stages with its CUDA accelerator on NCCL ranks, no op compiled: SGD's parameters and
    the averaged gradients of one CUDA process (float32: its optimizer keeps float32 partitions), and
    what its tensors hold, inside what torch.cuda's allocator counts."""
    from zeronb.train import RunConfig, grad_diff, max_diff, run, train_single

    config = RunConfig(model="gpt", precision="float32", steps=3, optimizer="sgd")
    ref = train_single(config)
    got = run(config.replace(nproc=N, stage=stage, impl="deepspeed"))
    r = got.ranks[0]
    assert r.device == "cuda:0"
    assert max_diff(got.params, ref.params) <= 1e-5 and grad_diff(got.ranks, ref.ranks[0]) <= 1e-6
    assert r.bytes["params"] == r.expected_bytes["params"] and r.cuda_allocated >= sum(r.bytes.values())


@pytest.mark.parametrize("stage,impl", [(s, i) for s in range(4) for i in ("zeronb", "torch")])
def test_training_in_practice_on_cuda_matches_one_process(stage, impl):
    """Accumulation (both choices), clipping and activation checkpointing on NCCL ranks: the
    parameters of one CUDA process on the whole batch; bf16 reduction costs precision, within 1e-2."""
    from zeronb.train import RunConfig, max_diff, run, train_single

    common = RunConfig(model="gpt", precision="float64", steps=3)
    ref = train_single(common.replace(clip_norm=0.05))
    assert ref.ranks[0].device == "cuda:0"
    for sync in (True, False):
        got = run(common.replace(nproc=N, stage=stage, impl=impl, grad_accum=2, sync_each_micro_batch=sync, clip_norm=0.05,
                                 activation_checkpointing=True))
        assert got.ranks[0].device == "cuda:0"
        assert max_diff(got.params, ref.params) <= 1e-10, (stage, impl, sync)
        assert all(abs(r.grad_norm - ref.ranks[0].grad_norm) <= 1e-12 * r.grad_norm for r in got.ranks)
    plain = train_single(common).params
    f32 = common.replace(precision="float32", nproc=N, stage=stage, impl=impl)
    err = {rd: max_diff(run(f32.replace(reduce_dtype=rd)).params, plain) for rd in ("fp32", "bf16")}
    assert err["fp32"] < 1e-5 and err["bf16"] < 1e-2, err
    if N > 1:  # on one rank there is no sum to round
        assert err["bf16"] > 2 * err["fp32"], err


def _zero3_timeline(prefetch):
    """Inside a rank on a GPU: ZeRO-3 on a GPT, the last of three steps watched by a Timeline - CUDA
    events, no synchronize."""
    import zeronb
    from zeronb.models import Config, local_batch, make_model
    from zeronb.zero.observe import Timeline
    from zeronb.zero import StageConfig, ZeRO3

    cfg = Config(kind="gpt", vocab=4096, d_model=1024, n_head=16, n_layer=4, seq_len=256, global_batch=8 * dist.get_world_size())
    dev = zeronb.device()
    stage = ZeRO3(make_model(cfg, torch.float32, dev), StageConfig(), prefetch=prefetch)
    timeline = Timeline(dev)
    for step in range(3):
        stage.observers = [timeline] if step == 2 else []
        stage.train_step(*local_batch(cfg, step, dist.get_rank(), dist.get_world_size(), device=dev))
    return timeline.spans()


def _overlaps(spans):
    """For each unit u > 0: how long (s) its forward all-gather ran while unit u-1's forward computed."""
    at = {(what, unit): (start, end) for what, unit, start, end in spans}
    units = sorted(u for what, u in at if what == "forward")
    return [min(at["all-gather (forward)", u][1], at["forward", u - 1][1])
            - max(at["all-gather (forward)", u][0], at["forward", u - 1][0]) for u in units[1:]]


def test_zero3_prefetch_overlaps_the_next_gather_with_this_units_computation_on_the_gpu(pool):
    """On the GPU's own clock: with prefetch, forward all-gathers run while the unit before them
    computes (on NCCL's stream, beside the compute stream); without, none does. Not every one: on an
    H100 (one rank, torch 2.11), twice in two runs, the gathers of the first two blocks did not overlap
    the embedding's and the first block's forward (-0.024 and -0.017 ms) while the next three did
    (0.042, 0.042, 0.020 ms), with or without the GPU held back at the step's start. A prefetch that
    issued nothing early would overlap nowhere, as the run without prefetch shows."""
    for with_prefetch, without in zip(pool.run(_zero3_timeline, True, echo=False),
                                      pool.run(_zero3_timeline, False, echo=False)):
        overlap, none = _overlaps(with_prefetch), _overlaps(without)
        print(f"all-gather time hidden under the previous unit's forward: {[f'{o * 1e3:.3f}' for o in overlap]} ms "
              f"with prefetch, {[f'{max(o, 0) * 1e3:.3f}' for o in none]} ms without")
        assert overlap and any(o > 0 for o in overlap), overlap
        assert none and all(o <= 0 for o in none), none


def test_exercise_checkers_on_nccl():
    """Every checker accepts a right solution on NCCL ranks (one per GPU; `also=None`: no second pool,
    which would fall back to gloo here), and one that forgot the all-gather is still told so."""
    from wrong_worlds import solutions
    from zeronb.book import exercises

    try:
        for checker, solution in solutions.RIGHT.items():
            if checker in ("check_hierarchical_all_reduce", "check_hsdp_gradient", "check_zero3_bytes"):
                continue  # two simulated nodes need gloo's paced links; the bytes checker trains on its own pool
            kw = {"also": None} if "also" in inspect.signature(getattr(exercises, checker)).parameters else {}
            verdict = getattr(exercises, checker)(solution, world_size=N, **kw)
            assert verdict.ok, (checker, str(verdict))
        if N > 1:  # on one rank the reduced shard is the whole tensor: nothing is missing
            assert not exercises.check_all_reduce(solutions.all_reduce_forgot_the_gather, world_size=N, also=None).ok
        assert zeronb.current().backend == "nccl"
    finally:
        zeronb.shutdown()


def _fails(how):
    if how == "raise":
        raise ValueError("planned")
    os._exit(3)


def test_a_failure_on_an_nccl_pool_and_the_restart(pool):
    pids = pool.pids
    with pytest.raises(RankError, match="planned"):
        pool.run(_fails, "raise", echo=False)
    assert pool.pids == pids  # every rank raised, none was blocked: no restart
    with pytest.raises(RankError, match="exited with status 3"):
        pool.run(_fails, "exit", echo=False)
    assert pool.run(_both_kinds, echo=False) == [(N, N * (N - 1) / 2, "cuda")] * N  # restarted, on the GPUs
    assert pool.pids != pids


def test_soak_1000_dispatches_with_cuda_memory_stays_flat(pool):
    procs = [psutil.Process(p) for p in pool.pids]
    for i in range(200):  # warm-up: CUDA loads kernels lazily, at their first use
        pool.run(_mixed, i, echo=False)
    rss0 = [p.memory_info().rss for p in procs]
    for i in range(1000):
        res = pool.run(_mixed, i, echo=False)
        assert len(set(res)) == 1
    rss1 = [p.memory_info().rss for p in procs]
    print(f"soak on {N} NCCL rank(s): rank RSS {[r >> 20 for r in rss0]} -> {[r >> 20 for r in rss1]} MiB")
    for a, b in zip(rss0, rss1):
        assert b < 1.10 * a, f"rank memory grew {a >> 20} -> {b >> 20} MiB"


def test_paced_nodes_on_nccl_are_refused_with_what_to_do():
    """A link rate cannot slow NCCL's NVLink/PCIe traffic: asking for one is an error, not a silent lie."""
    with pytest.raises(ValueError, match="backend='gloo'"):
        Cluster(1, backend="nccl", intra_node_bandwidth="10MB/s", verbose=False)
