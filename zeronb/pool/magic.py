"""The %%ranks cell magic: run a notebook cell's code on every rank.

    %load_ext zeronb
    %%ranks -n 4
    import torch.distributed as dist
    print(dist.get_rank())

Each rank keeps its own namespace between %%ranks cells (variables defined in one cell are there in
the next), like a kernel per rank. The last line's value, if any, comes back as a list per rank
(`%%ranks -o NAME` stores that list in the notebook variable NAME instead of showing it).
"""
import argparse
import linecache
import shlex

from . import cluster
from .cluster import start

_parser = argparse.ArgumentParser(prog="%%ranks", add_help=False)
_parser.add_argument("-n", "--nproc", type=int, default=None, help="number of ranks (default: the running pool's)")
_parser.add_argument("-b", "--backend", default="auto", choices=["auto", "gloo", "nccl"])
_parser.add_argument("-t", "--timeout", type=float, default=None, help="seconds before RankTimeout")
_parser.add_argument("--live", action="store_true", help="stream output as it comes")
_parser.add_argument("-o", "--output", metavar="NAME", default=None,
                     help="store the per-rank values of the last line in the notebook variable NAME")


def ranks(line, cell):
    from IPython import get_ipython

    try:
        opts = _parser.parse_args(shlex.split(line))
    except SystemExit:
        raise ValueError(f"%%ranks: cannot parse options {line!r}; use: %%ranks [-n N] [-b gloo|nccl] "
                         "[-t SECONDS] [--live] [-o NAME]") from None
    if opts.nproc is None:
        pool = cluster._default if cluster._default is not None and not cluster._default.closed else None
        pool = pool or start(2, opts.backend)
    else:
        pool = start(opts.nproc, opts.backend)
    # Name the code after the cell, and keep its source here: the ranks' tracebacks then show the
    # cell's lines, as IPython does for the notebook's own code.
    ip = get_ipython()
    count = getattr(ip, "execution_count", 0) if ip is not None else 0
    filename = f"<%%ranks In[{count}]>"
    lines = cell.splitlines(keepends=True)
    linecache.cache[filename] = (len(cell), None, lines, filename)
    res = pool.run_cell(cell, filename, timeout=opts.timeout, live=opts.live)
    if opts.output:
        if not opts.output.isidentifier():
            raise ValueError(f"%%ranks -o needs a variable name, not {opts.output!r}")
        ip.user_ns[opts.output] = res
        return None
    return res if any(v is not None for v in res) else None


def register(ipython):
    ipython.register_magic_function(ranks, magic_kind="cell", magic_name="ranks")
