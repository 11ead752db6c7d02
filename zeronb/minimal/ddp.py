"""DDP, the minimal version: bucketed gradient all-reduce, overlapped with backward.

Every rank holds the whole model and runs forward and backward on its own slice of the batch, so
its gradients differ from the other ranks'. All-reducing them and dividing by N gives every rank
the gradient of the whole batch; every rank then takes the same optimizer step, and the replicas
stay identical.

Instead of one all-reduce per parameter after backward, the parameters are grouped into buckets of
about `bucket_bytes`, in backward order (the last layer's gradients land first). Each bucket keeps
its gradients in one flat buffer, and each parameter's `.grad` is a view into it, so autograd adds
every gradient straight into the buffer. The moment a bucket's last gradient has landed, its
all-reduce starts - asynchronously - while backward goes on with earlier layers; `step()` waits for
them all before the optimizer runs.

The full version (zeronb.zero.ddp.DDP) pads each bucket to a multiple of N, accumulates gradients
over micro-batches, can reduce in another dtype and average over replicas, and lets observers watch
(chapter 7).
"""
import torch
import torch.distributed as dist


class Bucket:
    """Some parameters whose gradients are all-reduced together, from one flat buffer."""

    def __init__(self, params: list):
        self.params = params
        first = params[0]
        self.grad = torch.zeros(sum(p.numel() for p in params), dtype=first.dtype, device=first.device)
        offset = 0
        for p in params:  # each .grad a view into the buffer: autograd accumulates into it
            p.grad = self.grad[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.landed = 0    # gradients that have landed in this backward
        self.work = None   # its all-reduce, while in flight


def backward_order_buckets(params: list, bucket_bytes: int) -> list:
    """Groups of about `bucket_bytes`, the last parameters first (their gradients land first);
    within a group, the model's order."""
    groups, current, size = [], [], 0
    for p in reversed(params):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return [list(reversed(g)) for g in groups]


class DDP:
    def __init__(self, model: torch.nn.Module, optimizer, bucket_bytes: int = 64 << 10):
        self.world_size = dist.get_world_size()
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = [Bucket(group) for group in backward_order_buckets(params, bucket_bytes)]
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(lambda p, b=b: self._gradient_landed(b))
        self.optimizer = optimizer(params)

    def _gradient_landed(self, b: Bucket) -> None:
        b.landed += 1
        if b.landed == len(b.params):  # the bucket's last gradient: send it while backward goes on
            if b.work is not None:
                raise RuntimeError("a second backward before step(): this DDP does not accumulate gradients")
            b.grad.div_(self.world_size)  # the sum of every rank's g/N is the average
            b.work, b.landed = dist.all_reduce(b.grad, async_op=True), 0

    def step(self) -> None:
        """After backward: wait for every bucket's all-reduce, then the optimizer step."""
        for b in self.buckets:
            if b.work is None:  # (a parameter that forward did not use never gets a gradient)
                raise RuntimeError("a bucket was never sent: every parameter needs a gradient in every backward")
            b.work.wait()
            b.work = None
        self.optimizer.step()
        for b in self.buckets:
            b.grad.zero_()  # (not optimizer.zero_grad(), which would cut the .grad views loose)
