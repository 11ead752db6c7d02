"""zeronb: the helper package of the zeronb course.

Runs real multi-process torch.distributed code from notebook cells:

    import zeronb
    zeronb.start(world_size=4)            # 4 rank processes, one process group
    res = zeronb.run(fn, *args)           # fn on every rank; res[r] is rank r's return value
    zeronb.shutdown()

or, in IPython/Jupyter, `%load_ext zeronb` and a cell that starts with `%%ranks -n 4`.
Inside a rank, code uses plain torch.distributed; zeronb only launches, counts and draws.

In IPython and Jupyter, importing zeronb also starts the helper process that ranks are forked from
(see zeronb.pool.forkserver), so that its import of torch overlaps with the notebook's own cells.
"""
import sys


def _in_ipython() -> bool:
    ipython = sys.modules.get("IPython")
    return ipython is not None and ipython.get_ipython() is not None


from .pool import forkserver  # noqa: E402  (imports no torch)

# What the ranks run, imported once by the helper process the ranks are forked from. The pool names
# only its own modules; the package's root, which stands above every layer, names the rest.
# (torch._dynamo: what the ledger's first TorchDispatchMode would import in each rank, seconds of CPU.)
forkserver.preload("torch._dynamo", "zeronb.runtime.backend", "zeronb.shards", "zeronb.collectives", "zeronb.ledger",
                   "zeronb.memory", "zeronb.models", "zeronb.zero", "zeronb.zero.observe", "zeronb.train",
                   "zeronb.book.exercises")
if _in_ipython():  # before importing torch here, so that both imports run at once
    forkserver.prestart()

from .runtime.backend import device  # noqa: E402
from .pool.cluster import Cluster, RankResults, current, run, shutdown, start  # noqa: E402
from .pool.errors import RankError, RankTimeout  # noqa: E402

__version__ = "0.1.0"
__all__ = ["Cluster", "RankError", "RankResults", "RankTimeout", "current", "device", "run",
           "shutdown", "start", "load_ipython_extension"]


def load_ipython_extension(ipython):
    """`%load_ext zeronb`: registers the %%ranks cell magic."""
    from .pool.magic import register  # (deferred: IPython, only when the extension is loaded)

    register(ipython)
