"""`python -m zeronb.bench dispatch | collectives | zero | nodes`."""
import argparse
import os
import sys

from ..models import MODELS
from ..precision import PRECISIONS
from ..runtime.topology import parse_rate
from .collectives import SIZES, collectives, print_collectives
from .dispatch import dispatch, print_dispatch
from .nodes import nodes, print_nodes
from .stages import IMPLS, print_zero, zero


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zeronb.bench", description=__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("dispatch", help="pool start and restart, dispatch latency, and spawn / torchrun per call")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--calls", type=int, default=300, help="warm calls per world size")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every measurement, interleaved")
    p.add_argument("--no-baselines", action="store_true", help="skip mp.spawn and torchrun (slow)")
    p = sub.add_parser("collectives", help="all-reduce / reduce-scatter / all-gather: ring vs naive vs torch")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="bytes")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--segment-bytes", type=int, default=None)
    p.add_argument("--json", default=None, help="also write the results to this file")
    p = sub.add_parser("zero", help="step time, bytes sent and memory per ZeRO stage, both models; and what "
                                    "accumulation and bf16 reduction change, per stage")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--precision", "--dtype", default="float32", choices=list(PRECISIONS))
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches of the accumulation variants")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS,
                   help="implementations to run side by side (the variants are zeronb's)")
    p = sub.add_parser("nodes", help="2 nodes x 2 ranks, paced links: flat ring, hierarchical and gloo all-reduce "
                                     "at several link ratios against the alpha-beta model; the stages' bytes across nodes")
    p.add_argument("--ratios", type=float, nargs="+", default=[1, 4, 10, 16], help="intra-node rate / inter-node rate")
    p.add_argument("--sizes", type=int, nargs="+", default=[4 << 20, 64 << 20], help="bytes")
    p.add_argument("--intra-node-bandwidth", default="100MB/s")
    p.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    if args.what == "nodes":
        print_nodes(nodes(tuple(args.ratios), tuple(args.sizes), parse_rate(args.intra_node_bandwidth), args.reps))
    if args.what == "zero":
        print_zero(zero(args.world_size, models=tuple(args.models), rounds=args.rounds, steps=args.steps,
                         precision=args.precision, accum=args.grad_accum,
                         impls=tuple(args.impls)), args.world_size, args.precision)
    if args.what == "collectives":
        result = collectives(tuple(args.world_sizes), tuple(args.sizes), reps=args.reps,
                             segment_bytes=args.segment_bytes)
        print_collectives(result)
        if args.json:
            import json
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    if args.what == "dispatch":
        print(f"dispatch benchmark on {os.cpu_count()} CPU core(s); a trivial call on every rank")
        print_dispatch(dispatch(tuple(args.world_sizes), calls=args.calls, rounds=args.rounds,
                                 baselines=not args.no_baselines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
