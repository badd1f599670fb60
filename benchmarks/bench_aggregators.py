"""Cost of each aggregator (swarmtrain/averaging/robust.py) per shard: the time a reducer spends combining one
part of ``--numel`` coordinates from ``--members`` contributions, and how that compares with the plain mean.

    python benchmarks/bench_aggregators.py
    python benchmarks/bench_aggregators.py --numel 1048576 --members 8 --repeats 5

Contributions are Gaussian noise around a shared direction (the cost does not depend on the values). Each
aggregator is timed as the reducer runs it (``Aggregator.reduce`` on the part's rows), median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from swarmtrain.averaging.robust import parse_aggregator

SPECS = ("mean", "mean:clip=2,cap=2", "trimmed-mean", "median", "centered-clip", "centered-clip:iters=10")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1 << 20, help="coordinates per part (averaging.part_numel)")
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a node trains on the others)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    signal = torch.randn(args.numel)
    rows = [signal + 0.3 * torch.randn(args.numel) for _ in range(args.members)]
    weights = [100.0 + i for i in range(args.members)]
    out = torch.empty(args.numel)
    print(
        f"{args.members} contributions x {args.numel} coordinates, {args.threads} thread(s), torch {torch.__version__}"
    )
    print(f"{'aggregator':<44} {'ms/part':>9} {'x mean':>7} {'ns/coord/member':>16}")
    base = None
    for spec in SPECS:
        agg = parse_aggregator(spec)
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            agg.reduce(rows, weights, out)
            times.append(time.perf_counter() - started)
        ms = statistics.median(times) * 1e3
        base = base or ms
        per = ms * 1e6 / (args.numel * args.members)
        print(f"{agg.spec:<44} {ms:>9.1f} {ms / base:>7.1f} {per:>16.2f}")


if __name__ == "__main__":
    main()
