"""`swarmtrain scenario run` end to end: real node processes, a kill, a pause and a join, the report checked
against the nodes' own metrics, and no process left behind (also after Ctrl+C). Slow: a swarm of processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .swarm import child_setup, slowdown

# Three nodes of the tiny model, quick rounds: what both scenarios below share.
SWARM = """\
[swarm]
nodes = 3
rounds = {rounds}
inner_steps = 3
model = "tiny"
data = "{{data}}"
timeout_s = 400

[config]
train.batch_size = 4
train.threads = 1
train.eval_batches = 1
node.heartbeat_s = 0.5
node.record_ttl_s = 3
averaging.min_gather_s = 3
averaging.min_deadline_s = 8
averaging.verify = 0        # no checks of reducers: their evidence would count in a round's bytes sent
"""

SPEC = (
    SWARM.format(rounds=6)
    + """\
node.test_step_delay_s = 0.2

[nodes.node3]
start = false

[[event]]
at_round = 1
action = "kill"
nodes = ["node1"]

[[event]]
at_round = 2
action = "join"
nodes = ["node3"]

[[event]]
at_round = 2
action = "pause"
nodes = ["node2"]

[[event]]
at_round = 3
action = "resume"
nodes = ["node2"]
"""
)

pytestmark = pytest.mark.slow


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _group_members(pgids: list[int]) -> list[tuple[int, int]]:
    """(pid, pgid) of live processes in any of these process groups."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in pgids and fields[0] != "Z":
            found.append((int(stat.parent.name), int(fields[2])))
    return found


def _run(args: list[str], log: Path, timeout: float) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, preexec_fn=child_setup)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the runner's own cleanup, then a hard stop
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise AssertionError(f"the scenario did not finish in {timeout:.0f} s:\n{log.read_text()[-3000:]}") from None
    return proc


def test_a_scenario_with_a_kill_a_pause_and_a_join_reports_what_its_nodes_logged(
    tmp_path: Path, text_file: Path
) -> None:
    spec = tmp_path / "three.toml"
    spec.write_text(SPEC.format(data=text_file))
    out = tmp_path / "out"
    args = [sys.executable, "-m", "swarmtrain", "scenario", "run", str(spec), "--out", str(out)]
    proc = _run(args, tmp_path / "runner.log", 300 * slowdown())
    log = (tmp_path / "runner.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    for progress in ("kill node1 (event[0])", "join node3 (event[1])", "pause node2 (event[2])", "resume node2"):
        assert progress in log, f"no progress line for {progress!r}:\n{log}"

    for name in ("summary.md", "summary.json", "metrics.jsonl", "events.jsonl", "run.json", "loss.png", "members.png"):
        assert (out / name).is_file(), f"the report lacks {name}: {sorted(p.name for p in out.iterdir())}"
    for plot in ("loss.png", "members.png", "phases.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot
    assert (out / "scenario.toml").read_text() == spec.read_text()

    # Every process the runner started is gone, with its daemon (each led a process group of its own).
    events = _rows(out / "events.jsonl")
    starts = [e for e in events if e["action"] == "start"]
    assert [e["node"] for e in starts] == ["node0", "node1", "node2", "node3"]
    assert _group_members([e["pid"] for e in starts]) == []

    # The report's numbers are the nodes' own metrics.
    run = json.loads((out / "run.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    lives = {life["node"]: life for life in run["nodes"]}
    assert lives["node1"]["exit_code"] == -signal.SIGKILL
    assert {lives[n]["exit_code"] for n in ("node0", "node2", "node3")} == {0}
    metrics = {n: _rows(out / life["run_dir"] / "metrics.jsonl") for n, life in lives.items()}
    rounds = [r for rows in metrics.values() for r in rows if r["kind"] == "round"]
    assert summary["tokens"] == sum(r["tokens"] for r in rounds) > 0
    assert summary["bytes_sent"] == sum(r["bytes_sent"] for r in rounds) > 0
    finals = {n: r["bpb"] for n, rows in metrics.items() for r in rows if r["kind"] == "final"}
    assert set(finals) == {"node0", "node2", "node3"}  # the killed node never got to its final evaluation
    assert summary["final_bpb"] == pytest.approx(finals)
    worst: dict[int, str] = {}
    for r in rounds:
        bad = (
            "diverged"
            if r["outcome"].startswith("diverged")
            else "applied"
            if r["outcome"] == "applied"
            else "fallback"
        )
        rank = ("applied", "fallback", "diverged")
        worst[r["round"]] = max(worst.get(r["round"], "applied"), bad, key=rank.index)
    counted = [summary[f"rounds_{o}"] for o in ("applied", "fallback", "diverged")]
    assert counted == [sum(w == o for w in worst.values()) for o in ("applied", "fallback", "diverged")]
    assert summary["rounds"] == len(worst) == 6
    lived = sum(life["ended"] - life["started"] for life in run["nodes"])
    assert summary["utilisation"] == pytest.approx(sum(r["inner_s"] for r in rounds) / lived, abs=1e-3)
    assert 0 < summary["utilisation"] < 1
    (joiner,) = summary["joiners"]
    contributed = [
        r for r in metrics["node3"]
        if r["kind"] == "round" and r["outcome"] == "applied" and r["group_size"] > 1 and r["token_share"] > 0
    ]  # fmt: skip
    join_t = next(e["t"] for e in starts if e["node"] == "node3")
    if contributed:
        expected = contributed[0]["time"] - run["started"] - join_t
        assert joiner["time_to_contribute_s"] == pytest.approx(expected, abs=1e-2)
    else:
        assert joiner["time_to_contribute_s"] is None
    text = (out / "summary.md").read_text()
    # The mean is over the nodes that ended in the swarm's last round (a node that ended behind holds an older
    # model): here every node that finished, in round 6.
    ends = {n: r["round"] for n, rows in metrics.items() for r in rows if r["kind"] == "final"}
    assert ends == {n: 6 for n in finals} and summary["final_in_step"] == sorted(finals)
    assert f"| final held-out bpb (mean of 3 nodes in round 6) | {sum(finals.values()) / 3:.4f} |" in text
    assert f"| tokens trained (all nodes) | {summary['tokens']:,} |" in text
    assert "| kill | node1 |" in text and "| join | node3 |" in text


LATE_SPEC = (
    SWARM.format(rounds=2)
    + """\

[nodes.node2]
start = false

[[event]]
at_round = 1
action = "join"
nodes = ["node2"]

[[event]]
at_round = 1
action = "pause"
nodes = ["node2"]
"""
)


def test_a_node_that_comes_too_late_for_the_swarms_rounds_is_stopped_once_the_others_have_finished(
    tmp_path: Path, text_file: Path
) -> None:
    """node0 and node1 run the scenario's 2 rounds and leave; node2, started during them and paused at once, never
    takes part in a round. Resumed with no one left it would wait for peers in vain, as a node that comes back
    after the swarm's last round does: the runner stops it once the others are gone, instead of resuming it and
    waiting out the scenario's timeout."""
    spec = tmp_path / "late.toml"
    spec.write_text(LATE_SPEC.format(data=text_file))
    out = tmp_path / "out"
    args = [sys.executable, "-m", "swarmtrain", "scenario", "run", str(spec), "--out", str(out)]
    started = time.monotonic()
    proc = _run(args, tmp_path / "runner.log", 300 * slowdown())
    log = (tmp_path / "runner.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    assert "the swarm finished its 2 rounds before node2 took part in one: they leave" in log, log
    assert time.monotonic() - started < 250 * slowdown()  # not the node's 600 s wait for peers, nor the timeout
    lives = {life["node"]: life for life in json.loads((out / "run.json").read_text())["nodes"]}
    assert lives["node0"]["exit_code"] == lives["node1"]["exit_code"] == 0, lives
    assert lives["node2"]["exit_code"] is not None  # gone (it was stopped as it started: it may not have a handler)
    stops = [e["node"] for e in _rows(out / "events.jsonl") if e["action"] == "stop"]
    assert stops == ["node2"], stops
    assert not [r for r in _rows(out / lives["node2"]["run_dir"] / "metrics.jsonl") if r["kind"] == "round"]


def test_ctrl_c_stops_every_process_the_scenario_started(tmp_path: Path, text_file: Path) -> None:
    spec = tmp_path / "long.toml"
    spec.write_text(SPEC.format(data=text_file).replace("rounds = 6", "rounds = 1000"))
    out = tmp_path / "out"
    args = [sys.executable, "-m", "swarmtrain", "scenario", "run", str(spec), "--out", str(out)]
    with open(tmp_path / "runner.log", "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, preexec_fn=child_setup)
    rows: list[dict] = []
    try:
        deadline = time.monotonic() + 120 * slowdown()
        while time.monotonic() < deadline and proc.poll() is None:
            rows = [r for n in ("node0", "node1", "node2") for r in _rows(out / "nodes" / n / "metrics.jsonl")]
            if rows:  # the swarm trains: the nodes and their daemons are all up
                break
            time.sleep(0.5)
        assert proc.poll() is None and rows, (tmp_path / "runner.log").read_text()[-3000:]
        pids = [e["pid"] for e in _rows(out / "events.jsonl") if e["action"] == "start"]
        assert len(pids) == 3 and all(os.path.exists(f"/proc/{p}") for p in pids)
        proc.send_signal(signal.SIGINT)  # started with SIGINT ignored, as from a script: still stops
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 130, (tmp_path / "runner.log").read_text()[-3000:]
    assert _group_members(pids) == []
    assert (out / "summary.md").is_file()  # the report of what ran


@pytest.mark.skipif(os.geteuid() != 0, reason="link shaping needs root")
@pytest.mark.parametrize("shaper", ["kernel", "transport"])
def test_a_shaped_link_sets_the_pace_of_the_rounds_and_leaves_no_namespace_behind(
    tmp_path: Path, text_file: Path, shaper: str
) -> None:
    """Two nodes on 1 Mbit/s links, shaped by the kernel (as root) or paced by the nodes' own transports (what a
    scenario without root gets): either way no round moves its bytes faster than the link."""
    spec = tmp_path / "narrow.toml"
    text = SPEC.format(data=text_file).split("[nodes.node3]")[0]  # no events: two nodes on 1 Mbit/s links
    text = text.replace("nodes = 3", f'nodes = 2\nshaper = "{shaper}"\nlink = {{ up_mbit = 1, down_mbit = 1 }}')
    text = text.replace("rounds = 6", "rounds = 3")
    spec.write_text(text + 'averaging.codec = "fp32"\n')
    out = tmp_path / "out"
    args = [sys.executable, "-m", "swarmtrain", "scenario", "run", str(spec), "--out", str(out)]
    before = _namespaces()  # another run's, left by a runner that was killed (SIGKILL cannot clean up)
    proc = _run(args, tmp_path / "runner.log", 200 * slowdown())
    assert proc.returncode == 0, (tmp_path / "runner.log").read_text()[-3000:]
    rows = [r for r in _rows(out / "metrics.jsonl") if r["kind"] == "round"]
    assert len(rows) == 6 and {(r["group_size"], r["outcome"]) for r in rows} == {(2, "applied")}
    for r in rows:  # a node's update crosses its 1 Mbit/s uplink: the transfer cannot be faster than that
        floor = r["bytes_sent"] * 8 / 1e6
        assert r["phases"]["transfer_s"] >= 0.9 * floor, f"round {r['round']} moved {r['bytes_sent']} B in {r}"
    left = _namespaces() - before
    assert not left, left


def _namespaces() -> set[str]:
    """The network namespaces of scenario runs (``links.Network``: named st<run id>n<index>)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.startswith("st")}
