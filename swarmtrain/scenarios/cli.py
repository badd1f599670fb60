"""``swarmtrain scenario``: check a scenario file, run it on this machine, and write its report.

swarmtrain scenario check scenarios/churn-drop-one.toml
swarmtrain scenario run scenarios/churn-drop-one.toml --out runs/churn
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from swarmtrain.scenarios.spec import load_spec


@click.group("scenario")
def scenario_group() -> None:
    """Scripted swarms on this machine: real node processes, a timeline of joins, leaves, kills and pauses, and a
    report with plots. `swarmtrain scenario check FILE` validates a scenario file without running it."""


@scenario_group.command()
@click.argument("path", type=click.Path(dir_okay=False))
def check(path: str) -> None:
    """Validate the scenario file PATH without running it (errors name the line and key; exit code 2)."""
    spec = load_spec(path)
    start = [n.name for n in spec.nodes if n.start]
    length = f"{spec.rounds} rounds" if spec.rounds else f"{spec.wall_time_s:g} s"
    click.echo(
        f"{path}: ok: {len(spec.nodes)} nodes ({len(start)} at the start), {length}, {len(spec.events)} events, "
        f"{len(spec.repeats)} repeating events"
    )


@scenario_group.command()
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--out", type=str, help="Folder for the nodes' runs and the report (default: runs/<name>-<time>).")
def run(path: str, out: str | None) -> None:
    """Run the scenario PATH: a bootstrap peer and real node processes on loopback, the timeline applied, live
    progress lines, then a report (summary.md, merged metrics, plots) in the --out folder. Ctrl+C stops every
    process it started."""
    from swarmtrain.scenarios.report import write_report
    from swarmtrain.scenarios.runner import run_scenario

    spec = load_spec(path)
    folder = Path(out or f"runs/{Path(path).stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        run_scenario(spec, folder)
    except KeyboardInterrupt:
        if (folder / "run.json").exists():  # every process is stopped by now; report what ran
            click.echo(f"stopped; the report of what ran: {write_report(folder)}", err=True)
        raise
    summary = write_report(folder)
    click.echo(f"report: {summary}")


@scenario_group.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(file_okay=False, exists=True))
@click.option(
    "--out", type=str, default="runs/compare", show_default=True, help="Folder for compare.md and compare.png."
)
def compare(runs: tuple[str, ...], out: str) -> None:
    """Overlay several runs (--out folders of `scenario run`): a Markdown table of their summaries and a plot of
    held-out loss against wall time, tokens and bytes sent."""
    from swarmtrain.scenarios.compare import compare as compare_runs

    path = compare_runs([Path(r) for r in runs], Path(out))
    click.echo(path.read_text())
