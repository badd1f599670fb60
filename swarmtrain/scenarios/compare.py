"""Several scenario runs side by side: one table and one plot of held-out loss against time, tokens and bytes.

    swarmtrain scenario compare runs/links-100mbit runs/links-unlimited --out runs/links-compare

Each RUN is a folder ``swarmtrain scenario run`` wrote. A run's curve is, at each round row any node logged, the
mean over the node processes still alive of the latest held-out bpb each logged, against the wall time, the tokens
and the bytes the whole swarm had trained and sent by then.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from swarmtrain.scenarios.report import load_run, percent, summarize
from swarmtrain.scenarios.spec import ScenarioError


def curve(run: dict[str, Any], rows: list[dict[str, Any]]) -> list[tuple[float, int, int, float]]:
    """(t, tokens so far, bytes so far, swarm bpb) at each round row of a run's merged rows (sorted by time); the
    swarm bpb is the mean over the node processes still alive of the latest held-out bpb each logged."""
    ended = {
        (life["node"], life["incarnation"]): (life["ended"] or run["ended"]) - run["started"] for life in run["nodes"]
    }
    latest: dict[tuple[str, int], float] = {}
    tokens = sent = 0
    points = []
    for r in rows:
        if r["kind"] != "round":
            continue
        tokens, sent = tokens + r["tokens"], sent + r["bytes_sent"]
        if r.get("bpb") is not None:
            latest[(r["node"], r["incarnation"])] = r["bpb"]
        live = [bpb for life, bpb in latest.items() if ended[life] >= r["t"]]
        if live:
            points.append((r["t"], tokens, sent, statistics.fmean(live)))
    return points


def compare(folders: list[Path], out: Path) -> Path:
    from swarmtrain.scenarios.plots import plt, save_loss_axes  # matplotlib (Agg) only when plotting

    out.mkdir(parents=True, exist_ok=True)
    lines: list[tuple[str, str]] = []  # each run's row, and its bpb by part ("" without data.eval_parts)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    for folder in folders:
        if not (folder / "run.json").exists():
            raise ScenarioError(
                f"scenario error: {folder} is not a scenario run (no run.json); name the --out folders of "
                "`swarmtrain scenario run`."
            )
        run, events, rows = load_run(folder)
        s = summarize(run, events, rows)
        durations = [r["duration_s"] for r in rows if r["kind"] == "round" and r["group_size"] > 1]
        step = f"{statistics.median(durations):.2f}" if durations else "-"
        bpb = "-" if s["final_bpb_mean"] is None else f"{s['final_bpb_mean']:.4f}"
        outcomes = f"{s['rounds_applied']} / {s['rounds_fallback']} / {s['rounds_diverged']}"
        parts = ", ".join(f"{name} {v:.4f}" for name, v in s["final_bpb_parts_mean"].items())
        lines.append((
            f"| {folder.name} | {bpb} | {s['wall_s']:.1f} | {s['tokens']:,} | {s['bytes_sent'] / 1e6:.1f} | "
            f"{outcomes} | {step} | {s['utilisation']:.1%} | {percent(s['utilisation_training'])} |", parts
        ))  # fmt: skip
        points = curve(run, rows)
        for ax, x in zip(axes, (0, 1, 2), strict=True):
            scale = 1e6 if x == 2 else 1
            ax.plot([p[x] / scale for p in points], [p[3] for p in points], marker=".", label=folder.name)
    save_loss_axes(fig, axes, "held-out bits per byte (mean over nodes)", out / "compare.png")
    note = (
        "(median outer step: the outer step's duration in rounds with a group of two or more; utilisation: inner "
        "steps over the nodes' lifetimes; in training: over inner steps and the trainer's idle time between them)"
    )
    by_part = any(parts for _, parts in lines)  # a column only where some run has data.eval_parts
    header = [
        "| run | final bpb (mean) | wall s | tokens | MB sent | rounds applied / fallback / diverged "
        "| median outer step s | utilisation | in training |" + (" held-out bpb by part |" if by_part else ""),
        "|---" * (10 if by_part else 9) + "|",
    ]
    table = [row + (f" {parts or '-'} |" if by_part else "") for row, parts in lines]
    text = "\n".join([*header, *table, "", note, "", "![compare](compare.png)", ""])
    (out / "compare.md").write_text(text, encoding="utf-8")
    return out / "compare.md"
