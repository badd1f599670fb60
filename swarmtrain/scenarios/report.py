"""A scenario run's report: merged metrics, a summary (Markdown and JSON) and plots, in the run's folder.

    swarmtrain scenario run scenarios/churn-drop-one.toml --out runs/churn   # writes the report at the end

Reads what the runner left in the folder (``run.json``, ``events.jsonl``, each node's ``metrics.jsonl``) and
writes ``metrics.jsonl`` (every node's rows, with ``node``, ``incarnation`` and ``t``: seconds since the
scenario started), ``summary.json`` and ``summary.md`` (final held-out bpb, tokens, bytes, rounds applied /
fallback / diverged, rounds that left a member out, time to contribute for each joiner, compute utilisation)
and the plots ``loss.png`` (held-out bpb against wall time, tokens and bytes sent), ``members.png`` (members
over time, events marked) and ``phases.png`` (per-round duration split into phases, when the nodes logged phases).

Definitions:
- a round's outcome is the worst over the rows all nodes logged for it: diverged, else fallback, else applied;
- a joiner's time to contribute runs from its start to the logged end of its first round whose average took
  its tokens (token share > 0) together with at least one other node, applied;
- compute utilisation is the time spent in inner steps over the wall time the node's processes lived (start-up,
  waiting for peers and the final evaluation included); in training, over the time from each node's first inner
  phase to its last, that is its rounds' inner and idle seconds (``inner_s``, ``idle_s``): the steady state,
  where an exchange not hidden behind the inner steps (``node.overlap``) costs it.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from swarmtrain.node.demo import read_metrics


def load_run(folder: Path) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """(run.json, events, merged metric rows sorted by time) of a runner's folder."""
    run = json.loads((folder / "run.json").read_text())
    events = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines() if line.strip()]
    rows = []
    for life in run["nodes"]:
        for row in read_metrics(folder / life["run_dir"] / "metrics.jsonl"):
            rows.append(
                {**row, "node": life["node"], "incarnation": life["incarnation"], "t": row["time"] - run["started"]}
            )
    rows.sort(key=lambda r: r["t"])
    return run, events, rows


def round_outcomes(rows: list[dict[str, Any]]) -> dict[int, str]:
    outcomes: dict[int, set[str]] = {}
    for r in rows:
        if r["kind"] == "round":
            outcomes.setdefault(r["round"], set()).add(r["outcome"])
    worst = {}
    for k, seen in outcomes.items():
        worst[k] = (
            "diverged"
            if any(o.startswith("diverged") for o in seen)
            else "fallback"
            if seen - {"applied"}
            else "applied"
        )
    return dict(sorted(worst.items()))


def label(node: str, incarnation: int) -> str:
    """node1 for a node's first process, node1.2 for the next (its run directory's name)."""
    return node if incarnation == 1 else f"{node}.{incarnation}"


def summarize(run: dict[str, Any], events: list[dict[str, Any]], rows: list[dict[str, Any]]) -> dict[str, Any]:
    rounds = [r for r in rows if r["kind"] == "round"]
    wall = run["ended"] - run["started"]
    last = {life["node"]: life["incarnation"] for life in run["nodes"]}
    last_rows = [  # each node's last process: the one the scenario ends with
        r for r in rows if r["kind"] == "final" and r["incarnation"] == last[r["node"]] and r["bpb"] is not None
    ]
    finals = {label(r["node"], r["incarnation"]): r["bpb"] for r in last_rows}
    # The swarm's model is what the nodes that ended in its last round hold; a node that ended behind (back too
    # late to catch up) holds an older model, and is listed but left out of the mean.
    last_round = max((r["round"] for r in last_rows), default=0)
    in_step = [label(r["node"], r["incarnation"]) for r in last_rows if r["round"] == last_round]
    parts = {label(r["node"], r["incarnation"]): r["bpb_parts"] for r in last_rows if r.get("bpb_parts")}
    outcomes = round_outcomes(rows)
    per_node = []
    for life in run["nodes"]:
        mine = [r for r in rounds if r["node"] == life["node"] and r["incarnation"] == life["incarnation"]]
        lived = (life["ended"] or run["ended"]) - life["started"]
        inner = sum(r.get("inner_s", 0.0) for r in mine)
        timed = [r for r in mine if "idle_s" in r]  # (rows written before nodes logged their idle time have none)
        timed_inner, idle = sum(r.get("inner_s", 0.0) for r in timed), sum(r["idle_s"] for r in timed)
        per_node.append({
            "node": label(life["node"], life["incarnation"]),
            "rounds": len(mine), "tokens": sum(r["tokens"] for r in mine),
            "bytes_sent": sum(r["bytes_sent"] for r in mine),
            "exit_code": life["exit_code"], "lived_s": round(lived, 3), "inner_s": round(inner, 3),
            "utilisation": round(inner / lived, 4) if lived > 0 else 0.0,
            "timed_inner_s": round(timed_inner, 3), "idle_s": round(idle, 3),
        })  # fmt: skip
    joiners = []
    for e in events:
        if e["action"] == "start" and not e.get("initial", True):
            life = next(life for life in run["nodes"] if life["run_dir"] == e["run_dir"])
            first = next(
                (r for r in rounds if r["node"] == life["node"] and r["incarnation"] == life["incarnation"]
                 and r["outcome"] == "applied" and r["group_size"] > 1 and r["token_share"] > 0), None,
            )  # fmt: skip
            joiners.append({
                "node": label(e["node"], life["incarnation"]), "incarnation": life["incarnation"], "joined_t": e["t"],
                "contributed_t": None if first is None else round(first["t"], 3),
                "time_to_contribute_s": None if first is None else round(first["t"] - e["t"], 3),
                "round": None if first is None else first["round"],
            })  # fmt: skip
    lived = sum(n["lived_s"] for n in per_node)
    training = sum(n["timed_inner_s"] + n["idle_s"] for n in per_node)
    return {
        "wall_s": round(wall, 3),
        "final_bpb": {k: finals[k] for k in sorted(finals)},
        "final_bpb_mean": statistics.fmean(finals[k] for k in in_step) if in_step else None,
        "final_round": last_round,
        "final_in_step": sorted(in_step),
        "final_bpb_parts": {k: parts[k] for k in sorted(parts)},  # data.eval_parts: each part and "all"
        "final_bpb_parts_mean": parts_mean(parts),
        "tokens": sum(r["tokens"] for r in rounds),
        "bytes_sent": sum(r["bytes_sent"] for r in rounds),
        "rounds": len(outcomes),
        "rounds_applied": sum(o == "applied" for o in outcomes.values()),
        "rounds_fallback": sum(o == "fallback" for o in outcomes.values()),
        "rounds_diverged": sum(o == "diverged" for o in outcomes.values()),
        # Rounds whose group lost a member on the way (it died, was late past a deadline or sent something its
        # group refused): the churn lab's "deadlines hit".
        "rounds_short": len({r["round"] for r in rounds if r.get("excluded")}),
        "utilisation": round(sum(n["inner_s"] for n in per_node) / lived, 4) if lived > 0 else 0.0,
        "utilisation_training": round(sum(n["timed_inner_s"] for n in per_node) / training, 4) if training else None,
        "nodes": per_node,
        "joiners": joiners,
        "events": [e for e in events if e["action"] in ("join", "leave", "kill", "pause", "resume", "stop")],
    }


def parts_mean(parts: dict[str, dict[str, float]]) -> dict[str, float]:
    """Per part (data.eval_parts), the mean over the nodes' final models of their held-out bpb on it."""
    names = list(next(iter(parts.values()), {}))
    return {name: statistics.fmean(p[name] for p in parts.values() if name in p) for name in names}


def behind(summary: dict[str, Any]) -> str:
    """The nodes that ended behind the swarm's last round, as a clause for the final bpb's row."""
    late = sorted(set(summary["final_bpb"]) - set(summary["final_in_step"]))
    return f"; {', '.join(late)} ended behind, left out" if late else ""


def percent(share: float | None) -> str:
    """A share as a percentage, or "-" where there is none."""
    return "-" if share is None else f"{share:.1%}"


def markdown(summary: dict[str, Any], spec_name: str, phases: bool) -> str:
    s = summary
    mean = "-" if s["final_bpb_mean"] is None else f"{s['final_bpb_mean']:.4f}"
    lines = [
        f"# Scenario {spec_name}", "",
        "| | |", "|---|---|",
        f"| wall time | {s['wall_s']:.1f} s |",
        f"| final held-out bpb (mean of {len(s['final_in_step'])} nodes in round {s['final_round']}"
        f"{behind(s)}) | {mean} |",
        f"| tokens trained (all nodes) | {s['tokens']:,} |",
        f"| bytes sent (all nodes) | {s['bytes_sent']:,} |",
        f"| rounds applied / fallback / diverged | {s['rounds_applied']} / {s['rounds_fallback']} / "
        f"{s['rounds_diverged']} of {s['rounds']} |",
        f"| rounds that left a member out (it died, was late past a deadline or was refused) | "
        f"{s['rounds_short']} of {s['rounds']} |",
        f"| compute utilisation (inner steps / wall time) | {s['utilisation']:.1%} |",
        f"| compute utilisation in training (inner steps / inner steps and idle time) | "
        f"{percent(s['utilisation_training'])} |",
        "", "## Nodes", "",
        "| node | rounds | tokens | bytes sent | lived s | inner s | utilisation | exit | final bpb |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for n in s["nodes"]:
        bpb = s["final_bpb"].get(n["node"])
        final = "-" if bpb is None else f"{bpb:.4f}"
        lines.append(
            f"| {n['node']} | {n['rounds']} | {n['tokens']:,} | {n['bytes_sent']:,} | {n['lived_s']:.1f} | "
            f"{n['inner_s']:.1f} | {n['utilisation']:.1%} | {n['exit_code']} | {final} |"
        )
    if s["final_bpb_parts"]:
        names = list(s["final_bpb_parts_mean"])
        lines += ["", '## Held-out bpb by part (data.eval_parts; "all": the parts together)', ""]
        lines += [f"| node | {' | '.join(names)} |", "|---" * (len(names) + 1) + "|"]
        for node, bpbs in s["final_bpb_parts"].items():
            lines.append(f"| {node} | " + " | ".join(f"{bpbs[n]:.4f}" if n in bpbs else "-" for n in names) + " |")
        lines.append("| mean | " + " | ".join(f"{s['final_bpb_parts_mean'][n]:.4f}" for n in names) + " |")
    if s["joiners"]:
        lines += [
            "",
            "## Joiners",
            "",
            "| node | joined at s | contributed at s | time to contribute s | round |",
            "|---|---|---|---|---|",
        ]
        for j in s["joiners"]:
            late = "never" if j["time_to_contribute_s"] is None else f"{j['time_to_contribute_s']:.1f}"
            at = "-" if j["contributed_t"] is None else f"{j['contributed_t']:.1f}"
            round_ = "-" if j["round"] is None else j["round"]
            lines.append(f"| {j['node']} | {j['joined_t']:.1f} | {at} | {late} | {round_} |")
    lines += ["", "## Events", "", "| t s | action | node |", "|---|---|---|"]
    lines += [f"| {e['t']:.1f} | {e['action']} | {e['node'] or '-'} |" for e in s["events"]]
    lines += ["", "![held-out loss](loss.png)", "", "![members](members.png)", ""]
    lines += ["![round phases](phases.png)" if phases else "(no round logged its phases: no phases plot)", ""]
    return "\n".join(lines)


def write_report(folder: Path) -> Path:
    """Write the report into ``folder`` (a runner's output) and return the path of its summary.md."""
    from swarmtrain.scenarios.plots import plot_loss, plot_members, plot_phases

    folder = Path(folder)
    run, events, rows = load_run(folder)
    with open(folder / "metrics.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    summary = summarize(run, events, rows)
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    plot_loss(rows, folder / "loss.png")
    plot_members(run, events, rows, folder / "members.png")
    phases = plot_phases(rows, folder / "phases.png")
    text = markdown(summary, Path(run.get("scenario", "scenario.toml")).name, phases)
    (folder / "summary.md").write_text(text, encoding="utf-8")
    return folder / "summary.md"
