"""`python -m zeronb doctor`: what this machine offers zeronb, and a smoke all-reduce on 2 ranks."""
import argparse
import importlib.metadata
import platform
import sys
import time


def _smoke() -> float:
    """Start 2 ranks, all-reduce once, return the warm all-reduce time in ms (and check the sum)."""
    import torch
    import torch.distributed as dist

    from .pool.cluster import Cluster  # (deferred, as torch: `python -m zeronb --help` starts at once)

    def allreduce():
        from zeronb import device  # (inside: this function is pickled by value and runs on a rank)

        t = torch.full((1024,), float(dist.get_rank() + 1), device=device())
        dist.all_reduce(t)  # warm-up: the first collective sets up connections
        t0 = time.perf_counter()
        dist.all_reduce(t)
        if t.device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3, t[0].item()

    with Cluster(2) as c:
        res = c.run(allreduce)
    # (1+2) after the first all-reduce, then 2*(1+2) after the second
    assert all(v == 6.0 for _, v in res), f"all-reduce gave {[v for _, v in res]}, expected 6.0"
    return max(ms for ms, _ in res)


def doctor() -> int:
    import torch
    import torch.distributed as dist

    from .runtime.backend import choose_backend, cuda_device_count  # (deferred, as torch)

    print(f"python      {sys.version.split()[0]} ({platform.platform()})")
    print(f"torch       {torch.__version__}")
    try:  # (the version from its metadata: importing deepspeed takes seconds and picks an accelerator)
        print(f"deepspeed   {importlib.metadata.version('deepspeed')} (impl 'deepspeed': no compiled op is used)")
    except importlib.metadata.PackageNotFoundError:
        print("deepspeed   not installed (impl 'deepspeed' is unavailable; scripts/setup.sh installs it)")
    avail = [name for name, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                   ("mpi", dist.is_mpi_available())) if ok]
    print(f"backends    {', '.join(avail) or 'none'}")
    gpus = cuda_device_count()
    print(f"devices     {gpus} CUDA GPU(s)" + "".join(f"\n            cuda:{i} {torch.cuda.get_device_name(i)}"
                                                     for i in range(gpus)))
    for n in (2, 4):
        print(f"auto, {n} ranks: {choose_backend(n)[1]}")
    try:
        ms = _smoke()
    except Exception as e:
        print(f"smoke test  FAILED: {type(e).__name__}: {e}")
        return 1
    print(f"smoke test  all-reduce of 4 KiB on 2 ranks: correct, {ms:.2f} ms")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zeronb")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="versions, backends, devices, and a smoke all-reduce on 2 ranks")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor()
    return 2


if __name__ == "__main__":
    sys.exit(main())
