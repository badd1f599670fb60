"""The scenario timeline in process: when events fire, whom a random one hits, and when a node comes back."""

from __future__ import annotations

from swarmtrain.scenarios import parse_spec
from swarmtrain.scenarios.timeline import Timeline

BASE = "[swarm]\nnodes = 4\nrounds = 6\nseed = 3\n"


def _states(n: int = 4) -> dict[str, str]:
    return {f"node{i}": "running" for i in range(n)}


def test_events_fire_once_their_time_or_round_has_come_in_the_order_written() -> None:
    spec = parse_spec(
        BASE + '[[event]]\nat_s = 5\naction = "pause"\nnodes = ["node1"]\n'
        '[[event]]\nat_round = 2\naction = "kill"\nnodes = ["node2", "node3"]\n'
        '[[event]]\nat_s = 7\naction = "resume"\nnodes = ["node1"]\n'
    )
    timeline, states = Timeline(spec), _states()
    assert timeline.due(4.9, 1, states) == []
    (pause,) = timeline.due(5.0, 1, states)
    assert (pause.action, pause.node, states["node1"]) == ("pause", "node1", "paused")
    kills = timeline.due(6.0, 2, states)
    assert [(f.action, f.node) for f in kills] == [("kill", "node2"), ("kill", "node3")]
    assert states == {"node0": "running", "node1": "paused", "node2": "gone", "node3": "gone"}
    (resume,) = timeline.due(100.0, 6, states)
    assert resume.node == "node1" and states["node1"] == "running"
    assert timeline.due(200.0, 9, states) == []  # each fires once


def test_an_event_on_a_node_in_the_wrong_state_is_skipped_with_the_reason() -> None:
    spec = parse_spec(BASE + '[[event]]\nat_s = 1\naction = "resume"\nnodes = ["node1"]\n')
    (firing,) = Timeline(spec).due(1.0, 0, states := _states())
    assert firing.node is None and firing.skipped == "node1 is running, cannot resume it"
    assert states == _states()


def test_a_repeating_random_kill_comes_back_a_round_later_and_never_takes_the_last_running_node() -> None:
    spec = parse_spec(
        BASE + '[[repeat]]\naction = "kill"\nnodes = "random"\nevery_rounds = 1\nfrom_round = 1\n'
        "until_round = 3\nback_after_rounds = 1\n"
    )
    timeline, states = Timeline(spec), _states()
    (first,) = timeline.due(0.0, 1, states)
    assert first.action == "kill" and states[first.node] == "gone"
    second = timeline.due(0.0, 2, states)  # the victim comes back, then the round's kill
    assert [(f.action, f.node) for f in second][0] == ("join", first.node)
    assert second[1].action == "kill" and second[1].source == "repeat[0] #2"
    assert states[first.node] in ("running", "gone") and sum(s == "gone" for s in states.values()) == 1
    # The same seed draws the same victims.
    again, fresh = Timeline(spec), _states()
    assert [f.node for f in again.due(0.0, 1, fresh) + again.due(0.0, 2, fresh)] == [
        first.node,
        *(f.node for f in second),
    ]
    lonely = {"node0": "running", "node1": "gone", "node2": "gone", "node3": "paused"}
    spec_one = parse_spec(BASE + '[[event]]\nat_round = 0\naction = "kill"\nnodes = "random"\n')
    (skipped,) = Timeline(spec_one).due(0.0, 0, lonely)
    assert skipped.node is None and skipped.skipped == "no node to kill" and lonely["node0"] == "running"


def test_a_repeat_without_an_end_stops_at_the_last_round() -> None:
    spec = parse_spec(BASE + '[[repeat]]\naction = "pause"\nnodes = "random"\nevery_rounds = 2\n')
    assert [p.at for p in Timeline(spec).pending] == [0.0, 2.0, 4.0]


def test_a_node_that_just_came_back_is_not_the_next_random_victim_at_the_same_moment() -> None:
    text = '[[repeat]]\naction = "kill"\nnodes = "random"\nevery_rounds = 1\nfrom_round = 1\nback_after_rounds = 1\n'
    for seed in range(30):
        spec = parse_spec(BASE.replace("seed = 3", f"seed = {seed}") + text)
        timeline, states = Timeline(spec), _states()
        for k in range(1, 6):
            firings = timeline.due(0.0, k, states)
            back = {f.node for f in firings if f.action == "join"}
            victims = {f.node for f in firings if f.action == "kill"}
            assert len(victims) == 1 and not back & victims, (seed, k, firings)


def test_a_random_kill_takes_only_a_node_that_contributes_and_never_the_last_one() -> None:
    """A node whose process has not logged a round yet (starting, catching up) is no worker: a random kill, leave
    or pause skips it, and never takes the last node that contributes, which holds the swarm's model (the churn
    lab's kills once took every such node, and the swarm started again from round 0)."""
    spec = parse_spec(BASE + '[[repeat]]\naction = "kill"\nnodes = "random"\nevery_rounds = 1\nfrom_round = 0\n')
    for seed in range(20):
        timeline, states = Timeline(parse_spec(spec.text.replace("seed = 3", f"seed = {seed}"))), _states()
        (firing,) = timeline.due(0.0, 0, states, contributing={"node1", "node2"})
        assert firing.node in {"node1", "node2"}, (seed, firing)
        (firing,) = timeline.due(0.0, 1, states, contributing={"node1", "node2"})
        assert firing.node is None and firing.skipped == "no node to kill", (seed, firing)
        assert sum(s == "running" for s in states.values()) == 3
