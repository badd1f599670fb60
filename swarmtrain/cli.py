"""The ``swarmtrain`` command line.

swarmtrain train --data notes.txt --max-time 300
swarmtrain config
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import click
from rich.console import Console

from swarmtrain.config import Config, known_keys, load_config
from swarmtrain.errors import SwarmtrainError
from swarmtrain.localtrain.cli import localtrain_group
from swarmtrain.logs import LOG_FORMATS, LogFormat, current_log_format, use_log_format
from swarmtrain.scenarios.cli import scenario_group
from swarmtrain.signals import stop_on_signals

_common_options: list[Callable[[Callable[..., Any]], Callable[..., Any]]] = [
    click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML config file."),
    click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help="Override one config key, e.g. --set train.lr=0.001 (repeatable). `swarmtrain config` lists the keys.",
    ),
    click.option(
        "--data", type=str, help="Text file, folder of text files, or enwik8 (default: Python stdlib source)."
    ),
    click.option("--run-dir", type=str, help="Directory for checkpoints, resolved config and metrics."),
]


def common_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(_common_options):
        func = option(func)
    return func


def resolve(config_path: str | None, overrides: tuple[str, ...], **flags: Any) -> Config:
    """Config from file, environment, --set and the command's own flags, in that order."""
    return load_config(config_path, overrides, flags)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("-v", "--verbose", is_flag=True, help="Log debug messages.")
def cli(verbose: bool) -> None:
    """swarmtrain: train one model together on ordinary machines.

    Settings come from a TOML file (--config), SWARMTRAIN_ environment variables
    (SWARMTRAIN_TRAIN__LR=0.001) and flags, later ones winning. Run `swarmtrain config` to list every setting.
    """
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")


@cli.command()
@common_options
@click.option("--max-steps", type=int, help="Stop after this many steps (train.max_steps).")
@click.option("--max-time", type=float, help="Stop after this many seconds of training (train.max_time).")
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in the run directory.")
def train(
    config_path: str | None,
    overrides: tuple[str, ...],
    data: str | None,
    run_dir: str | None,
    max_steps: int | None,
    max_time: float | None,
    resume: bool,
) -> None:
    """Train the model on one machine, with progress, evaluation and checkpoints.

    The last line printed is the final held-out bits per byte, e.g. `held-out bpb 2.41`.
    """
    from swarmtrain.train import run_training

    config = resolve(
        config_path,
        overrides,
        **{"data.path": data, "run_dir": run_dir, "train.max_steps": max_steps, "train.max_time": max_time},
    )
    run_training(config, resume=resume)


_swarm_options: list[Callable[[Callable[..., Any]], Callable[..., Any]]] = [
    click.option("--join", multiple=True, metavar="MADDR", help="Address of a peer in the swarm (repeatable)."),
    click.option(
        "--host", multiple=True, metavar="MADDR", help="Listen address (node.host), e.g. /ip4/0.0.0.0/tcp/31337."
    ),
    click.option(
        "--announce", multiple=True, metavar="MADDR", help="Address other peers should dial (node.announce)."
    ),
]


def swarm_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(_swarm_options):
        func = option(func)
    return func


log_format_option = click.option(
    "--log-format", type=click.Choice(LOG_FORMATS), default="plain", show_default=True,
    help="Log lines on stderr: plain text, or one JSON object per line (time, level, logger, message).",
)  # fmt: skip


def _addrs(join: tuple[str, ...], host: tuple[str, ...], announce: tuple[str, ...]) -> dict[str, Any]:
    return {"node.join": list(join) or None, "node.host": list(host) or None, "node.announce": list(announce) or None}


@cli.command()
@common_options
@swarm_options
@click.option("--rounds", type=int, help="Stop after this many outer rounds (node.rounds).")
@click.option("--max-time", type=float, help="Stop after this many seconds (train.max_time).")
@click.option("--resume", is_flag=True, help="Continue this node from the latest checkpoint in the run directory.")
@log_format_option
def node(
    config_path: str | None, overrides: tuple[str, ...], data: str | None, run_dir: str | None,
    join: tuple[str, ...], host: tuple[str, ...], announce: tuple[str, ...], rounds: int | None,
    max_time: float | None, resume: bool, log_format: LogFormat,
) -> None:  # fmt: skip
    """Run one swarm node: train H inner steps, average with peers, repeat.

    Without --join it starts a new swarm and prints the line other machines use to join it.
    Ctrl+C leaves gracefully (checkpoint written); a second Ctrl+C exits at once. --resume continues from the
    run directory's latest checkpoint (theta_g, outer and inner optimizer state, round), then catches up with
    the swarm if it moved on.
    """
    from swarmtrain.node.commands import run_node

    use_log_format(log_format)
    flags = {"data.path": data, "run_dir": run_dir, "node.rounds": rounds, "train.max_time": max_time}
    run_node(resolve(config_path, overrides, **flags, **_addrs(join, host, announce)), resume=resume)


@cli.command()
@common_options
@swarm_options
@log_format_option
def bootstrap(
    config_path: str | None, overrides: tuple[str, ...], data: str | None, run_dir: str | None,
    join: tuple[str, ...], host: tuple[str, ...], announce: tuple[str, ...], log_format: LogFormat,
) -> None:  # fmt: skip
    """Run a DHT-only peer (no training): a stable entry point for a public or private swarm."""
    from swarmtrain.node.commands import run_bootstrap

    use_log_format(log_format)
    run_bootstrap(resolve(config_path, overrides, **{"run_dir": run_dir}, **_addrs(join, host, announce)))


@cli.command()
@common_options
@swarm_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def status(
    config_path: str | None, overrides: tuple[str, ...], data: str | None, run_dir: str | None,
    join: tuple[str, ...], host: tuple[str, ...], announce: tuple[str, ...], as_json: bool,
) -> None:  # fmt: skip
    """Print the peers of a swarm (reached through --join) as a table or JSON."""
    from swarmtrain.node.commands import show_status

    show_status(resolve(config_path, overrides, **_addrs(join, host, announce)), as_json)


@cli.command()
@common_options
@swarm_options
@click.option("--port", type=int, default=8080, show_default=True, help="Serve the page on this port (0: any).")
@click.option("--http-host", default="127.0.0.1", show_default=True, help="Serve on this address (0.0.0.0: all).")
@click.option("--poll", type=float, default=2.0, show_default=True, help="Seconds between looks at the swarm.")
def dashboard(
    config_path: str | None, overrides: tuple[str, ...], data: str | None, run_dir: str | None,
    join: tuple[str, ...], host: tuple[str, ...], announce: tuple[str, ...], port: int, http_host: str, poll: float,
) -> None:  # fmt: skip
    """Serve a web dashboard of the whole swarm reached through --join, without running a node: every peer's
    state and why, round, tokens/s and share of tokens; the swarm's loss, bpb and bytes per round; joins, leaves,
    state changes and bans. A private swarm needs its key (--set node.swarm_key=PATH). Ctrl+C stops it."""
    from swarmtrain.node.commands import run_dashboard

    if poll <= 0:
        raise click.BadParameter(f"--poll must be a positive number of seconds, not {poll}", param_hint="--poll")
    run_dashboard(resolve(config_path, overrides, **_addrs(join, host, announce)), http_host, port, poll)


@cli.command()
@common_options
@swarm_options
def doctor(
    config_path: str | None, overrides: tuple[str, ...], data: str | None, run_dir: str | None,
    join: tuple[str, ...], host: tuple[str, ...], announce: tuple[str, ...],
) -> None:  # fmt: skip
    """Check this machine and config before running a node: run directory and disk, data, ports, the p2p daemon,
    the announced address, and (with --join) the swarm's settings against this config. Each failure names its
    fix; the exit status is 1 when one fails."""
    from swarmtrain.node.doctor import run_checks

    flags = {"data.path": data, "run_dir": run_dir}
    config = resolve(config_path, overrides, **flags, **_addrs(join, host, announce))
    if not run_checks(config, lambda check: click.echo("\n".join(check.lines()))):
        sys.exit(1)


@cli.command()
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--swarm", is_flag=True, help="Write a new swarm key (node.swarm_key) instead of a peer identity.")
def keygen(path: str, swarm: bool) -> None:
    """Write a new private key to PATH; use it with --set node.identity=PATH to keep a fixed peer id.

    With --swarm, write a new swarm key: a private swarm is the nodes started with --set node.swarm_key=PATH
    (copy the file to each machine; anyone holding it can join).
    """
    from pathlib import Path

    from hivemind.p2p import P2P

    what = "a swarm key" if swarm else "an identity"
    if Path(path).exists():
        raise click.ClickException(f"{path} already exists; refusing to overwrite {what}")
    if swarm:
        from swarmtrain.net import write_swarm_key

        write_swarm_key(path)
        click.echo(f"wrote a new swarm key to {path}; start each node of the swarm with --set node.swarm_key={path}")
        return
    P2P.generate_identity(path)
    click.echo(f"wrote a new identity to {path}")


@cli.command()
@click.option("--nodes", type=int, default=4, show_default=True, help="Node processes to start on loopback.")
@click.option("--rounds", type=int, default=5, show_default=True, help="Outer rounds to run.")
@click.option("--run-dir", type=str, help="Where the nodes write their runs (default: runs/demo-<time>).")
def demo(nodes: int, rounds: int, run_dir: str | None) -> None:
    """A whole swarm on this machine: NODES node processes on loopback train on the stdlib source.

    Shows each node's progress, then compares the swarm with one node given the same wall time, and the
    bytes each node sent with what synchronous data parallel would have sent for the same tokens.
    """
    import time

    from swarmtrain.node.demo import run_demo

    run_demo(nodes, rounds, run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")


@cli.command("config")
@common_options
@click.option("--keys", is_flag=True, help="List every key with its meaning instead of the resolved values.")
def show_config(
    config_path: str | None, overrides: tuple[str, ...], data: str | None, run_dir: str | None, keys: bool
) -> None:
    """Print the resolved config as TOML-like lines (or every key with its help text)."""
    config = resolve(config_path, overrides, **{"data.path": data, "run_dir": run_dir})
    console = Console(highlight=False)
    values = dict(_flatten(config.model_dump()))
    for key, help_text in known_keys().items():
        value = values.get(key)
        console.print(f"{key} = {value!r}" + (f"  # {help_text}" if keys else ""), soft_wrap=True)


def _flatten(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for key, value in tree.items():
        if isinstance(value, dict):
            items.extend(_flatten(value, f"{prefix}{key}."))
        else:
            items.append((f"{prefix}{key}", value))
    return items


cli.add_command(localtrain_group)
cli.add_command(scenario_group)


def main(argv: list[str] | None = None) -> None:
    """Entry point: user-facing errors print as one paragraph and exit 2, without a traceback."""
    try:
        with stop_on_signals():  # Ctrl+C, SIGTERM and SIGHUP stop every command gracefully, however it was started
            cli.main(args=argv, prog_name="swarmtrain", standalone_mode=False)
    except SwarmtrainError as exc:
        if current_log_format() == "json":
            logging.getLogger("swarmtrain").error(str(exc))
        else:
            Console(stderr=True, highlight=False, soft_wrap=True).print(str(exc), style="red", markup=False)
        sys.exit(2)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
