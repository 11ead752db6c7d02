"""The pool: rank processes that a notebook starts once and calls again and again.

    cluster.py      Cluster, start, run: the pool a notebook holds
    launch.py       starting the ranks: rendezvous on loopback, their environment, the handshake
    forkserver.py   ranks forked from a helper process that imported torch once
    _worker.py      what a rank runs: join the group, then call what the notebook sends
    calls.py        waiting for a call, with a timeout
    messages.py     what the notebook and a rank say to each other
    rank_output.py  the ranks' printed output, grouped
    errors.py       how a failure on the ranks is shown
    magic.py        %%ranks

May import zeronb.runtime only: the pool knows nothing of what the ranks are taught.
"""
