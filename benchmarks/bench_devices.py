"""Devices: single-node tokens/s on each device present, and a mixed swarm (one GPU node, two CPU nodes) that
shares rounds by time, against the same swarm on CPUs only.

    python benchmarks/bench_devices.py                       # about 6 min on 16 cores + 1 GPU
    python benchmarks/bench_devices.py --seconds 3 --rounds 2 --inner-time 2 --models default   # a quick look

Needs torch, numpy and the project; nothing to download (the corpus is the Python standard library's source).

1. Single node: for each model (``default``: the default config's model; ``larger``: depth 8, width 512,
   context 256) and each device present (``cuda:N``, ``mps``, ``cpu``), a standard ``Trainer`` on that device
   runs a few warm-up steps, then steps for ``--seconds``; reported in tokens per second. Accelerators are
   measured in fp32 and bf16 (autocast), the CPU in fp32, with ``--cpu-threads`` threads (0: all cores).
2. Swarm: three real node processes on loopback with the default model and ``node.inner_time_s``: every node
   trains the same wall-clock budget per round and contributes the tokens it managed. ``mixed``: node0 on the
   first GPU, node1 and node2 on the CPU; ``cpu only``: all three on the CPU. Each CPU node gets a third of the
   cores in both runs, so only node0 differs. Reported: tokens per node per round, whether every round's
   digests are identical on all three nodes, and the held-out bpb at the end, evaluated by node1 (a CPU node in
   both runs, so the two bpb come from the same evaluation code on the same device).

Without a GPU the single-node CPU rows and the CPU-only swarm run, and the GPU part is reported as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from swarmtrain.config import load_config
from swarmtrain.data import load_corpus
from swarmtrain.model import ByteTransformer, count_parameters
from swarmtrain.node.demo import read_metrics, start_node, stop, wait_for_join_line
from swarmtrain.signals import stop_on_signals
from swarmtrain.train import Trainer
from swarmtrain.train.device import present_devices

MODELS = {
    "default": [],
    "larger": ["model.depth=8", "model.width=512", "model.heads=8", "model.context=256"],
}
WARMUP_STEPS = 3


def single_node(model: str, device: str, precision: str, seconds: float, threads: int, extra: list[str]) -> float:
    """Tokens per second of the standard trainer on ``device`` (after a few warm-up steps)."""
    config = load_config(
        overrides=[*MODELS[model], *extra, f"train.device={device}", f"train.precision={precision}"], environ={}
    )
    torch.set_num_threads(threads or os.cpu_count() or 1)
    trainer = Trainer(config, load_corpus(config.data))
    for _ in range(WARMUP_STEPS):
        trainer.train_step()  # .item() of the loss waits for the device, so each step is timed whole
    tokens0, started = trainer.tokens, time.perf_counter()
    while time.perf_counter() - started < seconds:
        trainer.train_step()
    return (trainer.tokens - tokens0) / (time.perf_counter() - started)


def run_swarm(root: Path, devices: list[str], threads: list[int], args: argparse.Namespace) -> list[list[dict]]:
    """Three nodes with ``node.inner_time_s``; returns each node's metrics records."""
    dirs = [root / f"node{i}" for i in range(len(devices))]
    common = [
        "node.min_peers=3", f"node.inner_time_s={args.inner_time}", "averaging.min_deadline_s=20",
        "train.eval_batches=32", *args.set,
    ]  # fmt: skip
    settings = [[*common, f"train.device={d}", f"train.threads={t}"] for d, t in zip(devices, threads, strict=True)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(start_node(dirs[0], args.rounds, None, settings[0], isolated=True))
        first = wait_for_join_line(dirs[0], procs[0])
        for run_dir, node_settings in zip(dirs[1:], settings[1:], strict=True):
            procs.append(start_node(run_dir, args.rounds, first, node_settings, isolated=True))
        bound = 120 + args.rounds * (args.inner_time + 60)  # generous; a hung node fails the run, never hangs it
        started, reported = time.monotonic(), 0
        while any(proc.poll() is None for proc in procs) and time.monotonic() - started < bound:
            if any(proc.poll() not in (None, 0) for proc in procs):
                break  # a node failed: the others would wait for it until the bound
            time.sleep(1.0)
            done = min(sum(r.get("kind") == "round" for r in read_metrics(d / "metrics.jsonl")) for d in dirs)
            for k in range(reported, done):  # progress, so a slow run shows where its time goes
                print(f"  round {k} ended on all nodes after {time.monotonic() - started:.0f} s", flush=True)
            reported = max(reported, done)
        codes = [proc.poll() for proc in procs]
        # A node that failed is named before one still running: the others were only waiting for it.
        bad = [i for i, c in enumerate(codes) if c not in (None, 0)] + [i for i, c in enumerate(codes) if c is None]
        if bad:
            i = bad[0]
            code = codes[i] if codes[i] is not None else f"nothing (still running after {bound:.0f} s)"
            tail = (dirs[i] / "node.log").read_text(errors="replace")[-2000:]
            raise SystemExit(f"node{i} exited with {code}; its log ends with:\n{tail}")
    except KeyboardInterrupt:  # Ctrl+C, or SIGTERM (a `timeout` around the bench): say where each node was
        for i, run_dir in enumerate(dirs):
            log = run_dir / "node.log"
            tail = log.read_text(errors="replace")[-1500:] if log.exists() else "(not started)"
            print(f"--- interrupted: node{i} on {devices[i]}, its log ends with:\n{tail}", file=sys.stderr)
        raise
    finally:
        stop(procs)
    return [read_metrics(d / "metrics.jsonl") for d in dirs]


def swarm_table(console: Console, label: str, devices: list[str], records: list[list[dict]], rounds: int) -> None:
    rows = [[r for r in recs if r.get("kind") == "round"] for recs in records]
    table = Table(title=f"swarm, {label}: " + ", ".join(f"node{i} on {d}" for i, d in enumerate(devices)))
    table.add_column("round")
    for i in range(len(devices)):
        table.add_column(f"node{i} tokens (share)", justify="right")
    table.add_column("digests")
    agree = True
    for k in range(rounds):
        at = [next((r for r in node_rows if r["round"] == k), None) for node_rows in rows]
        digests = {r["digest"] for r in at if r is not None}
        same = len(digests) == 1 and all(r is not None for r in at)
        agree &= same
        cells = [f"{r['tokens']:,} ({r['token_share']:.0%})" if r else "-" for r in at]
        table.add_row(str(k), *cells, f"identical {next(iter(digests))[:8]}" if same else f"DIFFER {sorted(digests)}")
    console.print(table)
    final = next((r for r in records[1] if r.get("kind") == "final"), None)
    bpb = f"{final['bpb']:.3f}" if final else "missing"
    speeds = [sum(r["tokens_per_s"] for r in node_rows) / max(1, len(node_rows)) for node_rows in rows]
    console.print(
        f"{label}: identical digests every round: {'yes' if agree else 'NO'}; held-out bpb at the end (node1): "
        f"{bpb}; mean tokens/s per node: " + ", ".join(f"node{i} {s:,.0f}" for i, s in enumerate(speeds))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="default,larger", help="single-node models: default, larger")
    parser.add_argument("--seconds", type=float, default=10.0, help="timed seconds per single-node measurement")
    parser.add_argument("--cpu-threads", type=int, default=0, help="threads of the single-node CPU runs (0: all)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of each swarm run")
    parser.add_argument("--inner-time", type=float, default=10.0, help="node.inner_time_s of the swarm runs")
    parser.add_argument("--skip-swarm", action="store_true")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting for every node")
    parser.add_argument("--run-dir", type=Path, help="keep the swarm nodes' directories (logs, metrics) here")
    args = parser.parse_args()
    console = Console(soft_wrap=True)
    present = present_devices()
    accelerators = [d for d in present if d != "cpu"]
    cores = os.cpu_count() or 1
    console.print(f"devices present: {', '.join(present)}; {cores} CPU cores; torch {torch.__version__}")
    if not accelerators:
        console.print("no GPU on this machine: the GPU part (GPU rows, the mixed swarm) is SKIPPED")

    table = Table(title=f"single node, standard trainer, {args.seconds:.0f} s per row")
    for column in ("model", "parameters", "device", "precision", "tokens/s"):
        table.add_column(column, justify="right" if column in ("parameters", "tokens/s") else "left")
    for model in args.models.split(","):
        params = count_parameters(ByteTransformer(load_config(overrides=MODELS[model], environ={}).model))
        runs = [(d, p) for d in accelerators for p in ("fp32", "bf16")] + [("cpu", "fp32")]
        for device, precision in runs:
            speed = single_node(model, device, precision, args.seconds, args.cpu_threads, args.set)
            table.add_row(model, f"{params:,}", device, precision, f"{speed:,.0f}")
    console.print(table)

    if args.skip_swarm:
        return
    per_node = max(1, cores // 3)
    with contextlib.ExitStack() as stack:
        tmp = args.run_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-devices-")))
        runs = [("cpu only", ["cpu"] * 3, [per_node] * 3)]
        if accelerators:
            runs.insert(0, ("mixed", [accelerators[0], "cpu", "cpu"], [2, per_node, per_node]))
        for label, devices, threads in runs:
            console.print(f"\nswarm run '{label}': {args.rounds} rounds of {args.inner_time:g} s each ...")
            records = run_swarm(Path(tmp) / label.replace(" ", "-"), devices, threads, args)
            swarm_table(console, label, devices, records, args.rounds)
    if not accelerators:
        console.print("GPU part skipped: no CUDA or MPS device on this machine")


if __name__ == "__main__":
    with stop_on_signals():  # a `timeout` or kill stops it as Ctrl+C would: each node's log tail, then the nodes end
        main()
