"""``swarmtrain demo``: a swarm of real node processes on loopback, then a comparison with one node.

    swarmtrain demo --nodes 4 --rounds 5

Needs no network and no download (the corpus is the Python standard library's source). The summary compares
the swarm's held-out bits per byte with one node trained for the same wall time on the same machine, and the
bytes each node sent with what synchronous data parallel (a ring all-reduce of fp32 gradients every step)
would have sent for the same steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from swarmtrain.config import load_config
from swarmtrain.errors import SwarmtrainError
from swarmtrain.model import ByteTransformer, count_parameters
from swarmtrain.train import run_training

# The small model the swarm benchmarks train (136k parameters; bench_churn, bench_compression_quality).
BENCH_MODEL = [
    "model.depth=2",
    "model.width=64",
    "model.heads=4",
    "model.context=64",
    "train.batch_size=16",
    "train.threads=1",
    "train.warmup_steps=20",
    "train.eval_batches=32",
]

DEMO_SETTINGS = [
    "train.batch_size=16",
    "train.threads=1",
    "train.warmup_steps=50",
    "node.inner_steps=20",
    "averaging.min_deadline_s=20",
]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written right now
    return records


def start_node(
    run_dir: Path, rounds: int, join: str | None, settings: list[str], *, isolated: bool = False
) -> subprocess.Popen[bytes]:
    """A node process logging to ``run_dir/node.log``. ``isolated`` (benchmarks): no ``SWARMTRAIN_`` variables
    from our environment, and a session of its own, so a kill can find all its processes and nothing else."""
    run_dir.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "swarmtrain", "node", "--run-dir", str(run_dir), "--rounds", str(rounds)]
    for item in settings:
        args += ["--set", item]
    if join:
        args += ["--join", join]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMTRAIN_")} if isolated else None
    log = open(run_dir / "node.log", "wb")  # noqa: SIM115 (the child owns it for its lifetime)
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=isolated)


def wait_for_join_line(run_dir: Path, proc: subprocess.Popen[bytes], timeout: float = 90.0) -> str:
    deadline = time.monotonic() + timeout
    path = run_dir / "join.txt"
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().split()[0]
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    tail = (run_dir / "node.log").read_text(errors="replace")[-2000:]
    raise SwarmtrainError(f"demo error: the first node did not come up. Its log ends with:\n{tail}")


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def progress_table(dirs: list[Path], rounds: int) -> Table:
    table = Table(title=f"swarm on loopback: {len(dirs)} nodes, {rounds} rounds")
    for column in ("node", "round", "loss", "group", "outcome", "digest", "sent"):
        table.add_column(column)
    for i, d in enumerate(dirs):
        rows = [r for r in read_metrics(d / "metrics.jsonl") if r.get("kind") == "round"]
        if rows:
            r = rows[-1]
            sent = sum(x["bytes_sent"] for x in rows)
            values = [r["round"] + 1, f"{r['loss']:.3f}", r["group_size"], r["outcome"], r["digest"][:8]]
            table.add_row(f"node{i}", *map(str, values), f"{sent / 1e6:.1f} MB")
        else:
            table.add_row(f"node{i}", "0", "-", "-", "starting", "-", "-")
    return table


def run_demo(nodes: int, rounds: int, base: str) -> None:
    if nodes < 2:
        raise SwarmtrainError("demo error: --nodes must be at least 2 for a swarm.")
    console = Console(soft_wrap=True)
    root = Path(base)
    dirs = [root / f"node{i}" for i in range(nodes)]
    console.print(f"starting {nodes} nodes on loopback, {rounds} rounds each; runs in {root}")
    procs: list[subprocess.Popen[bytes]] = []
    started = time.monotonic()
    try:
        settings = [*DEMO_SETTINGS, f"node.min_peers={nodes}"]
        procs.append(start_node(dirs[0], rounds, None, settings))
        first = wait_for_join_line(dirs[0], procs[0])
        procs += [start_node(d, rounds, first, settings) for d in dirs[1:]]
        deadline = started + 120 + rounds * 90  # generous bound; the loop never runs forever
        with Live(progress_table(dirs, rounds), console=console, refresh_per_second=1) as live:
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(1.0)
                live.update(progress_table(dirs, rounds))
    finally:
        stop(procs)
    wall = time.monotonic() - started
    failed = [i for i, p in enumerate(procs) if p.returncode not in (0, None)]
    if failed:
        tails = "\n".join((dirs[i] / "node.log").read_text(errors="replace")[-1500:] for i in failed[:1])
        raise SwarmtrainError(f"demo error: node(s) {failed} failed. Log of the first:\n{tails}")
    summarize(console, dirs, rounds, wall, root)


def summarize(console: Console, dirs: list[Path], rounds: int, wall: float, root: Path) -> None:
    records = [read_metrics(d / "metrics.jsonl") for d in dirs]
    finals = [next((r for r in recs if r.get("kind") == "final"), None) for recs in records]
    round_rows = [[r for r in recs if r.get("kind") == "round"] for recs in records]
    digests_agree = all(len({rows[k]["digest"] for rows in round_rows if len(rows) > k}) == 1 for k in range(rounds))
    swarm_bpb = min(f["bpb"] for f in finals if f is not None)
    config = load_config(overrides=DEMO_SETTINGS, environ={})
    params = count_parameters(ByteTransformer(config.model))
    n = len(dirs)
    sent = sum(sum(r["bytes_sent"] for r in rows) for rows in round_rows) / n
    steps = rounds * config.node.inner_steps
    ddp = steps * 2 * (n - 1) / n * 4 * params

    console.print(f"\nswarm done in {wall:.0f} s; now one node alone for the same wall time, for comparison")
    single = load_config(
        overrides=[s for s in DEMO_SETTINGS if not s.startswith(("node.", "averaging.", "train.threads"))],
        flags={"run_dir": str(root / "single"), "train.max_time": wall},
        environ={},
    )
    single_bpb = run_training(single, console=Console(quiet=True))

    table = Table(title="demo summary")
    table.add_column("")
    table.add_column("value")
    table.add_row("replicas identical after every round", "yes" if digests_agree else "NO")
    table.add_row(f"held-out bpb, swarm of {n} ({rounds} rounds)", f"{swarm_bpb:.3f}")
    table.add_row(f"held-out bpb, one node alone for {wall:.0f} s", f"{single_bpb:.3f}")
    table.add_row("bytes sent per node", f"{sent / 1e6:.1f} MB")
    table.add_row("sync data parallel, same steps (fp32 ring)", f"{ddp / 1e6:.1f} MB ({ddp / max(sent, 1):.0f}x more)")
    console.print(table)
    console.print(
        f"The {n} nodes shared this machine's cores, so the swarm did fewer steps than one node that owns them: the "
        "demo shows the mechanics (identical replicas, bytes on the wire), not a speedup, which needs separate "
        "machines."
    )
    console.print(f"held-out bpb {swarm_bpb:.3f}")
