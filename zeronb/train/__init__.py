"""Training: a RunConfig in, a report out, on a pool of ranks or under torchrun (`python -m
zeronb.train`), with the one-process reference every stage must match.

    runs.py       RunConfig (what to train) and the reports (what each rank measured)
    stages.py     which Stage a RunConfig builds, on which process groups
    ranks.py      what each rank does: build, train, watch the last step, report
    runner.py     run / run_many: on a pool, under torchrun, or in one process
    reference.py  the one-process run on the whole batch
    parity.py     how far two runs' parameters and gradients are apart
    cli.py        the command line

Below the book and the benchmarks: may import zeronb.zero, the lessons (zeronb.models, .memory,
.ledger, ...), zeronb.pool and zeronb.runtime; nothing imports it but the book and the benchmarks
(and the package's root, which names it for the ranks' helper process to import ahead).
"""
from .parity import grad_diff, max_diff
from .reference import train_single
from .runner import run, run_many
from .runs import RankReport, RunConfig, RunReport

__all__ = ["RunConfig", "RunReport", "RankReport", "run", "run_many", "train_single", "max_diff", "grad_diff"]
