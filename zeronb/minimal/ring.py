"""The ring collectives by hand: reduce-scatter, all-gather and all-reduce from sends and receives.

The N ranks stand in a circle; each sends only to the next rank and receives only from the
previous one. The tensor is cut into N equal chunks, and one step moves one chunk along every
link at once.

- reduce-scatter, N-1 steps: at step s rank r sends chunk (r-s-1) mod N and adds what arrives to
  its own chunk (r-s-2) mod N. Each chunk travels round the circle collecting one term per rank,
  and ends complete on its owner: rank r holds the sum of chunk r.
- all-gather, N-1 steps: at step s rank r sends chunk (r-s) mod N - its own first, then the one it
  has just received - and receives chunk (r-s-1) mod N in place.
- all-reduce = reduce-scatter + all-gather: 2(N-1) steps, and each rank sends 2(N-1)/N of the
  tensor, whatever N.

The full version (zeronb.collectives.ring) runs the same steps, cut into segments and pipelined,
on tensors of any size, and can be traced (chapter 4).
"""
import torch
import torch.distributed as dist


def _exchange(send: torch.Tensor, recv: torch.Tensor) -> None:
    """One step: send to the next rank and receive from the previous one, posted together. (A
    rank that sent first and received after would wait for its neighbour to receive, who waits
    for its own neighbour, all round the circle: a deadlock.)"""
    rank, n = dist.get_rank(), dist.get_world_size()
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, (rank + 1) % n),
                                        dist.P2POp(dist.irecv, recv, (rank - 1) % n)]):
        work.wait()


def _chunks(tensor: torch.Tensor) -> list:
    n = dist.get_world_size()
    if tensor.numel() % n:
        raise ValueError(f"a ring cuts the tensor into {n} equal chunks: pad its {tensor.numel()} elements "
                         f"to a multiple of {n} (zeronb.shards.padded_numel)")
    return list(tensor.view(-1).chunk(n))  # views: writing a chunk writes the tensor


def reduce_scatter(tensor: torch.Tensor) -> torch.Tensor:
    """In place: this rank's chunk of `tensor` becomes the sum over the ranks; returns that chunk
    (the other chunks are left holding partial sums)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = _chunks(tensor)
    incoming = torch.empty_like(chunks[0])
    for s in range(n - 1):
        _exchange(chunks[(rank - s - 1) % n], incoming)
        chunks[(rank - s - 2) % n] += incoming  # add our own term to the partial sum that arrived
    return chunks[rank]


def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """In place: every chunk of `tensor` becomes its owner's (rank r's chunk r); returns `tensor`."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = _chunks(tensor)
    for s in range(n - 1):
        _exchange(chunks[(rank - s) % n], chunks[(rank - s - 1) % n])  # received in place
    return tensor


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """In place: `tensor` becomes the sum over the ranks; returns it."""
    reduce_scatter(tensor)
    return all_gather(tensor)
