"""Backend choice and the torch-version shims, on a real gloo group."""
import pytest
import torch
import torch.distributed as dist

from zeronb import Cluster, backend


def test_auto_picks_gloo_without_enough_gpus():
    gpus = backend.cuda_device_count()
    name, why = backend.choose_backend(gpus + 1, "auto")
    assert name == "gloo" and "gloo" in why


def test_auto_picks_nccl_with_one_gpu_per_rank():
    if backend.cuda_device_count() < 1 or not dist.is_nccl_available():
        pytest.skip("needs a GPU and an NCCL build of torch")
    assert backend.choose_backend(1, "auto")[0] == "nccl"


def test_rank_device():
    assert backend.rank_device("gloo", 3) == torch.device("cpu")
    assert backend.rank_device("nccl", 3) == torch.device("cuda", 3)


def _single_collectives(numel):
    from zeronb.backend import all_gather_single, reduce_scatter_single

    r, n = dist.get_rank(), dist.get_world_size()
    shard = torch.arange(numel, dtype=torch.float64) + 100 * r
    gathered = torch.empty(numel * n, dtype=torch.float64)
    all_gather_single(gathered, shard)
    full = torch.arange(numel * n, dtype=torch.float64) * (r + 1)
    mine = torch.empty(numel, dtype=torch.float64)
    reduce_scatter_single(mine, full)
    return gathered, mine


def test_version_shims_gather_and_scatter():
    with Cluster(2, backend="gloo", verbose=False) as c:
        res = c.run(_single_collectives, 3, echo=False)
    n, numel = 2, 3
    want_gathered = torch.cat([torch.arange(numel, dtype=torch.float64) + 100 * r for r in range(n)])
    total = sum(r + 1 for r in range(n))
    for r, (gathered, mine) in enumerate(res):
        assert torch.equal(gathered, want_gathered)
        assert torch.equal(mine, torch.arange(r * numel, (r + 1) * numel, dtype=torch.float64) * total)


def test_the_store_listens_on_loopback_only():
    from datetime import timedelta

    import psutil

    store = backend.loopback_store(2, timedelta(seconds=5))
    mine = [c for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port]
    assert [c.laddr.ip for c in mine] == ["127.0.0.1"]
