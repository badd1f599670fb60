"""Churn: one loopback swarm with and without a quarter of its peers killed (kill -9) mid-run; ours and hivemind's.

    python benchmarks/bench_churn.py --seed 0 --nodes 8 --rounds 12 --kill-frac 0.25

A seeded schedule picks round(kill_frac x nodes) victims among nodes 1..n-1 (node 0 is the one every other node
joins through and is never killed), a moment for each inside the middle of the run, and a delay for hivemind's
kill. A kill is SIGKILL to the peer's Python processes, by PID, as `kill -9` does, leaving its p2pd daemon to
exit or linger on its own (`--kill-daemons` kills it at the same moment too). Every peer runs in a session of its
own, so everything left of the processes the benchmark started is killed by PID at the end, daemons included.
``--keep DIR`` keeps the nodes' logs and metrics.

swarmtrain: NODES real node processes on loopback (the stdlib corpus, a small model, H inner steps per round),
once without kills, then with each victim killed in a seeded round of the middle of the run (drawn from 30-70 %
of the rounds), a seeded fraction of a round's period (the first run's median) after it logged the round before.
Reported per run:
- held-out bits per byte at the end (node 0's evaluation), and the tokens all nodes trained on;
- rounds lost: rounds in which some survivor's outcome was not "applied" (fallback, diverged, ...) or in which a
  survivor wrote no row at all;
- the longest round (s) over all nodes;
- whether every round's group members ended with identical digests (rows of one group id, "diverged" rows left
  out and counted apart), and how many different models (last digests) the survivors ended with.

hivemind: NODES processes each running a DHT and a DecentralizedAverager over a NUMEL-element fp32 tensor that
holds seeded per-peer random values. Each round every peer steps with ``require_trigger``; once all have formed
their group, all are triggered. The last round is the killed one: the same victims are killed a seeded delay
after the trigger (a fraction of the warm-up rounds' all-reduce time). Reported per survivor: whether
``step`` returned, raised or hung (no answer within --hm-wait s), how long it waited, and the share of its
coordinates left at its local (never averaged) value, at the average of all peers, at the average of the
survivors, or at some other mix; then the share of coordinates that differ across the survivors.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import signal
import statistics
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch

from swarmtrain.node.demo import BENCH_MODEL, read_metrics, start_node, wait_for_join_line

# averaging.verify=0: measured without the checks a public swarm makes of reducers, as the README figures were.
SETTINGS = [*BENCH_MODEL, "node.inner_steps=10", "averaging.min_deadline_s=10", "averaging.verify=0"]

# ---- processes: each peer runs in its own session, so a kill finds all its processes and nothing else ----------


def _session(pgid: int) -> list[tuple[int, str]]:
    """(pid, cmdline) of the live processes in process group ``pgid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append((int(stat.parent.name), cmdline))
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked
    return found


def kill_peer(pgid: int, daemons: bool) -> None:
    """SIGKILL a peer's Python processes (and its p2pd daemon if ``daemons``), by PID."""
    for pid, cmdline in _session(pgid):
        if daemons or "p2pd" not in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def reap(pgids: list[int]) -> None:
    """Kill whatever is left of the peers we started (a lingering daemon of a killed peer, a hung worker)."""
    for pgid in pgids:
        kill_peer(pgid, daemons=True)


def daemon_alive(pgid: int) -> bool:
    return any("p2pd" in cmdline for _, cmdline in _session(pgid))


# ---- swarmtrain ------------------------------------------------------------------------------------------------


def run_swarm(
    nodes: int, rounds: int, root: Path, kills: dict[int, tuple[int, float]], kill_daemons: bool, extra: list[str]
) -> dict[str, Any]:
    """One swarm run; ``kills`` maps a node to (round, delay): it is killed ``delay`` seconds after it logged the
    round before ``round``, i.e. during its round ``round``."""
    settings = [*SETTINGS, *extra, f"node.min_peers={nodes}"]
    dirs = [root / f"node{i}" for i in range(nodes)]
    procs = [start_node(dirs[0], rounds, None, [*settings, "node.data_seed=0"], isolated=True)]
    pgids = [procs[0].pid]
    killed: dict[int, dict[str, Any]] = {}
    try:
        first = wait_for_join_line(dirs[0], procs[0])
        for i, d in enumerate(dirs[1:], 1):
            procs.append(start_node(d, rounds, first, [*settings, f"node.data_seed={i}"], isolated=True))
            pgids.append(procs[-1].pid)
        for d, p in zip(dirs, procs, strict=True):
            wait_for_join_line(d, p, timeout=180)
        started = time.monotonic()
        deadline = started + 180 + 60 * rounds
        pending = dict(kills)
        due: dict[int, float] = {}  # victim -> when to kill it, once it reached its round
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            now = time.monotonic() - started
            for victim, (round_, delay) in list(pending.items()):
                rows = [r for r in read_metrics(dirs[victim] / "metrics.jsonl") if r.get("kind") == "round"]
                at = rows[-1]["round"] + 1 if rows else 0  # the round it is in now
                if victim not in due and at >= round_:
                    due[victim] = now + delay
                if victim in due and due[victim] <= now:
                    kill_peer(pgids[victim], kill_daemons)
                    killed[victim] = {"at_s": now, "in_round": at}
                    del pending[victim]
            for victim, info in killed.items():
                if "daemon_after_5s" not in info and now > info["at_s"] + 5:
                    info["daemon_after_5s"] = daemon_alive(pgids[victim])
            time.sleep(0.2)
        wall = time.monotonic() - started
    finally:
        reap(pgids)
        for p in procs:
            p.wait(timeout=30)
    survivors = [i for i in range(nodes) if i not in killed]
    result = summarize(dirs, rounds, survivors, killed, wall)
    result["failed"] = {i: procs[i].returncode for i in survivors if procs[i].returncode != 0}
    return result


def summarize(
    dirs: list[Path], rounds: int, survivors: list[int], killed: dict[int, dict[str, Any]], wall: float
) -> dict[str, Any]:
    records = [read_metrics(d / "metrics.jsonl") for d in dirs]
    rows = [[r for r in recs if r.get("kind") == "round"] for recs in records]
    final = next((r for r in records[0] if r.get("kind") == "final"), {"bpb": float("nan")})
    lost = []
    for k in range(rounds):
        outcomes = [next((r["outcome"] for r in rows[i] if r["round"] == k), "missing") for i in survivors]
        if any(o != "applied" for o in outcomes):
            lost.append((k, sorted(set(outcomes))))
    by_group: dict[str, set[str]] = {}
    for r in (r for rs in rows for r in rs if r["outcome"] != "diverged"):
        by_group.setdefault(r["group_id"], set()).add(r["digest"])
    per_round = []
    for k in range(rounds):
        here = [r for rs in rows for r in rs if r["round"] == k]
        per_round.append(
            {
                "round": k,
                "rows": len(here),
                "outcomes": {o: sum(r["outcome"] == o for r in here) for o in sorted({r["outcome"] for r in here})},
                "group_sizes": sorted({r["group_size"] for r in here}),
                "max_s": max((r["duration_s"] for r in here), default=0.0),
            }
        )
    # One swarm should end with one model: the survivors' last digests and final evaluations.
    last = {rows[i][-1]["digest"] for i in survivors if rows[i]}
    finals = [r["bpb"] for i in survivors for r in records[i] if r.get("kind") == "final"] or [float("nan")]
    elapsed = [r["elapsed_s"] for r in rows[0]]
    periods = [b - a for a, b in zip([0.0, *elapsed[:-1]], elapsed, strict=True)]
    return {
        "bpb": final["bpb"],
        "period_s": statistics.median(periods) if periods else 0.0,  # node 0's median time per round
        "models": len(last),
        "bpb_range": (min(finals), max(finals)),
        "tokens": sum(r["tokens"] for rs in rows for r in rs),
        "lost": lost,
        "longest_s": max((r["duration_s"] for rs in rows for r in rs), default=float("nan")),
        "identical": all(len(d) == 1 for d in by_group.values()),
        "diverged": sum(r["outcome"] == "diverged" for rs in rows for r in rs),
        "killed": killed,
        "wall_s": wall,
        "per_round": per_round,
    }


# ---- hivemind --------------------------------------------------------------------------------------------------


def _values(idx: int, round_: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * round_ + idx))


def _wait_for(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.rename(path)


def hivemind_worker(idx: int, peers: int, numel: int, rounds: int, workdir: str, wait_s: float) -> None:
    os.setsid()  # its own session: the DHT and averager processes and p2pd it starts can be found and killed
    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.control import AveragingStage
    from hivemind.dht import DHT

    mp.set_start_method("fork", force=True)  # hivemind's DHT and averager are fork-started mp.Process children
    torch.set_num_threads(1)
    work = Path(workdir)
    join = [] if idx == 0 else [(work / "maddr0").read_text()]
    dht = DHT(initial_peers=join, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    _write(work / f"maddr{idx}", str(dht.get_visible_maddrs()[0]))
    tensor = torch.zeros(numel)
    averager = DecentralizedAverager(
        [tensor], dht, start=True, prefix="churn", target_group_size=peers, min_group_size=peers,
        min_matchmaking_time=1.0, request_timeout=3.0,
    )  # fmt: skip
    for r in range(rounds):
        with averager.get_tensors() as tensors:
            tensors[0].copy_(_values(idx, r, numel))
        (work / f"ready{r}_{idx}").touch()
        _wait_for(work / f"start{r}", 600)
        control = averager.step(wait=False, require_trigger=True, timeout=wait_s)
        while control.stage.value < AveragingStage.AWAITING_TRIGGER.value and not control.done():
            time.sleep(0.005)
        _write(work / f"formed{r}_{idx}", control.stage.name)
        _wait_for(work / f"go{r}", 600)
        triggered = time.monotonic()
        control.allow_allreduce()
        stage = None
        while not control.done() and time.monotonic() < triggered + wait_s:
            if control.stage != stage:
                stage = control.stage
                _write(work / f"stage{r}_{idx}", stage.name)
            time.sleep(0.005)
        waited = time.monotonic() - triggered
        if not control.done():
            outcome, group = "hung", 0
        elif control.exception() is not None:
            outcome, group = f"raised {type(control.exception()).__name__}", 0
        else:
            gathered = control.result()
            outcome, group = ("returned", len(gathered)) if gathered is not None else ("returned None", 0)
        # The tensor lives in shared memory: read it without the averager's lock, which a hung step still holds.
        torch.save(tensor.clone(), work / f"tensor{r}_{idx}.pt")
        _write(work / f"result{r}_{idx}.json", json.dumps({"outcome": outcome, "waited_s": waited, "group": group}))
    time.sleep(3600)  # the parent kills us when it has read everything


def run_hivemind(
    peers: int, numel: int, warmup: int, victims: list[int], delay_frac: float, kill_daemons: bool, wait_s: float
) -> dict[str, Any]:
    rounds = warmup + 1
    ctx = mp.get_context("spawn")
    with TemporaryDirectory() as tmp:
        work = Path(tmp)
        procs = []
        try:
            for i in range(peers):
                args = (i, peers, numel, rounds, tmp, wait_s)
                procs.append(ctx.Process(target=hivemind_worker, args=args, daemon=False))
                procs[-1].start()
                if i == 0 and not _wait_for(work / "maddr0", 180):
                    raise RuntimeError("hivemind peer 0 did not come up")
            alive = list(range(peers))
            warm: list[float] = []
            delay = 0.0
            victim_stages: dict[int, str] = {}
            for r in range(rounds):
                if not all(_wait_for(work / f"ready{r}_{i}", 300) for i in alive):
                    raise RuntimeError(f"hivemind: a peer did not get ready for round {r}")
                (work / f"start{r}").touch()
                if not all(_wait_for(work / f"formed{r}_{i}", 120) for i in alive):
                    raise RuntimeError(f"hivemind: round {r}: a peer formed no group in 120 s")
                (work / f"go{r}").touch()
                if r == warmup:
                    delay = delay_frac * statistics.median(warm)
                    time.sleep(delay)
                    for v in victims:
                        kill_peer(procs[v].pid, kill_daemons)
                    for v in victims:
                        path = work / f"stage{r}_{v}"
                        victim_stages[v] = path.read_text() if path.exists() else "not triggered yet"
                    alive = [i for i in alive if i not in victims]
                for i in alive:
                    if not _wait_for(work / f"result{r}_{i}.json", wait_s + 120):
                        raise RuntimeError(f"hivemind: round {r}: peer {i} gave no answer")
                results = {i: json.loads((work / f"result{r}_{i}.json").read_text()) for i in alive}
                if r < warmup:
                    if not all(x["outcome"] == "returned" and x["group"] == peers for x in results.values()):
                        raise RuntimeError(f"hivemind: warm-up round {r} failed: {results}")
                    if r > 0 or warmup == 1:  # the first round also sets up connections
                        warm += [x["waited_s"] for x in results.values()]
            tensors = torch.stack([torch.load(work / f"tensor{warmup}_{i}.pt") for i in alive])
        finally:
            reap([p.pid for p in procs])
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():  # it died before it had a session of its own
                    p.kill()
                    p.join()
    values = torch.stack([_values(i, warmup, numel) for i in range(peers)])
    everyone, survivors = values.mean(0), values[alive].mean(0)
    tol = 1e-4  # a member adds (average - local) to its local value: equal averages differ by rounding only
    per_peer = {}
    for row, i in enumerate(alive):
        t = tensors[row]
        local = (t - values[i]).abs() <= tol
        all_ = (t - everyone).abs() <= tol
        surv = (t - survivors).abs() <= tol
        per_peer[i] = {
            **results[i],
            "local": float(local.float().mean()),
            "everyone": float(all_.float().mean()),
            "survivors": float(surv.float().mean()),
            "other": float((~(local | all_ | surv)).float().mean()),
        }
    returned = [row for row, i in enumerate(alive) if results[i]["outcome"] == "returned"]
    spread = tensors.amax(0) - tensors.amin(0)
    spread_returned = tensors[returned].amax(0) - tensors[returned].amin(0) if len(returned) > 1 else None
    return {
        "peers": per_peer,
        "delay_s": delay,
        "warm_s": statistics.median(warm),
        "victim_stages": victim_stages,
        "inconsistent": float((spread > tol).float().mean()),
        "inconsistent_returned": None if spread_returned is None else float((spread_returned > tol).float().mean()),
    }


# ---- report ----------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--kill-frac", type=float, default=0.25, help="share of the nodes killed")
    parser.add_argument("--kill-daemons", action="store_true", help="also SIGKILL the victims' p2pd daemons")
    parser.add_argument("--hm-numel", type=int, default=2_000_000, help="elements each hivemind peer averages")
    parser.add_argument("--hm-warmup", type=int, default=2, help="hivemind rounds before the killed one")
    parser.add_argument("--hm-wait", type=float, default=60.0, help="seconds a hivemind survivor waits for its step")
    parser.add_argument("--systems", default="swarmtrain,hivemind")
    parser.add_argument("--keep", metavar="DIR", help="keep the nodes' run directories (logs, metrics) under DIR")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting for every node")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    count = round(args.kill_frac * args.nodes)
    if not 0 < count < args.nodes - 1:
        parser.error("--kill-frac must kill at least one node and leave at least two")
    victims = sorted(rng.sample(range(1, args.nodes), count))
    schedule = {v: (int(rng.uniform(0.3, 0.7) * args.rounds), rng.random()) for v in victims}
    delay_frac = rng.uniform(0.0, 0.5)
    mode = "Python processes and p2pd" if args.kill_daemons else "Python processes; p2pd left running"
    print(f"seed {args.seed}: {args.nodes} nodes, kill nodes {victims} ({mode})", flush=True)
    systems = args.systems.split(",")
    if "swarmtrain" in systems:
        swarm(args, victims, schedule)
    if "hivemind" in systems:
        hivemind(args, victims, delay_frac)


def swarm(args: argparse.Namespace, victims: list[int], schedule: dict[int, tuple[int, float]]) -> None:
    h = next(s for s in [*SETTINGS, *args.set][::-1] if s.startswith("node.inner_steps=")).split("=")[1]
    print(f"\nswarmtrain: {args.nodes} nodes, {args.rounds} rounds of H={h}", flush=True)
    runs = {}
    with TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        runs["no kills"] = run_swarm(args.nodes, args.rounds, root / "base", {}, args.kill_daemons, args.set)
        period = runs["no kills"]["period_s"]
        kills = {v: (round_, f * period) for v, (round_, f) in schedule.items()}
        plan = ", ".join(
            f"node {v} {f:.2f} of a {period:.1f} s period into its round {k}" for v, (k, f) in schedule.items()
        )
        print(f"  kill schedule: {plan}", flush=True)
        label = f"{len(victims)} killed"
        runs[label] = run_swarm(args.nodes, args.rounds, root / "kill", kills, args.kill_daemons, args.set)
    for v, info in sorted(runs[label]["killed"].items()):
        lingered = {True: "its p2pd still up 5 s later", False: "its p2pd gone", None: "?"}
        print(
            f"  node {v} killed at {info['at_s']:.1f} s, during its round {info['in_round']} "
            f"({lingered[info.get('daemon_after_5s')]})"
        )
    print(f"  per round, killed run: {'round':>5} {'rows':>4} {'group sizes':>12} {'max s':>6}  outcomes")
    for p in runs[label]["per_round"]:
        sizes = ",".join(map(str, p["group_sizes"]))
        outcomes = ", ".join(f"{o} x{n}" for o, n in p["outcomes"].items())
        print(f"  {'':21} {p['round']:5} {p['rows']:4} {sizes:>12} {p['max_s']:6.1f}  {outcomes}")
    print(
        f"\n{'run':10} {'final bpb':>9} {'tokens':>9} {'wall s':>7} {'rounds lost':>11} {'longest round s':>15} "
        f"{'digests identical':>17} {'models at end':>13}"
    )
    for name, r in runs.items():
        lost = f"{len(r['lost'])}/{args.rounds}"
        identical = ("yes" if r["identical"] else "NO") + (f" ({r['diverged']} diverged)" if r["diverged"] else "")
        print(
            f"{name:10} {r['bpb']:9.3f} {r['tokens']:9,} {r['wall_s']:7.0f} {lost:>11} {r['longest_s']:15.1f} "
            f"{identical:>17} {r['models']:13}"
        )
        if r["models"] > 1:
            low, high = r["bpb_range"]
            print(f"  the survivors ended with {r['models']} different models: final bpb {low:.3f} to {high:.3f}")
        for k, outcomes in r["lost"]:
            print(f"  lost round {k}: survivors' outcomes {outcomes}")
        if r["failed"]:
            print(f"  survivors that did not exit cleanly (node: exit code): {r['failed']}")
    ratio = runs[label]["tokens"] / runs["no kills"]["tokens"]
    print(f"(tokens: all nodes' inner steps in rounds they logged; the killed run's are {ratio:.0%} of the other's)")


def hivemind(args: argparse.Namespace, victims: list[int], delay_frac: float) -> None:
    print(
        f"\nhivemind DecentralizedAverager: {args.nodes} peers x {args.hm_numel:,} fp32, {args.hm_warmup} warm-up "
        f"rounds, then nodes {victims} killed mid-step",
        flush=True,
    )
    r = run_hivemind(
        args.nodes, args.hm_numel, args.hm_warmup, victims, delay_frac, args.kill_daemons, args.hm_wait
    )  # fmt: skip
    print(
        f"  killed {r['delay_s']:.3f} s after the trigger (warm-up all-reduce {r['warm_s']:.3f} s); "
        f"victims' stage then: {r['victim_stages']}"
    )
    print(
        f"\n{'survivor':>8} {'step':>14} {'waited s':>8} {'local':>7} {'avg all':>7} {'avg survivors':>13} "
        f"{'other':>7}"
    )
    for i, x in r["peers"].items():
        print(
            f"{i:8} {x['outcome']:>14} {x['waited_s']:8.1f} {x['local']:7.1%} {x['everyone']:7.1%} "
            f"{x['survivors']:13.1%} {x['other']:7.1%}"
        )
    print(
        "(share of each survivor's coordinates left at its local value, at the average of all peers, at the "
        "average of the survivors, or at some other mix)"
    )
    returned = r["inconsistent_returned"]
    among = "" if returned is None else f"; among those whose step returned: {returned:.1%}"
    print(f"coordinates inconsistent across the survivors: {r['inconsistent']:.1%}{among}", flush=True)


if __name__ == "__main__":
    main()
