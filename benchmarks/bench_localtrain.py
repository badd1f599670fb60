"""localtrain vs global backprop on this machine: a deep configuration and a small fast one, in one run.

    python benchmarks/bench_localtrain.py --out runs/bench-localtrain.json
    python benchmarks/bench_localtrain.py --preset fast --seeds 5 --data /tmp/english.txt
    python benchmarks/bench_localtrain.py --preset long        # 2,000 steps x 3 seeds: 20-50 min on 2 cores
    python benchmarks/bench_localtrain.py --preset many-core   # for a machine with 16 cores or more
    python benchmarks/bench_localtrain.py --preset long --first-seed 3 --out runs/more.json   # seeds 3-5
    python benchmarks/bench_localtrain.py --combine runs/long.json runs/more.json   # one table of seeds 0-5

Each preset is ``swarmtrain localtrain bench`` with fixed settings (the command line it matches is printed):
``deep`` is the issue's 24-layer width-128 model, ``fast`` an 8-layer model whose steps are short enough for
more steps and seeds. Both use S=2 stages and the same total thread budget for every method; tokens/s, peak
process-tree PSS, held-out bits per byte and the paired quality gap (with its one-sided 95 % upper bound) are
reported against global backprop. On a shared machine other work distorts throughput: run it when idle.

The long-run protocol (``long`` on 2 cores, ``many-core`` on 16): thousands of steps, held-out bpb every 250
steps, and the gap both at equal steps and at equal wall time (both runs read when the faster one ended).
"both" runs ``deep`` and ``fast``.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from rich.console import Console

from swarmtrain.localtrain.bench import BenchSpec, combine, default_timing_skip, run_bench
from swarmtrain.localtrain.cli import json_default, print_report, run_line
from swarmtrain.localtrain.config import available_cores, load_localtrain_config

# The long-run protocol's model and batch (depth aside): short steps, so that thousands of them fit in an hour.
LONG_RUN = [
    "model.width=128",
    "model.heads=4",
    "model.context=128",
    "train.batch_size=8",
    "train.warmup_steps=50",
    "train.eval_batches=8",
]
PRESETS: dict[str, dict[str, object]] = {
    "deep": {
        "overrides": [
            "model.depth=24",
            "model.width=128",
            "model.heads=4",
            "model.context=128",
            "train.batch_size=8",
            "train.warmup_steps=10",
            "train.eval_batches=8",
        ],
        "steps": 30,
        "methods": ["rgc-async"],
    },
    "fast": {
        "overrides": [
            "model.depth=8",
            "model.width=128",
            "model.heads=4",
            "model.context=128",
            "train.batch_size=16",
            "train.warmup_steps=10",
            "train.eval_batches=8",
        ],
        "steps": 40,
        "methods": ["rgc-async", "broadcast-async"],
    },
    "long": {
        "overrides": ["model.depth=8", *LONG_RUN],
        "steps": 2000,
        "eval_every": 250,
        "methods": ["rgc-async"],
    },
    "many-core": {
        "overrides": ["model.depth=24", *LONG_RUN],
        "steps": 2000,
        "eval_every": 250,
        "stages": 4,
        "threads": 16,
        "methods": ["rgc-async"],
    },
}
SHORT = ("deep", "fast")  # what "both" runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=[*PRESETS, "both"], default="both", help="both: deep and fast.")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="Seeds F..F+N-1 (more seeds for an earlier run).")
    parser.add_argument("--steps", type=int, help="Override the preset's step count.")
    parser.add_argument("--threads", type=int, help="Total thread budget (default: the preset's, else 2).")
    parser.add_argument("--stages", type=int, help="Stages (default: the preset's, else 2).")
    parser.add_argument("--method", action="append", help="Methods besides global-bp (default: the preset's).")
    parser.add_argument("--data", help="Corpus (default: the Python standard library source).")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="Extra KEY=VALUE overrides.")
    parser.add_argument("--out", type=Path, help="Write all results as JSON here.")
    parser.add_argument(
        "--no-zygote", action="store_true", help="Spawn the stages (the old way), not fork them from a zygote."
    )
    parser.add_argument(
        "--combine", nargs="+", type=Path, metavar="JSON", help="Runs nothing: one table from these --out files."
    )
    args = parser.parse_args()
    if args.combine:
        combine_files(args.combine, args.out)
        return
    if args.seeds < 1 or args.first_seed < 0:
        parser.error("--seeds must be >= 1 and --first-seed >= 0")
    console = Console(highlight=False, soft_wrap=True, width=140)
    reports = {}
    for name in SHORT if args.preset == "both" else [args.preset]:
        preset = PRESETS[name]
        methods = tuple(args.method or preset["methods"])  # type: ignore[arg-type]
        overrides = [*preset["overrides"], *args.overrides]  # type: ignore[misc]
        steps = args.steps or int(preset["steps"])  # type: ignore[call-overload]
        stages = args.stages or int(preset.get("stages", 2))  # type: ignore[call-overload]
        threads = args.threads or int(preset.get("threads", 2))  # type: ignore[call-overload]
        eval_every = int(preset.get("eval_every", 0))  # type: ignore[call-overload]
        cores = len(available_cores())
        if threads > cores:
            console.print(
                f"[yellow]{name} runs {threads} threads and this process may use {cores} cores: "
                "the threads share cores, so its throughput says little (--threads N to fit them)[/yellow]"
            )
        flags = {"data.path": args.data, "localtrain.stages": stages, "localtrain.threads": threads}
        config, lt = load_localtrain_config(None, overrides, flags)
        config.train.max_steps = steps
        skip = default_timing_skip(lt, steps)
        command = ["swarmtrain", "localtrain", "bench", "--stages", str(stages), "--threads", str(threads)]
        command += [f"--method={m}" for m in methods] + ["--seeds", str(args.seeds), "--steps", str(steps)]
        command += ["--first-seed", str(args.first_seed)] if args.first_seed else []
        command += ["--eval-every", str(eval_every)] if eval_every else []
        command += [f"--set={o}" for o in overrides] + ([f"--data={args.data}"] if args.data else [])
        console.print(f"[bold]{name}[/bold]: {shlex.join(command)}")
        seeds = tuple(range(args.first_seed, args.first_seed + args.seeds))
        spec = BenchSpec(config, lt, methods, seeds, steps, skip, zygote=not args.no_zygote, eval_every=eval_every)
        report = run_bench(spec, on_result=lambda r: console.print(run_line(r), markup=False))
        print_report(report, console)
        reports[name] = report.to_json()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(reports, indent=2, default=json_default) + "\n")
        console.print(f"wrote {args.out}")


def combine_files(paths: list[Path], out: Path | None) -> None:
    """Print each preset's table over the runs of every file (the same bench, other seeds)."""
    console = Console(highlight=False, soft_wrap=True, width=140)
    try:
        loaded = [json.loads(path.read_text()) for path in paths]
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--combine: cannot read a report: {exc}") from None
    reports = {}
    for name in loaded[0]:
        try:
            report = combine([file[name] for file in loaded])
        except KeyError:
            raise SystemExit(f"--combine: preset {name} is not in every file") from None
        except (ValueError, TypeError) as exc:
            raise SystemExit(f"--combine: preset {name}: {exc}") from None
        console.print(f"[bold]{name}[/bold]: seeds {report.spec['seeds']} from {len(paths)} files")
        print_report(report, console)
        reports[name] = report.to_json()
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(reports, indent=2, default=json_default) + "\n")
        console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
