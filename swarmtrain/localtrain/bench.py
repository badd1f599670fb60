"""``swarmtrain localtrain bench``: methods side by side on the same model, data, seeds and thread budget.

    swarmtrain localtrain bench --stages 2 --threads 2 --method rgc-async --seeds 3 --steps 60 \\
        --set model.depth=24 --set model.width=128

Every (seed, method) pair runs in its own freshly spawned process tree, seeds in the outer loop so that slow
periods of a shared machine hit all methods alike; global backprop always runs as the reference. Per run:
tokens/s over the steps after ``timing_skip`` (start-up and pipeline fill excluded), peak process-tree PSS
sampled from ``/proc/<pid>/smaps_rollup`` over the whole run, held-out bits per byte of the final model, and
each stage's busy/waiting/communication time. Per method: the geometric mean of per-seed throughput and PSS
ratios to global backprop, and the paired relative quality gap with its one-sided 95 % upper bound.

Long runs (``eval_every``) also measure held-out bpb every ``eval_every`` steps (an async pipeline drains there
first), on a clock that counts only training. That gives a second paired gap, at equal wall time: per seed, both
runs are read at the time the faster one ended (the slower one's curve interpolated linearly between its
evaluations), so a method that trains faster is credited with the steps it gains.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

from swarmtrain.config import Config
from swarmtrain.localtrain.config import (
    ASYNC_METHODS,
    LocalTrainConfig,
    check_config,
    split_threads,
    thread_env,
    total_threads,
)
from swarmtrain.localtrain.pss import PssSampler
from swarmtrain.localtrain.shm import new_prefix, sweep
from swarmtrain.localtrain.stats import PairedGap, geomean_ratio, paired_gap

REFERENCE = "global-bp"


@dataclass(frozen=True)
class BenchSpec:
    config: Config
    lt: LocalTrainConfig
    methods: tuple[str, ...]
    seeds: tuple[int, ...]
    steps: int
    timing_skip: int
    pss_interval: float = 0.2
    run_timeout: float = 3600.0
    zygote: bool = True  # async methods fork their stages from a zygote (False: spawn them, the old way)
    eval_every: int = 0  # also measure held-out bpb every this many steps, for the equal-time gap (0: at the end)


@dataclass
class RunResult:
    method: str
    seed: int
    error: str | None = None
    tokens_per_s: float = 0.0  # over the timing window: tokens / wall time
    tokens_per_s_median: float = 0.0  # tokens per step / median step time: less sensitive to background bursts
    step_s_median: float = 0.0
    peak_pss_mib: float = 0.0
    processes: int = 0
    peak_detail: list[tuple[str, float]] = field(default_factory=list)
    other_cores: float = 0.0  # mean cores kept busy by processes outside the run (background load)
    bpb: float = float("nan")
    final_loss: float = float("nan")
    startup_s: float = 0.0
    zygote: bool = False  # the stages were forked from a zygote (sharing torch's pages), not spawned
    leaked_segments: list[str] = field(default_factory=list)
    breakdown: dict[str, Any] = field(default_factory=dict)
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # (step, training seconds, held-out bpb)
    train_s: float = 0.0  # seconds spent in training steps (evaluations not counted)


@dataclass
class MethodSummary:
    method: str
    runs: int
    tokens_per_s: float
    throughput_ratio: float
    throughput_ratio_median: float
    peak_pss_mib: float
    pss_ratio: float
    bpb_mean: float
    other_cores: float
    gap: PairedGap | None
    gap_time: PairedGap | None  # at equal wall time (long runs with ``eval_every`` only)
    breakdown: list[dict[str, float]]
    readout: list[dict[str, float]]


@dataclass
class BenchReport:
    spec: dict[str, Any]
    results: list[RunResult]
    summaries: list[MethodSummary]

    def to_json(self) -> dict[str, Any]:
        results = [asdict(r) for r in self.results]
        return {"spec": self.spec, "results": results, "summary": [asdict(s) for s in self.summaries]}


def default_timing_skip(lt: LocalTrainConfig, steps: int) -> int:
    """Steps left out of the throughput window: the pipeline fill plus a couple of warm-up steps."""
    return min(max(3, lt.ring_depth * (lt.stages - 1) + 2), max(1, steps // 2))


def _run_job(
    config_dump: dict[str, Any],
    lt_dump: dict[str, Any],
    steps: int,
    skip: int,
    prefix: str,
    conn: Any,
    parent: int,
    zygote: bool = True,
    eval_every: int = 0,
) -> None:
    """One (method, seed) run, in its own spawned process; sends a ``RunResult`` dict back at the end.

    The async methods fork their stages from a zygote started here before any torch op, so that the stages share
    torch's imported pages with this process (``swarmtrain.localtrain.zygote``).
    """
    from swarmtrain.localtrain.zygote import start_zygote

    config, lt = Config.model_validate(config_dump), LocalTrainConfig.model_validate(lt_dump)
    server = None
    if zygote and lt.method in ASYNC_METHODS:
        try:
            server = start_zygote(close_fds=[conn])
        except OSError as exc:  # cannot fork: the pipeline spawns its stages instead
            logging.getLogger(__name__).warning("no zygote (%s); spawning the stages", exc)

    from swarmtrain.data import load_corpus
    from swarmtrain.localtrain.errors import LocalTrainError
    from swarmtrain.localtrain.trainer import LocalTrainer
    from swarmtrain.train.trainer import evaluate_bpb

    result = RunResult(method=lt.method, seed=config.train.seed, zygote=server is not None)
    try:
        start = time.perf_counter()
        corpus = load_corpus(config.data)
        horizon = min(eval_every, steps) if eval_every else None
        with LocalTrainer(config, corpus, lt, prefix=prefix, horizon=horizon) as trainer:
            result.startup_s = time.perf_counter() - start
            ends = []  # the training clock at the end of each step
            clock = 0.0
            loss = float("nan")
            for step in range(1, steps + 1):
                began = time.perf_counter()
                loss = trainer.train_step()
                clock += time.perf_counter() - began
                ends.append(clock)
                if os.getppid() != parent:  # the benchmark died: do not train on as an orphan
                    raise LocalTrainError("the benchmark process that started this run is gone")
                if eval_every and step < steps and step % eval_every == 0:
                    result.curve.append((step, clock, trainer.evaluate()))  # the pipeline drained at its horizon
                    trainer.set_horizon(min(step + eval_every, steps))
            result.train_s = clock
            tokens_per_step = config.train.batch_size * config.model.context
            result.tokens_per_s = (steps - skip) * tokens_per_step / (ends[-1] - ends[skip - 1])
            window = ends[skip - 1 :]
            result.step_s_median = statistics.median(b - a for a, b in zip(window, window[1:], strict=False))
            result.tokens_per_s_median = tokens_per_step / result.step_s_median
            result.final_loss = loss
            result.breakdown = trainer.breakdown()
            model = trainer.model
        # Evaluate after the stages are gone, so that evaluation does not add to the training peak.
        result.bpb = evaluate_bpb(model, corpus.val, config)
        if eval_every:
            result.curve.append((steps, result.train_s, result.bpb))
    except BaseException as exc:  # reported to the parent, which prints it with the table
        result.error = f"{type(exc).__name__}: {exc}"
        result.breakdown = {"traceback": traceback.format_exc()}
        if isinstance(exc, KeyboardInterrupt):  # the stages are stopped and unlinked by now; leave quietly
            raise SystemExit(130) from None
    finally:
        if server is not None:
            server.close()
        with contextlib.suppress(Exception):
            conn.send(asdict(result))
        conn.close()


def run_one(spec: BenchSpec, method: str, seed: int) -> RunResult:
    """Spawn one run, sample its tree's PSS until it ends, and unlink anything it left in /dev/shm."""
    config = spec.config.model_copy(deep=True)
    config.train.seed = seed
    config.train.max_steps = spec.steps
    lt = spec.lt.model_copy(update={"method": method})
    threads = total_threads(lt)
    own_threads = split_threads(lt)[-1] if method in ASYNC_METHODS else threads
    context = mp.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    prefix = new_prefix()
    args = (
        config.model_dump(),
        lt.model_dump(),
        spec.steps,
        spec.timing_skip,
        prefix,
        sender,
        os.getpid(),
        spec.zygote,
        spec.eval_every,
    )
    with thread_env(own_threads):
        proc = context.Process(target=_run_job, args=args, name=f"bench-{method}-{seed}")
        proc.start()
    sender.close()
    payload: dict[str, Any] | None = None
    try:
        with PssSampler(proc.pid, spec.pss_interval) as sampler:
            deadline = time.monotonic() + spec.run_timeout
            while payload is None and time.monotonic() < deadline:
                if receiver.poll(0.2):
                    try:
                        payload = receiver.recv()
                    except EOFError:
                        break
                elif not proc.is_alive():
                    break
        proc.join(timeout=60.0)
    finally:
        if proc.is_alive():  # Ctrl+C reaches the run too and it cleans up on its own: give it that time
            proc.join(timeout=15.0)
        if proc.is_alive():  # a timeout, or a run stuck in cleanup: what it leaves is swept below
            proc.terminate()
            proc.join(timeout=30.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        leaked = sweep(prefix)
    died = f"run died (exit code {proc.exitcode})"
    result = RunResult(**payload) if payload else RunResult(method, seed, error=died)
    result.peak_pss_mib, result.processes = sampler.peak_mib, sampler.peak_processes
    result.peak_detail, result.other_cores = sampler.peak_detail, sampler.other_cores
    result.leaked_segments = leaked
    return result


def summarise(results: list[RunResult], methods: tuple[str, ...]) -> list[MethodSummary]:
    ok = [r for r in results if r.error is None]
    ref = {r.seed: r for r in ok if r.method == REFERENCE}
    summaries = []
    for method in methods:
        runs = [r for r in ok if r.method == method]
        if not runs:
            continue
        paired = [r for r in runs if r.seed in ref]
        base = [ref[r.seed] for r in paired]
        gap = gap_time = None
        if method != REFERENCE and paired:
            gap = paired_gap([r.bpb for r in paired], [b.bpb for b in base])
            if all(r.curve for r in paired) and all(b.curve for b in base):
                at_time = [equal_time_bpb(r.curve, b.curve) for r, b in zip(paired, base, strict=True)]
                if None not in at_time:
                    ours, theirs = zip(*at_time, strict=True)
                    gap_time = paired_gap(list(ours), list(theirs))
        summaries.append(
            MethodSummary(
                method=method,
                runs=len(runs),
                tokens_per_s=statistics.median(r.tokens_per_s for r in runs),
                throughput_ratio=geomean_ratio([r.tokens_per_s for r in paired], [b.tokens_per_s for b in base])
                if paired
                else float("nan"),
                throughput_ratio_median=geomean_ratio(
                    [r.tokens_per_s_median for r in paired], [b.tokens_per_s_median for b in base]
                )
                if paired and all(b.tokens_per_s_median > 0 for b in base)
                else float("nan"),
                peak_pss_mib=statistics.median(r.peak_pss_mib for r in runs),
                pss_ratio=geomean_ratio([r.peak_pss_mib for r in paired], [b.peak_pss_mib for b in base])
                if paired and all(b.peak_pss_mib > 0 for b in base)
                else float("nan"),
                bpb_mean=statistics.fmean(r.bpb for r in runs),
                other_cores=statistics.fmean(r.other_cores for r in runs),
                gap=gap,
                gap_time=gap_time,
                breakdown=_mean_breakdown(runs),
                readout=_mean_readout(runs),
            )
        )
    return summaries


def combine(reports: list[dict[str, Any]]) -> BenchReport:
    """One report from several runs of the same bench on other seeds (``BenchReport.to_json`` of each): their
    runs together, summarised as if one run had made them. Refused unless the runs are alike but for their
    seeds, and each (method, seed) ran once."""
    if not reports:
        raise ValueError("nothing to combine: give the JSON reports of two or more runs")
    first = {k: v for k, v in reports[0]["spec"].items() if k != "seeds"}
    results: list[RunResult] = []
    seen: set[tuple[str, int]] = set()
    for i, report in enumerate(reports):
        spec = {k: v for k, v in report["spec"].items() if k != "seeds"}
        if spec != first:
            differ = sorted(k for k in {*spec, *first} if spec.get(k) != first.get(k))
            raise ValueError(f"report {i + 1} ran another bench than report 1 (they differ in {', '.join(differ)})")
        for row in report["results"]:
            run = RunResult(**row)
            if (run.method, run.seed) in seen:
                raise ValueError(f"{run.method} seed {run.seed} is in more than one report: each seed must run once")
            seen.add((run.method, run.seed))
            results.append(run)
    methods = tuple(dict.fromkeys(r.method for r in results))
    seeds = sorted({r.seed for r in results})
    return BenchReport({**reports[0]["spec"], "seeds": seeds}, results, summarise(results, methods))


def bpb_at(curve: list[tuple[int, float, float]], seconds: float) -> float | None:
    """Held-out bpb of a run after ``seconds`` of training, linear between the evaluations around it; None
    before its first evaluation or after its end."""
    for (_, t0, b0), (_, t1, b1) in zip(curve, curve[1:], strict=False):
        if t0 <= seconds <= t1:
            return b1 if t1 == t0 else b0 + (b1 - b0) * (seconds - t0) / (t1 - t0)
    return curve[-1][2] if curve and seconds == curve[-1][1] else None


def equal_time_bpb(
    method: list[tuple[int, float, float]], reference: list[tuple[int, float, float]]
) -> tuple[float, float] | None:
    """Both runs' held-out bpb at the training time at which the faster one ended (None where the slower one
    has no evaluation that early: evaluate more often)."""
    seconds = min(method[-1][1], reference[-1][1])
    m, r = bpb_at(method, seconds), bpb_at(reference, seconds)
    return None if m is None or r is None else (m, r)


def _mean_breakdown(runs: list[RunResult]) -> list[dict[str, float]]:
    """Per stage, the share of its wall time spent busy, waiting and communicating (mean over seeds)."""
    per_stage: dict[int, list[dict[str, float]]] = {}
    for run in runs:
        for s in run.breakdown.get("stages", []):
            wall = max(s["wall_s"], 1e-9)
            per_stage.setdefault(s["stage"], []).append(
                {
                    "busy": s["busy_s"] / wall,
                    "wait_input": s["wait_input_s"] / wall,
                    "wait_output": s["wait_output_s"] / wall,
                    "wait_readout": s["wait_readout_s"] / wall,
                    "comm": s["comm_s"] / wall,
                    "lag_mean": s["lag_mean"],
                    "lag_max": s["lag_max"],
                }
            )
    return [
        {"stage": stage, **{k: statistics.fmean(d[k] for d in rows) for k in rows[0]}}
        for stage, rows in sorted(per_stage.items())
    ]


def _mean_readout(runs: list[RunResult]) -> list[dict[str, float]]:
    rows = [run.breakdown.get("readout", []) for run in runs]
    rows = [r for r in rows if r]
    if not rows:
        return []
    return [{k: statistics.fmean(r[i][k] for r in rows) for k in rows[0][i]} for i in range(len(rows[0]))]


def run_bench(spec: BenchSpec, on_result: Any = None) -> BenchReport:
    """Run every (seed, method) pair, global backprop first for each seed; ``on_result`` sees each run."""
    methods = (REFERENCE, *[m for m in spec.methods if m != REFERENCE])
    for method in methods:  # a config error surfaces now, not after the global-backprop reference has run
        check_config(spec.config, spec.lt.model_copy(update={"method": method}))
    results = []
    for seed in spec.seeds:
        for method in methods:
            result = run_one(spec, method, seed)
            results.append(result)
            if on_result is not None:
                on_result(result)
    m, t = spec.config.model, spec.config.train
    described = {
        "model": m.model_dump(),
        "batch_size": t.batch_size,
        "steps": spec.steps,
        "timing_skip": spec.timing_skip,
        "seeds": list(spec.seeds),
        "localtrain": spec.lt.model_dump(),
        "threads": total_threads(spec.lt),
        "data": spec.config.data.path or "python stdlib source",
        "zygote": spec.zygote,
        "eval_every": spec.eval_every,
    }
    return BenchReport(described, results, summarise(results, methods))
