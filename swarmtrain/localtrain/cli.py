"""``swarmtrain localtrain ...``: the click group registered by ``swarmtrain.cli``.

    swarmtrain localtrain bench --stages 2 --threads 2 --method rgc-async --method broadcast-async \\
        --seeds 3 --steps 60 --set model.depth=24 --set model.width=128 --out bench.json
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from swarmtrain.localtrain.bench import BenchReport, BenchSpec, RunResult, default_timing_skip, run_bench
from swarmtrain.localtrain.config import METHODS, load_localtrain_config
from swarmtrain.localtrain.stats import PairedGap


@click.group("localtrain")
def localtrain_group() -> None:
    """Bounded-horizon local training on this machine's cores (stages, shared-memory rings, RGC)."""


@localtrain_group.command("bench")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML config file.")
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a config key, e.g. --set model.depth=24 or --set localtrain.serial_lag=2 (repeatable).",
)
@click.option("--data", type=str, help="Text file, folder of text files, or enwik8 (default: Python stdlib source).")
@click.option(
    "--method",
    "methods",
    multiple=True,
    type=click.Choice(METHODS),
    help="Method to compare with global backprop (repeatable; default: rgc-async and broadcast-async).",
)
@click.option("--stages", type=int, help="Stages the blocks are cut into (localtrain.stages).")
@click.option("--threads", type=int, help="Total torch threads for every method (localtrain.threads; 0 = all cores).")
@click.option("--ring-depth", type=int, help="Slots per ring, which also bounds readout staleness.")
@click.option("--pin/--no-pin", default=None, help="Pin stage processes to cores (localtrain.pin_cores).")
@click.option("--seeds", type=int, default=3, show_default=True, help="Paired seeds per method: F..F+N-1.")
@click.option(
    "--first-seed", type=int, default=0, show_default=True, help="F, the first seed (more seeds for an earlier run)."
)
@click.option("--steps", type=int, default=60, show_default=True, help="Optimizer steps per run (train.max_steps).")
@click.option("--timing-skip", type=int, help="Steps left out of the tokens/s window (default: pipeline fill + 2).")
@click.option(
    "--eval-every",
    type=int,
    default=0,
    show_default=True,
    help="Also measure held-out bpb every N steps, for the gap at equal wall time (0: only at the end).",
)
@click.option("--margin", type=float, default=1.0, show_default=True, help="Non-inferiority margin in percent.")
@click.option("--out", type=click.Path(dir_okay=False), help="Also write every run and the summary as JSON here.")
def bench(
    config_path: str | None,
    overrides: tuple[str, ...],
    data: str | None,
    methods: tuple[str, ...],
    stages: int | None,
    threads: int | None,
    ring_depth: int | None,
    pin: bool | None,
    seeds: int,
    first_seed: int,
    steps: int,
    timing_skip: int | None,
    eval_every: int,
    margin: float,
    out: str | None,
) -> None:
    """Compare local-training methods with global backprop: tokens/s, peak PSS, held-out bpb, quality gap.

    Every run is a fresh process tree with the same model, data, seed and total thread budget.
    """
    flags = {
        "data.path": data,
        "localtrain.stages": stages,
        "localtrain.threads": threads,
        "localtrain.ring_depth": ring_depth,
        "localtrain.pin_cores": pin,
    }
    config, lt = load_localtrain_config(config_path, overrides, flags)
    if steps < 2 or seeds < 1 or first_seed < 0:
        raise click.BadParameter("--steps must be >= 2, --seeds >= 1 and --first-seed >= 0")
    skip = default_timing_skip(lt, steps) if timing_skip is None else timing_skip
    if not 1 <= skip < steps:
        raise click.BadParameter(f"--timing-skip must lie between 1 and --steps - 1 ({steps - 1})")
    if eval_every < 0:
        raise click.BadParameter("--eval-every must be 0 (evaluate at the end only) or a number of steps")
    config.train.max_steps = steps
    spec = BenchSpec(
        config=config,
        lt=lt,
        methods=methods or ("rgc-async", "broadcast-async"),
        seeds=tuple(range(first_seed, first_seed + seeds)),
        steps=steps,
        timing_skip=skip,
        eval_every=eval_every,
    )
    console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 140)
    m = config.model
    console.print(
        f"localtrain bench: depth {m.depth}, width {m.width}, context {m.context}, batch {config.train.batch_size}, "
        f"{steps} steps (tokens/s after step {skip}), seeds {list(spec.seeds)}, {lt.stages} stages, "
        f"threads {lt.threads or 'all'}, ring depth {lt.ring_depth}"
    )
    report = run_bench(spec, on_result=lambda r: console.print(run_line(r), markup=False))
    print_report(report, console, margin)
    if out:
        Path(out).write_text(json.dumps(report.to_json(), indent=2, default=json_default) + "\n")
        console.print(f"wrote {out}")


def json_default(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return str(value)


def run_line(r: RunResult) -> str:
    if r.error:
        return f"  {r.method:<16} seed {r.seed}: FAILED {r.error}"
    leaked = f", LEAKED {r.leaked_segments}" if r.leaked_segments else ""
    return (
        f"  {r.method:<16} seed {r.seed}: {r.tokens_per_s:8.0f} tok/s, peak PSS {r.peak_pss_mib:6.0f} MiB "
        f"({r.processes} proc), bpb {r.bpb:.4f}, start-up {r.startup_s:.1f} s, background load "
        f"{r.other_cores:.2f} cores{leaked}"
    )


def _gap_cells(gap: PairedGap | None, margin: float) -> tuple[str, str]:
    """The gap's mean and its one-sided 95 % upper bound with the verdict against ``margin``."""
    if gap is None:
        return "", ""
    if math.isinf(gap.upper95_pct):
        return f"{gap.mean_pct:+.3f}", "n/a (1 seed)"
    return f"{gap.mean_pct:+.3f}", f"{gap.upper95_pct:+.3f}" + (" pass" if gap.passes(margin) else " FAIL")


def print_report(report: BenchReport, console: Console, margin: float = 1.0) -> None:
    table = Table(title="localtrain vs global backprop (same model, data, seeds, threads)")
    columns = ("method", "runs", "tokens/s", "x BP", "x BP (median step)", "peak PSS MiB", "PSS x BP", "bpb")
    timed = any(s.gap_time is not None for s in report.summaries)
    gaps = ("gap %", "95% UB %", "gap % equal time", "95% UB %") if timed else ("gap %", "95% UB %")
    for column in (*columns, *gaps, "bg load"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for s in report.summaries:
        cells = _gap_cells(s.gap, margin) + (_gap_cells(s.gap_time, margin) if timed else ())
        table.add_row(
            s.method,
            str(s.runs),
            f"{s.tokens_per_s:.0f}",
            f"{s.throughput_ratio:.3f}",
            f"{s.throughput_ratio_median:.3f}",
            f"{s.peak_pss_mib:.0f}",
            f"{s.pss_ratio:.3f}",
            f"{s.bpb_mean:.4f}",
            *cells,
            f"{s.other_cores:.2f}",
        )
    console.print(table)
    if timed:
        console.print(
            "gap: at equal steps (the final models); equal time: both runs read at the training time at which the "
            "faster one ended (positive: worse than global backprop)"
        )
    rows = [(s.method, b) for s in report.summaries for b in s.breakdown]
    if rows:
        detail = Table(title="stage time shares (of each stage's wall time; mean over seeds)")
        for column in ("method", "stage", "busy", "wait in", "wait out", "wait readout", "comm", "lag mean/max"):
            detail.add_column(column, justify="left" if column == "method" else "right")
        for method, b in rows:
            detail.add_row(
                method,
                str(b["stage"]),
                f"{b['busy']:.1%}",
                f"{b['wait_input']:.1%}",
                f"{b['wait_output']:.1%}",
                f"{b['wait_readout']:.1%}",
                f"{b['comm']:.1%}",
                f"{b['lag_mean']:.2f}/{b['lag_max']:.0f}",
            )
        console.print(detail)
    for s in report.summaries:
        for i, r in enumerate(s.readout):
            console.print(
                f"{s.method}: upstream stage {i} readout gradient vs owner's: cosine mean {r['cos_mean']:+.3f}, "
                f"min {r['cos_min']:+.3f}, negative {r['cos_negative_frac']:.1%}; version lag mean "
                f"{r['lag_mean']:.2f}, max {r['lag_max']:.0f}"
            )
