"""Scenario files: what a good spec parses into, and that each mistake names its line and key (exit code 2)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from swarmtrain.cli import main
from swarmtrain.scenarios import ScenarioError, parse_spec
from swarmtrain.scenarios.runner import Runner
from swarmtrain.scenarios.spec import load_spec

GOOD = """\
[swarm]
nodes = 3
rounds = 6
inner_steps = 4
codec = "int8"
model = "tiny"

[config]
train.batch_size = 8
averaging.min_deadline_s = 9

[nodes.node2.config]
train.batch_size = 2

[nodes.late]
start = false

[[event]]
at_round = 2
action = "kill"
nodes = ["node1"]

[[event]]
at_s = 5.5
action = "pause"
nodes = "node2"

[[event]]
at_round = 3
action = "join"
nodes = ["late"]

[[repeat]]
action = "pause"
nodes = "random"
every_rounds = 2
from_round = 1
until_round = 5
back_after_rounds = 1
"""


def test_a_good_spec_parses_into_nodes_overrides_events_and_repeats() -> None:
    spec = parse_spec(GOOD, "good.toml")
    assert [(n.name, n.start) for n in spec.nodes] == [
        ("node0", True),
        ("node1", True),
        ("node2", True),
        ("late", False),
    ]
    assert spec.rounds == 6 and spec.wall_time_s is None
    node0, node2 = spec.node("node0").settings, spec.node("node2").settings
    assert node0["train.batch_size"] == 8 and node2["train.batch_size"] == 2  # the node's own override wins
    assert node2["averaging.min_deadline_s"] == 9 and node2["averaging.codec"] == "int8"
    assert node0["node.inner_steps"] == 4 and node0["model.width"] == 32  # [swarm] keys and the tiny preset
    kill, pause, join = spec.events
    assert (kill.action, kill.nodes, kill.at_round, kill.at_s) == ("kill", ("node1",), 2, None)
    assert (pause.action, pause.nodes, pause.at_s) == ("pause", ("node2",), 5.5)
    assert join.nodes == ("late",) and join.line == 28
    (repeat,) = spec.repeats
    assert (repeat.every_rounds, repeat.start, repeat.until, repeat.back_after) == (2, 1, 5, 1)
    assert repeat.nodes == ("random",)


def test_a_wall_time_spec_needs_no_rounds() -> None:
    spec = parse_spec("[swarm]\nnodes = 2\nwall_time_s = 30\n")
    assert spec.wall_time_s == 30 and spec.rounds == 0 and len(spec.nodes) == 2


def _error(text: str) -> str:
    with pytest.raises(ScenarioError) as info:
        parse_spec(text, "bad.toml")
    return str(info.value)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (("rounds = 6", "rounds = 6\nnodez = 1"), "bad.toml:4: swarm.nodez: is not a known key. Did you mean nodes?"),
        (("nodes = 3", 'nodes = "3"'), "bad.toml:2: swarm.nodes: must be int"),
        (("rounds = 6", "wall_time_s = 10\nrounds = 6"), "bad.toml:1: swarm: set exactly one of rounds"),
        (('model = "tiny"', 'model = "huge"'), "bad.toml:6: swarm.model: must be one of tiny, bench, default"),
        (("train.batch_size = 8", "train.batch_size = 0"), "bad.toml:9: config.train.batch_size: Input should be"),
        (
            ("train.batch_size = 8", "train.batch_sise = 8"),
            "bad.toml:9: config.train.batch_sise: is not a node setting",
        ),
        (("averaging.min_deadline_s = 9", "node.rounds = 9"), "bad.toml:10: config.node.rounds: is set by the"),
        (("train.batch_size = 2", "train.batch_size = -1"), "bad.toml:13: nodes.node2.config.train.batch_size:"),
        (("start = false", "start = 0"), "bad.toml:16: nodes.late.start: must be bool"),
        (('action = "kill"', 'action = "explode"'), "bad.toml:20: event[0].action: must be one of join, leave"),
        (('nodes = ["node1"]', 'nodes = ["node9"]'), "bad.toml:21: event[0].nodes: names 'node9', which is not a"),
        (("at_s = 5.5", "at_s = 5.5\nat_round = 1"), "bad.toml:23: event[1]: set exactly one of at_s"),
        (("until_round = 5", "until_s = 5"), "bad.toml:38: repeat[0].until_s: mixes units"),
        (('action = "pause"\nnodes = "random"', 'action = "kill"\nnodes = []'), "bad.toml:35: repeat[0].nodes: must"),
        (("[[repeat]]", "[[repeats]]"), "bad.toml:33: repeats: is not a known key. Did you mean repeat?"),
    ],
)
def test_each_mistake_names_its_line_and_key(change: tuple[str, str], expected: str) -> None:
    old, new = change
    assert old in GOOD
    message = _error(GOOD.replace(old, new, 1))
    assert message.startswith(f"scenario error: {expected}"), message


def test_a_join_has_nothing_to_come_back_from() -> None:
    text = GOOD.replace('action = "pause"\nnodes = "random"', 'action = "join"\nnodes = "random"')
    assert "repeat[0].back_after_rounds: join has nothing to come back from" in _error(text)


def test_scenario_check_prints_ok_or_the_error_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text(GOOD)
    bad.write_text(GOOD.replace("nodes = 3", "nodes = 0"))
    main(["scenario", "check", str(good)])
    assert "ok: 4 nodes (3 at the start), 6 rounds, 3 events, 1 repeating events" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["scenario", "check", str(bad)])
    assert exit_info.value.code == 2
    assert f"{bad}:2: swarm.nodes: must be a whole number >= 1" in capsys.readouterr().err.replace("\n", "")


def test_links_default_from_swarm_a_node_overrides_them_and_a_link_event_carries_its_rates() -> None:
    spec = parse_spec(
        "[swarm]\nnodes = 2\nrounds = 3\nlink = { up_mbit = 100, down_mbit = 50 }\n"
        "[nodes.node1]\nlink = { up_mbit = 2 }\n"
        '[[event]]\nat_s = 3\naction = "link"\nnodes = ["node0"]\ndown_mbit = 10\ndown_loss = 0.02\n'
        '[[repeat]]\naction = "partition"\nnodes = "random"\nevery_s = 5\nback_after_s = 2\n'
    )
    assert [(n.up_mbit, n.down_mbit) for n in spec.nodes] == [(100.0, 50.0), (2.0, None)]
    assert [(n.up_ms, n.down_ms) for n in spec.nodes] == [(0.0, 0.0), (0.0, 0.0)]
    (event,) = spec.events
    assert (event.up_mbit, event.down_mbit, event.up_loss, event.down_loss) == (None, 10.0, 0.0, 0.02) and spec.shaped
    assert not parse_spec("[swarm]\nnodes = 2\nrounds = 3\n").shaped
    lossy = parse_spec("[swarm]\nnodes = 2\nrounds = 3\n[nodes.node1]\nlink = { up_loss = 0.01 }\n")
    assert [(n.up_loss, n.down_loss) for n in lossy.nodes] == [(0.0, 0.0), (0.01, 0.0)] and lossy.shaped


def test_link_delays_reach_each_node_as_its_transport_delays(tmp_path: Path) -> None:
    """up_ms and down_ms need no namespace: the runner starts the node with node.up_delay_ms and down_delay_ms."""
    spec = parse_spec(
        "[swarm]\nnodes = 2\nrounds = 3\nlink = { up_ms = 12.5, down_ms = 10 }\n"
        "[nodes.node1]\nlink = { up_mbit = 5 }\n"
    )
    assert [(n.up_ms, n.down_ms) for n in spec.nodes] == [(12.5, 10.0), (0.0, 0.0)]
    assert not parse_spec(spec.text.split("[nodes.node1]")[0]).shaped
    runner = Runner(spec, tmp_path)
    first, second = (runner.node_args(n, tmp_path, True, False) for n in ("node0", "node1"))
    assert "node.up_delay_ms=12.5" in first and "node.down_delay_ms=10.0" in first
    assert not any("delay_ms" in arg for arg in second)


def test_without_kernel_shaping_link_rates_reach_each_node_as_its_own_pacing(tmp_path: Path) -> None:
    """[swarm] shaper = transport (what auto picks without root): no namespace; each node paces its own messages
    at its link's rates (node.up_mbit, node.down_mbit; the pacing's rate: test_link_delay.py). A loss, a link event
    or a partition needs the kernel: that spec is refused naming the key, and auto gives it the kernel."""
    text = '[swarm]\nnodes = 2\nrounds = 3\nshaper = "{}"\n[nodes.node1]\nlink = {{ up_mbit = 20, down_mbit = 8 }}\n'
    spec = parse_spec(text.format("transport"))
    runner = Runner(spec, tmp_path)
    assert spec.shaped and not runner.kernel_shapes()
    first, second = (runner.node_args(n, tmp_path, True, False) for n in ("node0", "node1"))
    assert "node.up_mbit=20.0" in second and "node.down_mbit=8.0" in second
    assert not any("mbit" in arg for arg in first)
    lossy = text + "[nodes.node0]\nlink = {{ up_loss = 0.01 }}\n"
    assert _error(lossy.format("transport")).startswith("scenario error: bad.toml:4: swarm.shaper: = transport paces")
    assert Runner(parse_spec(lossy.format("auto")), tmp_path).kernel_shapes()
    assert _error(text.format("fast")).startswith("scenario error: bad.toml:4: swarm.shaper: must be one of auto,")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("link = { up_mbit = 100, latency_ms = 50 }", "bad.toml:4: swarm.link.latency_ms: is set per direction"),
        ("link = { up_mbit = 100, loss = 0.01 }", "bad.toml:4: swarm.link.loss: is set per direction: up_loss"),
        ("link = { up_loss = 1 }", "bad.toml:4: swarm.link.up_loss: must be a share of packets from 0 up to 1"),
        ("link = { up_ms = -1 }", "bad.toml:4: swarm.link.up_ms: must be 0 to 10000 ms"),
        (
            '[[event]]\nat_s = 1\naction = "link"\nnodes = ["node0"]\nup_ms = 5',
            "bad.toml:8: event[0].up_ms: a node's delay is fixed when it starts",
        ),
        ("link = { up_mbit = 0 }", "bad.toml:4: swarm.link.up_mbit: must be positive Mbit/s"),
        (
            "link = { up = 1 }",
            "bad.toml:4: swarm.link.up: is not a known key. The keys of swarm.link are: up_mbit, down_mbit, up_loss,",
        ),
        ('[[event]]\nat_s = 1\naction = "kill"\nnodes = ["node0"]\nup_mbit = 5', "bad.toml:8: event[0].up_mbit: only"),
    ],
)
def test_link_mistakes_name_their_line_and_key(text: str, expected: str) -> None:
    assert _error(f"[swarm]\nnodes = 2\nrounds = 3\n{text}\n").startswith(f"scenario error: {expected}")


@pytest.mark.parametrize("path", sorted(Path(__file__).parent.parent.glob("scenarios/*.toml")), ids=lambda p: p.name)
def test_every_shipped_scenario_passes_check(path: Path) -> None:
    main(["scenario", "check", str(path)])


def test_each_lab_names_shipped_scenarios_and_a_lab_that_does_not_exist_is_refused() -> None:
    script = Path(__file__).parent.parent / "scenarios" / "lab.sh"
    labs = dict(re.findall(r'^\s+(\w+)\) runs="([^"]+)"', script.read_text(), flags=re.M))
    assert sorted(labs) == ["1", "2", "3", "4", "5", "links", "noniid", "overlap"], labs
    for lab, runs in labs.items():
        for run in runs.split():
            assert load_spec(script.parent / f"{run}.toml").nodes, (lab, run)  # exists and is a valid scenario
    done = subprocess.run(["bash", str(script), "9"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "usage: scenarios/lab.sh 1|2|3|4|5|links|noniid|overlap" in done.stderr, done


def test_a_node_whose_data_or_folders_do_not_exist_is_refused_at_check_naming_the_key(tmp_path: Path) -> None:
    """Checked before anything runs (a node would fail at its start): data.path, and the folders of data.include
    and data.eval_parts inside the corpus (the standard library's source when data.path is unset)."""
    corpus = tmp_path / "corpus"
    (corpus / "a").mkdir(parents=True)
    spec = tmp_path / "s.toml"
    head = '[swarm]\nnodes = 2\nrounds = 3\ndata = "corpus"\n'
    spec.write_text(head + '[config]\ndata.eval_parts = ["a"]\n[nodes.node1.config]\ndata.include = ["a"]\n')
    assert [n.settings.get("data.include") for n in load_spec(spec).nodes] == [None, ["a"]]
    for text, expected in [
        (
            head + '[nodes.node1.config]\ndata.include = ["b"]\n',
            "s.toml:6: nodes.node1.config.data.include: names 'b'",
        ),
        (head + '[config]\ndata.eval_parts = ["a", "c"]\n', "s.toml:6: config.data.eval_parts: names 'c', which is"),
        (head.replace('"corpus"', '"nowhere"'), "s.toml:4: swarm.data: "),
        ('[swarm]\nnodes = 2\nrounds = 3\n[config]\ndata.include = ["no-such-package"]\n', "s.toml:5: config.data"),
    ]:
        spec.write_text(text)
        with pytest.raises(ScenarioError) as info:
            load_spec(spec)
        assert str(info.value).startswith(f"scenario error: {spec.parent}/{expected}"), str(info.value)
