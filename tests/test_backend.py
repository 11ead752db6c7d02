"""Backend choice and the torch-version shims, on a real gloo group."""
import pytest
import torch
import torch.distributed as dist

from zeronb import Cluster
from zeronb.runtime import backend


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
    from zeronb.runtime.compat import all_gather_single, reduce_scatter_single

    r, n = dist.get_rank(), dist.get_world_size()
    shard = torch.arange(numel, dtype=torch.float64) + 100 * r
    gathered = torch.empty(numel * n, dtype=torch.float64)
    all_gather_single(gathered, shard)
    full = torch.arange(numel * n, dtype=torch.float64) * (r + 1)
    mine = torch.empty(numel, dtype=torch.float64)
    reduce_scatter_single(mine, full)
    return gathered, mine


def test_version_shims_gather_and_scatter(gloo_pool):
    c = gloo_pool(2)
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

    from zeronb.pool.launch import loopback_store

    store = loopback_store(2, timedelta(seconds=5))
    mine = [c for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port]
    assert [c.laddr.ip for c in mine] == ["127.0.0.1"]


def _written_once():
    """Chapter-style code, written once for either backend: a count on the CPU (gloo in any pool),
    a tensor on the rank's device (NCCL in a GPU pool), and where there is a GPU, one of each."""
    import threading

    import zeronb
    from zeronb.runtime.backend import backend_for

    count = torch.tensor([1], dtype=torch.int64)
    grad = torch.full((8,), float(dist.get_rank()), device=zeronb.device())
    dist.all_reduce(count)
    dist.all_reduce(grad)
    other_thread = []
    t = threading.Thread(target=lambda: other_thread.append(zeronb.device()))
    t.start()
    t.join()
    return {"count": count.item(), "grad": grad[0].item(), "device": str(grad.device),
            "device_in_another_thread": str(other_thread[0]), "backend": str(dist.get_backend()),
            "cpu_takes": backend_for(count), "grad_takes": backend_for(grad)}


@pytest.mark.parametrize("requested", ["auto", "gloo"])
def test_one_function_sends_cpu_and_device_tensors_on_whatever_backend_the_pool_has(requested):
    n = 2
    with Cluster(n, backend=requested, verbose=False) as c:
        res = c.run(_written_once, echo=False)
    for r, out in enumerate(res):
        assert out["count"] == n and out["grad"] == sum(range(n))
        assert out["device"] == out["device_in_another_thread"]
        assert out["cpu_takes"] == "gloo"
        if c.backend == "nccl":
            assert out["backend"] == "cpu:gloo,cuda:nccl" and out["grad_takes"] == "nccl"
            assert out["device"] == f"cuda:{r}"
        else:
            assert out["backend"] == "gloo" and out["grad_takes"] == "gloo" and out["device"] == "cpu"


def test_an_nccl_pool_is_a_group_per_device():
    assert backend.group_backend("nccl") == "cpu:gloo,cuda:nccl"
    assert backend.group_backend("gloo") == "gloo"
