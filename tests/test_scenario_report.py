"""The scenario report from a runner's folder, in process: the summary's definitions and the files written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarmtrain.scenarios.report import write_report

T0 = 1_000_000.0


def _round(k: int, t: float, outcome: str = "applied", group: int = 2, share: float = 0.5, **extra: object) -> dict:
    row = {"kind": "round", "round": k, "time": T0 + t, "tokens": 100, "bytes_sent": 1000, "inner_s": 2.0,
           "group_size": group, "token_share": share, "outcome": outcome, "bpb": 8.0 - k,
           "duration_s": 0.5 + k, "idle_s": 2.0}  # fmt: skip
    return {**row, **extra}


def _write(folder: Path, name: str, rows: list[dict]) -> None:
    (folder / name).mkdir(parents=True)
    (folder / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """Two nodes for 20 s; a third joins at 6 s, trains solo once, then contributes at 12 s; a kill at 9 s."""
    phases = {"group_s": 0.5, "transfer_s": 0.25}
    _write(tmp_path, "nodes/node0", [
        _round(0, 4, phases=phases), _round(1, 8, "fallback", phases=phases),
        _round(2, 12, "fallback", group=3, excluded=["Qm-node1"]),
        {"kind": "final", "round": 3, "time": T0 + 19, "bpb": 5.5, "tokens": 300},
    ])  # fmt: skip
    _write(tmp_path, "nodes/node1", [_round(0, 4.1), _round(1, 8.1, "diverged-resynced")])
    _write(tmp_path, "nodes/node2", [
        _round(1, 8, group=1, share=1.0), _round(2, 12, group=3, share=0.2, idle_s=0.5),
        {"kind": "final", "round": 3, "time": T0 + 19.5, "bpb": 5.25, "tokens": 200},
    ])  # fmt: skip
    lives = [("node0", 0.0, 20.0, 0), ("node1", 0.0, 10.0, -9), ("node2", 6.0, 20.0, 0)]
    run = {"scenario": "x/two.toml", "started": T0, "ended": T0 + 20, "nodes": [
        {"node": n, "incarnation": 1, "run_dir": f"nodes/{n}", "started": T0 + a, "ended": T0 + b, "exit_code": c}
        for n, a, b, c in lives
    ]}  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps(run))
    events = [
        {"t": 0.0, "action": "start", "node": "node0", "run_dir": "nodes/node0", "initial": True},
        {"t": 0.0, "action": "start", "node": "node1", "run_dir": "nodes/node1", "initial": True},
        {"t": 6.0, "action": "start", "node": "node2", "run_dir": "nodes/node2", "initial": False},
        {"t": 6.0, "action": "join", "node": "node2", "source": "event[0]"},
        {"t": 9.0, "action": "kill", "node": "node1", "source": "event[1]"},
        {"t": 10.0, "action": "exit", "node": "node1", "code": -9, "killed": True},
    ]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "scenario.toml").write_text("[swarm]\nnodes = 2\nrounds = 3\n")
    return tmp_path


def test_the_summary_counts_rounds_by_their_worst_outcome_and_times_the_joiner(folder: Path) -> None:
    summary_md = write_report(folder)
    s = json.loads((folder / "summary.json").read_text())
    assert (s["rounds"], s["rounds_applied"], s["rounds_fallback"], s["rounds_diverged"]) == (3, 1, 1, 1)
    assert s["rounds_short"] == 1  # round 2 went on without node1, killed in it
    assert s["tokens"] == 700 and s["bytes_sent"] == 7000
    assert s["final_bpb"] == {"node0": 5.5, "node2": 5.25} and s["final_bpb_mean"] == pytest.approx(5.375)
    assert (s["final_round"], s["final_in_step"]) == (3, ["node0", "node2"])
    assert s["utilisation"] == pytest.approx(7 * 2.0 / (20 + 10 + 14), abs=1e-4)  # inner s / lifetimes
    # In training: inner s over inner and idle s (node2 idle only 0.5 s before its last round).
    assert s["utilisation_training"] == pytest.approx(7 * 2.0 / (7 * 2.0 + 6 * 2.0 + 0.5), abs=1e-4)
    assert s["joiners"] == [
        {
            "node": "node2",
            "incarnation": 1,
            "joined_t": 6.0,
            "contributed_t": 12.0,
            "time_to_contribute_s": 6.0,
            "round": 2,
        }
    ]  # its solo round 1 took no one else's tokens: not a contribution
    merged = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert len(merged) == 9 and [r["t"] for r in merged] == sorted(r["t"] for r in merged)
    text = summary_md.read_text()
    assert "| rounds applied / fallback / diverged | 1 / 1 / 1 of 3 |" in text
    assert "| rounds that left a member out (it died, was late past a deadline or was refused) | 1 of 3 |" in text
    assert "| node2 | 6.0 | 12.0 | 6.0 | 2 |" in text and "| 9.0 | kill | node1 |" in text
    for plot in ("loss.png", "members.png", "phases.png"):
        assert (folder / plot).read_bytes()[:4] == b"\x89PNG", plot


def test_without_logged_phases_there_is_no_phases_plot_and_the_summary_says_so(folder: Path) -> None:
    for path in folder.glob("nodes/*/metrics.jsonl"):
        rows = [{k: v for k, v in json.loads(line).items() if k != "phases"} for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = write_report(folder).read_text()
    assert not (folder / "phases.png").exists()
    assert "no round logged its phases" in text


def test_compare_tables_each_run_and_plots_the_swarm_curve_of_the_live_nodes(folder: Path, tmp_path: Path) -> None:
    import shutil

    from swarmtrain.scenarios.compare import compare, curve
    from swarmtrain.scenarios.report import load_run

    other = tmp_path / "other"
    shutil.copytree(folder, other)
    text = compare([folder, other], tmp_path / "cmp").read_text()
    # The median outer step counts the rows with a group of two or more (node2's solo round 1 left out): 1.5 s.
    for run in (folder, other):
        assert f"| {run.name} | 5.3750 | 20.0 | 700 | 0.0 | 1 / 1 / 1 | 1.50 | 31.8% | 52.8% |" in text, text
    assert (tmp_path / "cmp" / "compare.png").read_bytes()[:4] == b"\x89PNG"
    run, _, rows = load_run(folder)
    points = curve(run, rows)
    # After node1's kill (it ended at 10 s) its bpb no longer counts: at 12 s the mean is node0's and node2's.
    assert points[-1] == pytest.approx((12.0, 700, 7000, (6.0 + 6.0) / 2))
    assert points[1] == pytest.approx((4.1, 200, 2000, 8.0))


def test_members_over_time_ignore_the_late_exit_of_a_process_whose_node_is_back_already() -> None:
    from swarmtrain.scenarios.plots import members_over_time

    events = [
        {"t": 0.0, "action": "start", "node": "node0", "incarnation": 1},
        {"t": 0.0, "action": "start", "node": "node1", "incarnation": 1},
        {"t": 5.0, "action": "kill", "node": "node1"},
        {"t": 5.2, "action": "start", "node": "node1", "incarnation": 2},
        {"t": 5.2, "action": "join", "node": "node1"},
        {"t": 5.5, "action": "exit", "node": "node1", "incarnation": 1},
        {"t": 6.0, "action": "pause", "node": "node0"},
        {"t": 7.0, "action": "resume", "node": "node0", "skipped": ""},
    ]
    assert members_over_time(events) == [
        (0.0, 0),
        (0.0, 1),
        (0.0, 2),
        (5.0, 1),
        (5.2, 2),
        (5.2, 2),
        (6.0, 1),
        (7.0, 2),
    ]


def test_a_node_back_as_a_new_process_reports_the_final_bpb_of_its_last_process(folder: Path) -> None:
    _write(
        folder, "nodes/node1.2", [_round(2, 12, group=3), {"kind": "final", "round": 3, "time": T0 + 19, "bpb": 5.0}]
    )
    run = json.loads((folder / "run.json").read_text())
    run["nodes"].append({"node": "node1", "incarnation": 2, "run_dir": "nodes/node1.2", "started": T0 + 11,
                         "ended": T0 + 20, "exit_code": 0})  # fmt: skip
    (folder / "run.json").write_text(json.dumps(run))
    with open(folder / "events.jsonl", "a") as f:
        f.write(
            json.dumps({"t": 11.0, "action": "start", "node": "node1", "run_dir": "nodes/node1.2", "initial": False})
            + "\n"
        )
    text = write_report(folder).read_text()
    s = json.loads((folder / "summary.json").read_text())
    assert s["final_bpb"] == {"node0": 5.5, "node1.2": 5.0, "node2": 5.25}
    assert "| node1 | 2 | 200 |" in text and "| -9 | - |" in text  # the killed first process has no final bpb
    assert "| node1.2 | 1 | 100 | 1,000 | 9.0 | 2.0 | 22.2% | 0 | 5.0000 |" in text
    assert [j["node"] for j in s["joiners"]] == ["node2", "node1.2"]


def test_a_node_that_ended_behind_the_swarms_last_round_is_listed_but_left_out_of_the_mean(folder: Path) -> None:
    """node1 came back as the swarm finished and ended at round 0 with the initial model (8.1 bpb): the mean is the
    swarm's model, over the nodes that ended in its last round."""
    _write(folder, "nodes/node1.2", [{"kind": "final", "round": 0, "time": T0 + 19, "bpb": 8.1}])
    run = json.loads((folder / "run.json").read_text())
    run["nodes"].append({"node": "node1", "incarnation": 2, "run_dir": "nodes/node1.2", "started": T0 + 15,
                         "ended": T0 + 20, "exit_code": 0})  # fmt: skip
    (folder / "run.json").write_text(json.dumps(run))
    text = write_report(folder).read_text()
    s = json.loads((folder / "summary.json").read_text())
    assert s["final_bpb"] == {"node0": 5.5, "node1.2": 8.1, "node2": 5.25}
    assert s["final_in_step"] == ["node0", "node2"] and s["final_bpb_mean"] == pytest.approx(5.375)
    assert "| final held-out bpb (mean of 2 nodes in round 3; node1.2 ended behind, left out) | 5.3750 |" in text


def test_held_out_bpb_by_part_is_tabled_per_node_and_compared_only_where_a_run_has_parts(
    folder: Path, tmp_path: Path
) -> None:
    """data.eval_parts: each node's final row carries bpb_parts; the summary tables them with their mean, and
    compare adds a column for them only when some run has them."""
    import shutil

    from swarmtrain.scenarios.compare import compare

    plain = tmp_path / "plain"
    shutil.copytree(folder, plain)
    parts = {"node0": {"a": 2.0, "b": 4.0, "all": 3.5}, "node2": {"a": 3.0, "b": 5.0, "all": 4.5}}
    for name, bpbs in parts.items():
        path = folder / "nodes" / name / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        rows[-1]["bpb_parts"] = bpbs
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = write_report(folder).read_text()
    s = json.loads((folder / "summary.json").read_text())
    assert s["final_bpb_parts"] == parts and s["final_bpb_parts_mean"] == {"a": 2.5, "b": 4.5, "all": 4.0}
    assert "| node | a | b | all |" in text and "| node2 | 3.0000 | 5.0000 | 4.5000 |" in text
    assert "| mean | 2.5000 | 4.5000 | 4.0000 |" in text
    assert "by part" not in write_report(plain).read_text()
    both = compare([folder, plain], tmp_path / "cmp").read_text()
    assert "| utilisation | in training | held-out bpb by part |" in both
    assert "| 52.8% | a 2.5000, b 4.5000, all 4.0000 |" in both and "| 52.8% | - |" in both, both
    assert "by part" not in compare([plain], tmp_path / "cmp2").read_text()
