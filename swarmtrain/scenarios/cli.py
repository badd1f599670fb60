"""``swarmtrain scenario``: check a scenario file, run it on this machine, and write its report.

swarmtrain scenario check scenarios/churn-drop-one.toml
swarmtrain scenario run scenarios/churn-drop-one.toml --out runs/churn
"""

from __future__ import annotations

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
