"""Codec throughput and bytes on the wire, on one tensor of Gaussian noise.

    python benchmarks/bench_codecs.py --numel 10000000
    python benchmarks/bench_codecs.py --numel 1000000 --repeats 3 --spec int8 --spec "topk:frac=0.001"

For each codec spec it prints bytes per parameter (the figure we compete on), how many times smaller that is than
fp32, encode and decode throughput in MB/s of fp32 input (median of ``--repeats`` runs, no error feedback), and
the relative L2 error of one round trip. Noise is the worst case for the sparse and low-rank codecs (no structure
to exploit), so their errors here are upper bounds; error feedback delivers the rest over later rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from swarmtrain.compression import get_codec

DEFAULT_SPECS = (
    "fp32",
    "fp16",
    "bf16",
    "int8",
    "int8:rounding=stochastic",
    "int4",
    "2bit",
    "topk:frac=0.01",
    "topk:frac=0.01,value=int8",
    "topk:frac=0.005,value=int8",
    "topk:frac=0.008,value=2bit",
    "powersgd:rank=4",
    "dct-topk",
    "dct-topk:value=int8",
)


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=10_000_000, help="elements of the benchmark tensor")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per codec and direction")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--spec", action="append", help="codec spec to run (repeatable); default: all codecs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    megabytes = x.numel() * 4 / 1e6
    print(f"{args.numel:,} float32 elements ({megabytes:.0f} MB), {args.threads} thread(s), median of {args.repeats}")
    print(f"{'codec':<28} {'bytes/param':>11} {'vs fp32':>8} {'encode MB/s':>12} {'decode MB/s':>12} {'rel err':>8}")
    for spec in args.spec or DEFAULT_SPECS:
        codec = get_codec(spec)
        payload = codec.encode(x)
        decoded = codec.decode(payload, x.numel())
        encode_s = median_seconds(lambda codec=codec: codec.encode(x), args.repeats)
        decode_s = median_seconds(lambda codec=codec, payload=payload: codec.decode(payload, x.numel()), args.repeats)
        per_param = len(payload) / x.numel()
        error = float((decoded - x).norm() / x.norm())
        print(
            f"{spec:<28} {per_param:>11.4f} {4 / per_param:>7.0f}x {megabytes / encode_s:>12.0f} "
            f"{megabytes / decode_s:>12.0f} {error:>8.4f}"
        )


if __name__ == "__main__":
    main()
