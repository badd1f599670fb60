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


@cli.command()
@click.option("--max-time", type=float, default=90.0, show_default=True, help="Seconds of training.")
def demo(max_time: float) -> None:
    """Train the default small model on the Python standard library source for a short time budget.

    Needs no network and no download; writes its run to a fresh runs/demo-<time> directory.
    """
    import time

    from swarmtrain.train import run_training

    run_dir = f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}"
    run_training(resolve(None, (), **{"run_dir": run_dir, "train.max_time": max_time}))


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


def main(argv: list[str] | None = None) -> None:
    """Entry point: user-facing errors print as one paragraph and exit 2, without a traceback."""
    try:
        cli.main(args=argv, prog_name="swarmtrain", standalone_mode=False)
    except SwarmtrainError as exc:
        Console(stderr=True, highlight=False, soft_wrap=True).print(str(exc), style="red", markup=False)
        sys.exit(2)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
