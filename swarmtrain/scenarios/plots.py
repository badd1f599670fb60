"""The report's PNG plots (matplotlib, Agg backend: no display needed).

- ``loss.png``: held-out bits per byte of each node against wall time, the swarm's tokens so far and the swarm's
  bytes sent so far (all nodes, at the moment the row was logged);
- ``members.png``: how many nodes were live (running or finishing a leave) over time, the size of each logged
  round's group, and every timeline event as a marked vertical line;
- ``phases.png``: per round, the median over nodes of the inner steps and of each phase of the outer step.
"""

from __future__ import annotations

import statistics
from itertools import accumulate
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LIVE = {"start": "running", "join": "running", "resume": "running", "pause": "paused", "kill": "gone",
        "leave": "leaving", "stop": "leaving", "exit": "gone"}  # fmt: skip
MARKED = ("join", "leave", "kill", "pause", "resume")
COLOURS = {"join": "tab:green", "leave": "tab:blue", "kill": "tab:red", "pause": "tab:orange", "resume": "tab:olive"}


def _label(row: dict[str, Any]) -> str:
    return row["node"] if row["incarnation"] == 1 else f"{row['node']}.{row['incarnation']}"


def plot_loss(rows: list[dict[str, Any]], path: Path) -> None:
    rounds = [r for r in rows if r["kind"] == "round"]  # sorted by time
    tokens = list(accumulate(r["tokens"] for r in rounds))
    sent = list(accumulate(r["bytes_sent"] for r in rounds))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    for name in dict.fromkeys(_label(r) for r in rounds):
        mine = [i for i, r in enumerate(rounds) if _label(r) == name and r.get("bpb") is not None]
        bpb = [rounds[i]["bpb"] for i in mine]
        axes[0].plot([rounds[i]["t"] for i in mine], bpb, marker=".", label=name)
        axes[1].plot([tokens[i] for i in mine], bpb, marker=".", label=name)
        axes[2].plot([sent[i] / 1e6 for i in mine], bpb, marker=".", label=name)
    save_loss_axes(fig, axes, "held-out bits per byte", path)


def save_loss_axes(fig: Any, axes: Any, ylabel: str, path: Path) -> None:
    """Label the three loss panels (against wall time, tokens and bytes sent) and write the figure to ``path``."""
    axes[0].set_ylabel(ylabel)
    for ax, xlabel in zip(axes, ("wall time (s)", "tokens trained, all nodes", "MB sent, all nodes"), strict=True):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def members_over_time(events: list[dict[str, Any]]) -> list[tuple[float, int]]:
    """(t, live nodes) after each event: running or finishing a graceful leave counts as live."""
    state: dict[str, str] = {}
    life: dict[str, int] = {}
    steps = [(0.0, 0)]
    for e in events:
        if e["action"] == "start":
            life[e["node"]] = e.get("incarnation", 1)
        elif e["action"] == "exit" and e.get("incarnation", 1) != life.get(e["node"]):
            continue  # an earlier process of a node that is back already
        if e["node"] is not None and e["action"] in LIVE and not e.get("skipped"):
            state[e["node"]] = LIVE[e["action"]]
            steps.append((e["t"], sum(s in ("running", "leaving") for s in state.values())))
    return steps


def plot_members(run: dict[str, Any], events: list[dict[str, Any]], rows: list[dict[str, Any]], path: Path) -> None:
    steps = members_over_time(events)
    end = run["ended"] - run["started"]
    fig, ax = plt.subplots(figsize=(12, 4))
    ax.step([t for t, _ in steps] + [end], [n for _, n in steps] + [steps[-1][1]], where="post", label="live nodes")
    rounds = [r for r in rows if r["kind"] == "round"]
    ax.scatter(
        [r["t"] for r in rounds], [r["group_size"] for r in rounds], s=12, c="grey", label="group size of a round"
    )
    top = max([n for _, n in steps] + [r["group_size"] for r in rounds] + [1])
    for e in events:
        if e["action"] in MARKED and e["node"] is not None:
            ax.axvline(e["t"], color=COLOURS[e["action"]], alpha=0.6, linestyle="--")
            ax.text(e["t"], top + 0.3, f"{e['action']} {e['node']}", rotation=90, fontsize=7, va="bottom")
    ax.set_ylim(0, top + 2.5)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("nodes")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def phase_table(rows: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per round: the median over the nodes' rows of inner_s and of each phase they logged."""
    by_round: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        if r["kind"] == "round" and r.get("phases"):
            by_round.setdefault(r["round"], []).append(r)
    table = {}
    for k, here in sorted(by_round.items()):
        names = list(dict.fromkeys(p for r in here for p in r["phases"]))
        table[k] = {"inner_s": statistics.median(r.get("inner_s", 0.0) for r in here)}
        table[k].update({p: statistics.median(r["phases"].get(p, 0.0) for r in here) for p in names})
    return table


def plot_phases(rows: list[dict[str, Any]], path: Path) -> bool:
    """Stacked bars of each round's phases; False (and no file) when no row logged phases."""
    table = phase_table(rows)
    if not table:
        return False
    names = list(dict.fromkeys(p for phases in table.values() for p in phases))
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(table) + 3), 4))
    bottom = [0.0] * len(table)
    for name in names:
        heights = [phases.get(name, 0.0) for phases in table.values()]
        ax.bar(list(table), heights, bottom=bottom, label=name.removesuffix("_s"))
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_xlabel("round")
    ax.set_ylabel("seconds (median over nodes)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
