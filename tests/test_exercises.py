"""The exercise checkers accept a right answer and say precisely what is wrong with a wrong one."""
import pytest
import torch
import torch.distributed as dist

import zeronb
from zeronb import exercises


@pytest.fixture(scope="module", autouse=True)
def pool():
    zeronb.start(4, backend="gloo", verbose=False)
    yield
    zeronb.shutdown()


def good_all_reduce(t):
    from zeronb.backend import all_gather_single, reduce_scatter_single

    shard = t.new_empty(t.numel() // dist.get_world_size())
    reduce_scatter_single(shard, t)
    out = torch.empty_like(t)
    all_gather_single(out, shard)
    return out


def forgot_the_gather(t):  # returns the reduced shard in place of the whole tensor
    from zeronb.backend import reduce_scatter_single

    out = t.clone()
    shard = t.new_empty(t.numel() // dist.get_world_size())
    reduce_scatter_single(shard, t)
    n = shard.numel()
    out[dist.get_rank() * n:(dist.get_rank() + 1) * n] = shard
    return out


def test_all_reduce_checker():
    assert exercises.check_all_reduce(good_all_reduce).ok
    v = exercises.check_all_reduce(forgot_the_gather)
    assert not v.ok
    text = str(v)
    assert "rank 0, chunk 1" in text and "expected" in text


def ring_all_gather(shard, numel):
    r, n = dist.get_rank(), dist.get_world_size()
    c = numel // n
    out = shard.new_empty(numel)  # the shard's dtype and device: the same code on gloo and NCCL
    out[r * c:(r + 1) * c] = shard
    for s in range(n - 1):
        send_c, recv_c = (r - s) % n, (r - s - 1) % n
        ops = [dist.P2POp(dist.isend, out[send_c * c:(send_c + 1) * c], (r + 1) % n),
               dist.P2POp(dist.irecv, out[recv_c * c:(recv_c + 1) * c], (r - 1) % n)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    return out


def gather_with_the_collective(shard, numel):  # right result, but not a ring of sends
    from zeronb.backend import all_gather_single

    out = shard.new_empty(numel)
    all_gather_single(out, shard)
    return out


def send_first(shard, numel):  # the deadlock of chapter 4
    r, n = dist.get_rank(), dist.get_world_size()
    dist.send(shard, (r + 1) % n)
    dist.recv(shard, (r - 1) % n)
    return shard


def test_ring_all_gather_checker():
    assert exercises.check_ring_all_gather(ring_all_gather).ok
    v = exercises.check_ring_all_gather(gather_with_the_collective, sizes=(8,))
    assert not v.ok and "called all_gather" in str(v)

    def whole_tensor_each_step(shard, numel):  # right result, (N-1) x the whole tensor sent
        r, n = dist.get_rank(), dist.get_world_size()
        out = ring_all_gather(shard, numel)
        for s in range(n - 1):
            ops = [dist.P2POp(dist.isend, out.clone(), (r + 1) % n), dist.P2POp(dist.irecv, torch.empty(numel), (r - 1) % n)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        return out

    v = exercises.check_ring_all_gather(whole_tensor_each_step, sizes=(8,))
    assert not v.ok and "sent 120 bytes; a ring sends (N-1) chunks = 24 bytes" in str(v)
    v = exercises.check_ring_all_gather(send_first, sizes=(8,))
    assert not v.ok and "deadlock" in str(v)


def zero1_step(params, grads, lr):
    from zeronb.backend import all_gather_single, reduce_scatter_single

    n, r = dist.get_world_size(), dist.get_rank()
    shard = params.new_empty(params.numel() // n)
    reduce_scatter_single(shard, grads)
    shard /= n
    c = shard.numel()
    mine = params[r * c:(r + 1) * c] - lr * shard
    all_gather_single(params, mine)
    return params


def zero1_no_average(params, grads, lr):
    from zeronb.backend import all_gather_single, reduce_scatter_single

    n, r = dist.get_world_size(), dist.get_rank()
    shard = params.new_empty(params.numel() // n)
    reduce_scatter_single(shard, grads)
    c = shard.numel()
    all_gather_single(params, params[r * c:(r + 1) * c] - lr * shard)
    return params


def test_zero1_checker():
    assert exercises.check_zero1_step(zero1_step).ok
    v = exercises.check_zero1_step(zero1_no_average)
    assert not v.ok and "chunk" in str(v) and "expected" in str(v)


def test_zero3_bytes_checker():
    def right(units, n, b):
        per = [(n - 1) * -(-u // n) * b for u in units]
        return 3 * sum(per) - per[-1]

    def naive(units, n, b):
        return 3 * (n - 1) * sum(units) * b // n

    assert exercises.check_zero3_bytes(right).ok
    v = exercises.check_zero3_bytes(naive)
    assert not v.ok and "ledger counted" in str(v)
