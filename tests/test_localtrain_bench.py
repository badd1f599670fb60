"""The benchmark's arithmetic, report and command line (the real thing, with processes, is marked slow)."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from swarmtrain.cli import cli
from swarmtrain.localtrain.bench import BenchReport, RunResult, bpb_at, combine, equal_time_bpb, summarise
from swarmtrain.localtrain.cli import print_report
from swarmtrain.localtrain.pss import PssSampler, process_tree, pss_kib
from swarmtrain.localtrain.shm import PREFIX, leftover_segments

pytestmark = pytest.mark.timeout(60)


def result(method: str, seed: int, tokens: float, pss: float, bpb: float) -> RunResult:
    stages = [
        {
            "stage": i,
            "busy_s": 9.0,
            "wait_input_s": 0.5,
            "wait_output_s": 0.5,
            "wait_readout_s": 0.0,
            "comm_s": 0.1,
            "wall_s": 10.0,
            "lag_mean": 1.0,
            "lag_max": 2.0,
        }
        for i in range(2)
    ]
    breakdown = {
        "stages": stages,
        "readout": [{"cos_mean": 0.9, "cos_min": 0.5, "cos_negative_frac": 0.0, "lag_mean": 1.0, "lag_max": 2}],
    }
    return RunResult(method, seed, tokens_per_s=tokens, peak_pss_mib=pss, bpb=bpb, breakdown=breakdown)


def test_summary_pairs_seeds_with_global_backprop() -> None:
    results = [
        result("global-bp", 0, 1000, 500, 2.00),
        result("rgc-async", 0, 1200, 650, 2.01),
        result("global-bp", 1, 800, 520, 2.10),
        result("rgc-async", 1, 880, 676, 2.10),
        RunResult("rgc-async", 2, error="boom"),  # failed runs are left out, not averaged in
    ]
    bp, rgc = summarise(results, ("global-bp", "rgc-async"))
    assert bp.throughput_ratio == pytest.approx(1.0) and bp.gap is None
    assert rgc.runs == 2
    assert rgc.throughput_ratio == pytest.approx(math.sqrt(1.2 * 1.1))
    assert rgc.pss_ratio == pytest.approx(1.3)
    assert rgc.gap is not None and rgc.gap.mean_pct == pytest.approx(0.25)
    assert rgc.breakdown[0]["busy"] == pytest.approx(0.9)
    out = io.StringIO()
    print_report(BenchReport({}, results, [bp, rgc]), Console(file=out, width=160))
    text = out.getvalue()
    assert "rgc-async" in text and "1.149" in text and "cosine mean +0.900" in text
    json.dumps(BenchReport({}, results, [bp, rgc]).to_json(), default=str)


def test_a_long_run_is_also_compared_at_equal_wall_time() -> None:
    """Per seed, both runs are read when the faster one ended: a method that trains faster is credited with the
    steps it gains, one that trains slower is read at its own end against the reference's curve there."""
    speed = {"tokens_per_s": 1000.0, "tokens_per_s_median": 1000.0, "peak_pss_mib": 500.0}
    bp0 = RunResult("global-bp", 0, **speed, bpb=2.0, curve=[(250, 10.0, 3.0), (500, 20.0, 2.5), (750, 30.0, 2.0)])
    fast0 = RunResult("rgc-async", 0, **speed, bpb=2.2, curve=[(250, 5.0, 3.1), (500, 10.0, 2.8), (750, 15.0, 2.2)])
    bp1 = RunResult("global-bp", 1, **speed, bpb=2.0, curve=[(250, 10.0, 3.0), (500, 20.0, 2.5), (750, 30.0, 2.0)])
    slow1 = RunResult("rgc-async", 1, **speed, bpb=2.1, curve=[(250, 20.0, 3.0), (500, 40.0, 2.6), (750, 60.0, 2.1)])
    assert bpb_at(bp0.curve, 15.0) == pytest.approx(2.75)
    assert bpb_at(bp0.curve, 5.0) is None  # before its first evaluation: not guessed
    _, rgc = summarise([bp0, fast0, bp1, slow1], ("global-bp", "rgc-async"))
    assert rgc.gap is not None and rgc.gap.gaps_pct == pytest.approx((10.0, 5.0))  # equal steps: the final models
    # seed 0 at 15 s: 2.2 against the reference's 2.75; seed 1 at 30 s: 2.8 (between 2.6 and 3.0) against 2.0
    assert rgc.gap_time is not None
    assert rgc.gap_time.gaps_pct == pytest.approx((100 * (2.2 - 2.75) / 2.75, 100 * (2.8 - 2.0) / 2.0))
    out = io.StringIO()
    print_report(BenchReport({}, [bp0, fast0, bp1, slow1], [rgc]), Console(file=out, width=200))
    assert "gap % equal time" in out.getvalue() and f"{rgc.gap_time.mean_pct:+.3f}" in out.getvalue()
    # it ended at 5 s, before the reference's first evaluation: no equal-time reading
    early = RunResult("rgc-async", 0, **speed, bpb=2.2, curve=[(750, 5.0, 2.2)])
    _, rgc = summarise([bp0, early], ("global-bp", "rgc-async"))
    assert rgc.gap is not None and rgc.gap_time is None


def test_runs_on_other_seeds_combine_into_one_table() -> None:
    """Two runs of one bench, seeds 0-1 and 2: the combined summary is the one a single run of seeds 0-2 gives
    (its JSON round trip included); runs of another bench, or a seed in both, are refused with the reason."""
    runs = [
        result("global-bp", 0, 1000, 500, 2.00), result("rgc-async", 0, 1200, 650, 2.01),
        result("global-bp", 1, 800, 520, 2.10), result("rgc-async", 1, 880, 676, 2.10),
        result("global-bp", 2, 900, 510, 2.20), result("rgc-async", 2, 990, 660, 2.15),
    ]  # fmt: skip
    methods = ("global-bp", "rgc-async")

    def report(seeds: list[int], steps: int = 2000) -> dict:
        mine = [r for r in runs if r.seed in seeds]
        return json.loads(json.dumps(BenchReport({"steps": steps, "seeds": seeds}, mine, []).to_json()))

    combined = combine([report([0, 1]), report([2])])
    assert combined.spec == {"steps": 2000, "seeds": [0, 1, 2]}
    whole = BenchReport({}, runs, summarise(runs, methods)).to_json()["summary"]
    assert json.dumps(combined.to_json()["summary"]) == json.dumps(whole)  # NaN fields compare as text
    gap = combined.summaries[1].gap
    assert gap is not None and gap.gaps_pct == pytest.approx((0.5, 0.0, 100 * (2.15 - 2.2) / 2.2))
    with pytest.raises(ValueError, match="differ in steps"):
        combine([report([0, 1]), report([2], steps=1000)])
    with pytest.raises(ValueError, match="global-bp seed 1 is in more than one report"):
        combine([report([0, 1]), report([1, 2])])


def test_pss_sampler_sees_the_whole_tree() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(30_000_000); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while pss_kib(child.pid) < 25_000 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.pid in process_tree(os.getpid())
        with PssSampler(os.getpid(), interval=0.05) as sampler:
            time.sleep(0.2)
        assert sampler.peak_mib > 30 and sampler.peak_processes >= 2 and sampler.samples >= 2
        assert sampler.other_cores >= 0.0
    finally:
        child.kill()
        child.wait(timeout=10)


def test_bench_command_rejects_bad_settings_with_a_clear_message() -> None:
    runner = CliRunner()
    help_text = runner.invoke(cli, ["localtrain", "bench", "--help"])
    assert help_text.exit_code == 0 and "--stages" in help_text.output
    bad = runner.invoke(cli, ["localtrain", "bench", "--steps", "5", "--timing-skip", "9"])
    assert bad.exit_code != 0 and "--timing-skip" in bad.output
    unknown = runner.invoke(cli, ["localtrain", "bench", "--set", "localtrain.ring_dept=3"])
    assert unknown.exit_code != 0 and "localtrain.ring_depth" in str(unknown.exception)
    negative = runner.invoke(cli, ["localtrain", "bench", "--first-seed", "-1"])
    assert negative.exit_code != 0 and "--first-seed >= 0" in negative.output


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_runs_end_to_end(tmp_path: Path, text_file: Path) -> None:
    out = tmp_path / "bench.json"
    before = set(leftover_segments(PREFIX))
    args = ["localtrain", "bench", "--data", str(text_file), "--seeds", "1", "--steps", "8", "--threads", "2"]
    args += ["--first-seed", "2", "--method", "rgc-async", "--method", "live-local", "--eval-every", "2"]
    args += ["--out", str(out)]
    for key, value in {"model.depth": 2, "model.width": 32, "model.heads": 2, "model.context": 32}.items():
        args += ["--set", f"{key}={value}"]
    args += ["--set", "train.batch_size=4", "--set", "train.eval_batches=1", "--set", "train.warmup_steps=2"]
    args += ["--set", f"data.cache_dir={tmp_path / 'cache'}"]
    outcome = CliRunner().invoke(cli, args)
    assert outcome.exit_code == 0, outcome.output
    report = json.loads(out.read_text())
    assert [(r["method"], r["seed"]) for r in report["results"]] == [
        ("global-bp", 2), ("rgc-async", 2), ("live-local", 2)
    ]  # fmt: skip
    assert all(r["error"] is None and r["tokens_per_s"] > 0 and r["peak_pss_mib"] > 0 for r in report["results"])
    assert all(math.isfinite(r["bpb"]) and not r["leaked_segments"] for r in report["results"])
    assert [r["zygote"] for r in report["results"]] == [False, True, False]  # async stages fork from a zygote
    # held-out bpb every 2 steps (the async pipeline drained there) and at the end, on a clock that only counts steps
    for r in report["results"]:
        assert [step for step, _, _ in r["curve"]] == [2, 4, 6, 8] and r["curve"][-1][1:] == [r["train_s"], r["bpb"]]
        assert 0 < r["curve"][0][1] < r["train_s"]
    # the equal-time gap is given exactly where each run can be read when the faster one ended (timing decides
    # which; a faster run that ended before the other's first evaluation is not guessed at)
    reference = report["results"][0]["curve"]
    for summary, run in zip(report["summary"][1:], report["results"][1:], strict=True):
        readable = equal_time_bpb([tuple(c) for c in run["curve"]], [tuple(c) for c in reference]) is not None
        assert (summary["gap_time"] is not None) == readable
    assert set(leftover_segments(PREFIX)) <= before
