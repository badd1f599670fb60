"""The same small 4-node loopback DiLoCo run with each codec: quality against bytes on the wire.

    python benchmarks/bench_compression_quality.py --codecs fp32,fp16,int8,topk:frac=0.01,value=int8
    python benchmarks/bench_compression_quality.py --codecs "fp32;topk:frac=0.005|averaging.outer_momentum=0"

Runs are separated by commas (or by semicolons when a spec has options of its own); ``spec|key=value|...`` adds
settings to one run only, ``--set key=value`` to every run.

Every run has the same seed, model, data, H, rounds and token budget, and starts 4 real node processes on
loopback (the stdlib corpus). Reported per codec:
- the held-out bits per byte of the swarm at the end (all replicas are identical; node 0's evaluation);
- payload bytes per parameter: the codec's own figure (payload size / elements), the one the anchors use
  (fp32 = 4, fp16 = 2, int8 = 1);
- wire bytes per parameter per sync: what one node sent in a typical round (the median over all nodes and
  rounds), divided by the parameter count: with a dense codec its uplink parts and, as a reducer, its averaged
  shard to the others (about 2 (n - 1) / n payloads); with a sparse or low-rank codec its whole payload to each
  of the n - 1 others; plus the small messages of the round (group, reports, digests);
- total bytes per node (including any state a node served to a peer catching up), and how many times less that
  is than synchronous data parallel (a ring all-reduce of fp32 gradients every step) for the same steps;
- resyncs: rounds a node spent outside the group (it fell behind, for example on a stalled stream) before it
  caught up from its peers;
- the gap to the fp32 run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from tempfile import TemporaryDirectory

from swarmtrain.averaging.allgather import plan_segments
from swarmtrain.compression import get_codec
from swarmtrain.config import load_config
from swarmtrain.model import ByteTransformer, count_parameters
from swarmtrain.node.demo import BENCH_MODEL, read_metrics, start_node, stop, wait_for_join_line

# averaging.verify=0: the codecs' own bytes, without the checks a public swarm makes of reducers (README, Replicated
# reduction, gives their cost).
SETTINGS = [*BENCH_MODEL, "node.inner_steps=20", "averaging.min_deadline_s=20", "averaging.verify=0"]


def run_swarm(codec: str, nodes: int, rounds: int, root: Path, extra: list[str]) -> dict[str, float]:
    settings = [*SETTINGS, *extra, f"node.min_peers={nodes}", f"averaging.codec={codec}"]
    dirs = [root / f"node{i}" for i in range(nodes)]
    # Node i reads the same windows in every run (peer ids are new each run), so codecs differ only in codec.
    procs = [start_node(dirs[0], rounds, None, [*settings, "node.data_seed=0"])]
    try:
        first = wait_for_join_line(dirs[0], procs[0])
        procs += [start_node(d, rounds, first, [*settings, f"node.data_seed={i}"]) for i, d in enumerate(dirs[1:], 1)]
        deadline = time.monotonic() + 120 + 60 * rounds
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(1.0)
    finally:
        stop(procs)
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"{codec}: a node failed; see {root}/node*/node.log")
    records = [read_metrics(d / "metrics.jsonl") for d in dirs]
    rows = [[r for r in recs if r["kind"] == "round"] for recs in records]
    final = next(r for r in records[0] if r["kind"] == "final")
    # Every round's group members end with one digest (a node that fell behind and caught up has no row for
    # the rounds it missed; its diverged row is its own, not a group's).
    by_round: dict[int, set[str]] = {}
    for r in (r for rs in rows for r in rs if r["outcome"] != "diverged"):
        by_round.setdefault(r["round"], set()).add(r["digest"])
    identical = all(len(digests) == 1 for digests in by_round.values())
    sent = sum(sum(r["bytes_sent"] for r in rs) for rs in rows) / nodes
    per_round = statistics.median(r["bytes_sent"] for rs in rows for r in rs)
    diverged = sum(r["outcome"] == "diverged" for rs in rows for r in rs)
    return {"bpb": final["bpb"], "sent": sent, "per_round": per_round, "identical": identical, "diverged": diverged}


def payload_per_param(codec: str, model: ByteTransformer, part_numel: int) -> float:
    """Payload bytes per parameter for this model, cut as the averager cuts it (PowerSGD: per weight matrix)."""
    shapes = [tuple(p.shape) for p in model.parameters()]
    numel = count_parameters(model)
    spec = get_codec(codec)
    if spec.sparse:
        return sum(s.codec.payload_size(s.numel) for s in plan_segments(spec, numel, shapes, part_numel)) / numel
    return sum(spec.payload_size(min(part_numel, numel - i)) for i in range(0, numel, part_numel)) / numel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codecs", default="fp32,fp16,int8,int4,topk:frac=0.01,value=int8")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting for every run")
    args = parser.parse_args()
    config = load_config(overrides=[*SETTINGS, *args.set], environ={})
    model = ByteTransformer(config.model)
    params = count_parameters(model)
    steps = args.rounds * config.node.inner_steps
    ddp = steps * 2 * (args.nodes - 1) / args.nodes * 4 * params
    print(f"{args.nodes} nodes, {args.rounds} rounds of H={config.node.inner_steps}, {params:,} parameters")
    header = (
        f"{'codec':30} {'bpb':>7} {'gap':>8} {'payload B/p':>11} {'wire B/p/sync':>13} {'MB/node':>8} {'vs DDP':>7}"
    )
    print(header + f" {'identical':>9} {'resyncs':>7}")
    baseline = None
    with TemporaryDirectory() as tmp:
        for i, run in enumerate(args.codecs.split(";") if ";" in args.codecs else _split(args.codecs)):
            codec, *own = run.split("|")  # "spec|key=value|...": settings for this run only
            result = run_swarm(codec, args.nodes, args.rounds, Path(tmp) / str(i), [*args.set, *own])
            baseline = baseline if baseline is not None else result["bpb"]
            gap = (result["bpb"] - baseline) / baseline * 100
            per_sync = result["per_round"] / params
            payload = payload_per_param(codec, model, config.averaging.part_numel)
            print(
                f"{run:30} {result['bpb']:7.3f} {gap:+7.2f}% {payload:11.4f} {per_sync:13.4f} "
                f"{result['sent'] / 1e6:8.2f} {ddp / result['sent']:6.0f}x "
                f"{'yes' if result['identical'] else 'NO':>9} {result['diverged']:7}",
                flush=True,
            )


def _split(codecs: str) -> list[str]:
    """Split a comma list of codec specs whose own options also use commas: a new spec starts at a name."""
    names = ("fp32", "fp16", "bf16", "int8", "int4", "2bit", "topk", "powersgd", "dct-topk")
    specs: list[str] = []
    for item in codecs.split(","):
        if item.split(":")[0] in names or not specs:
            specs.append(item)
        else:
            specs[-1] += "," + item
    return specs


if __name__ == "__main__":
    main()
