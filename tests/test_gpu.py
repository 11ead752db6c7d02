"""The NCCL path: one GPU per rank, CUDA tensors, results back on the CPU, memory from torch.cuda.
Marked `gpu` and skipped where there are fewer than two GPUs (CI has none)."""
import pytest
import torch
import torch.distributed as dist

from zeronb import Cluster

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 2 or not dist.is_nccl_available(),
                                                  reason="needs 2 CUDA GPUs and an NCCL build of torch")]


def _where_am_i():
    from zeronb import device

    t = torch.full((4,), float(dist.get_rank() + 1), device=device())
    dist.all_reduce(t)
    return dist.get_backend(), str(t.device), torch.cuda.current_device(), t


def test_auto_picks_nccl_one_gpu_per_rank_and_results_come_back_on_cpu():
    with Cluster(2, verbose=False) as c:
        assert c.backend == "nccl"
        res = c.run(_where_am_i, echo=False)
    for r, (backend, dev, current, t) in enumerate(res):
        assert backend == "nccl" and dev == f"cuda:{r}" and current == r
        assert t.device.type == "cpu" and t.tolist() == [3.0] * 4


def _ring_on_gpu(numel):
    from zeronb import device
    from zeronb.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter
    from zeronb.shards import bounds

    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(numel, generator=g).to(device())
    ref = x.clone()
    dist.all_reduce(ref)
    a, b = bounds(numel, n, rank)
    ar = ring_all_reduce(x.clone())
    rs = ring_reduce_scatter(x)
    ag = ring_all_gather(x[a:b].clone(), numel)
    torch.cuda.synchronize()
    return ((ar - ref).abs().max().item(), (rs - ref[a:b]).abs().max().item(),
            bool(torch.equal(ag[a:b], x[a:b])), ag.device.type)


@pytest.mark.parametrize("numel", [5, 1024, 1_000_003])
def test_ring_collectives_on_nccl(numel):
    with Cluster(2, verbose=False) as c:
        res = c.run(_ring_on_gpu, numel, echo=False)
    for ar, rs, ag_ok, dev in res:
        assert ar < 1e-5 and rs < 1e-5 and ag_ok and dev == "cpu"  # came back to the notebook on CPU


def test_zero_stages_on_nccl_match_single_process_and_measure_cuda_memory():
    from zeronb.train import parse_args, train_rank, train_single

    ref = train_single(parse_args(["--model", "gpt", "--dtype", "float64", "--steps", "3"]))["params"]

    def all_stages():
        return [train_rank(parse_args(["--model", "gpt", "--dtype", "float64", "--steps", "3", "--stage", str(s)]))
                for s in range(4)]

    with Cluster(2, verbose=False) as c:
        res = c.run(all_stages, echo=False, timeout=600)
    for stage, rep in enumerate(res[0]):
        err = max((rep["params"][k].cpu() - ref[k]).abs().max().item() for k in ref)
        assert err <= 1e-10, (stage, err)
        assert rep["allocated"] > 0 and rep["peak"] >= rep["allocated"]  # torch.cuda's own figures
