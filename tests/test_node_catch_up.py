"""When a node decides it is behind the swarm, or off its line, and catches up (``Node._sync_on_start``,
``Node._catch_up_until``, ``Node._off_swarm``), tested without processes."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from swarmtrain.averaging import PROTOCOL_VERSION, leader_candidates
from swarmtrain.averaging.round import Phase
from swarmtrain.dht.membership import PeerRecord, off_swarm, plausible, swarm_round
from swarmtrain.node.node import SETTLE_WAIT_S, Node
from tests.conftest import tiny_config

PEERS = [f"peer-{c}" for c in "abcdef"]


def record(peer: str, round_: int) -> PeerRecord:
    return PeerRecord(
        peer_id=peer, proto=PROTOCOL_VERSION, run_id="swarmtrain", round=round_, phase="training", tokens_per_s=1.0,
        batch_size=4, digest=f"{round_:08x}",
    )  # fmt: skip


def starts_by_catching_up(node: Node, me: str, rounds: dict[str, int], my_round: int = 0) -> bool:
    """Whether ``me`` at ``my_round`` catches up before its first round, seeing peers at ``rounds``."""
    caught: list[bool] = []

    async def catch_up(*_: Any, **__: Any) -> None:
        caught.append(True)

    node._catch_up = catch_up  # type: ignore[method-assign]
    view = {p: record(p, r) for p, r in rounds.items()} | {me: record(me, my_round)}
    outer = SimpleNamespace(digest=lambda: f"{my_round:08x}")
    averager = SimpleNamespace(me=me, round=my_round, outer=outer, group_size=3)
    asyncio.run(node._sync_on_start(averager, SimpleNamespace(view=view), None))  # type: ignore[arg-type]
    return bool(caught)


@pytest.fixture
def node(tmp_path: Path, text_file: Path) -> Node:
    return Node(tiny_config(tmp_path, text_file, **{"averaging.group_size": 3}))


def test_another_gossip_group_ahead_is_not_news_that_i_am_behind(node: Node) -> None:
    """Six nodes that started together in groups of 3: the other group finished round 0 while mine waits for me."""
    me = PEERS[0]
    mine = set(leader_candidates(PEERS, me, 3, node.config.node.run_id, 0))
    rounds = {p: 0 if p in mine else 1 for p in PEERS if p != me}
    assert sorted(rounds.values()) == [0, 0, 1, 1, 1]
    assert not starts_by_catching_up(node, me, rounds)
    mate = sorted(mine - {me})[0]  # a member of my own group is past round 0: it went without me
    assert starts_by_catching_up(node, me, {**rounds, mate: 1})


def test_a_joiner_or_a_resumed_node_behind_the_swarm_catches_up(node: Node) -> None:
    me = PEERS[0]
    assert starts_by_catching_up(node, me, {p: 4 for p in PEERS[1:]})
    assert starts_by_catching_up(node, me, {p: 4 for p in PEERS[1:3]}, my_round=2)  # one group of three
    assert not starts_by_catching_up(node, me, {p: 2 for p in PEERS[1:3]}, my_round=2)  # in step: it goes on
    assert not starts_by_catching_up(node, me, {})  # alone


def test_a_node_catching_up_takes_an_averaging_donor_after_a_few_heartbeats(node: Node) -> None:
    """Found under load (test_node_resume): the two peers ahead averaged for most of each round, their group waiting
    for the node catching up, so it rarely saw one in its inner phase; it held out for such a donor for the whole
    30 s of its catch-up and missed four rounds."""
    me = PEERS[0]
    view = {p: record(p, 9).model_copy(update={"phase": "averaging"}) for p in PEERS[1:3]} | {me: record(me, 8)}
    fetched: list[tuple[list[str], int]] = []

    async def fetch_state(donors: list[str], digest: str, max_round: int, rewind: bool = False) -> bool:
        fetched.append((donors, max_round))
        averager.round = max_round
        return True

    async def refresh() -> None:
        pass

    status = SimpleNamespace(set=lambda *_: None)
    lifecycle = SimpleNamespace(advance=lambda event: events.append(event))
    events: list[object] = []
    averager = SimpleNamespace(me=me, round=8, outer=SimpleNamespace(digest=lambda: "mine", theta=None),
                               fetch_state=fetch_state, lifecycle=lifecycle)  # fmt: skip
    membership = SimpleNamespace(view=view, update=lambda **_: None, refresh=refresh)
    trainer = SimpleNamespace(load_vector=lambda _: None)
    node.status = status  # type: ignore[assignment]
    started = time.monotonic()
    asyncio.run(node._catch_up_until(averager, membership, trainer, started + 30.0))  # type: ignore[arg-type]
    waited = time.monotonic() - started
    assert fetched == [(PEERS[1:3], 9)] and events, (fetched, events)
    assert SETTLE_WAIT_S <= waited < SETTLE_WAIT_S + 5, waited


def test_a_node_catching_up_turns_from_a_donor_that_failed_to_the_live_ones(node: Node) -> None:
    """The churn test's joiner under load: its donor was killed in its inner phase while the live peers averaged
    (their group waiting for the joiner). The dead donor's record, still in view, was the only peer "training", so
    the joiner asked it alone again every heartbeat while its record lived; now it asks the others."""
    me, dead, live = PEERS[0], PEERS[1], PEERS[2:4]
    view = {dead: record(dead, 9)} | {p: record(p, 9).model_copy(update={"phase": "averaging"}) for p in live}
    view[me] = record(me, 8)
    fetched: list[list[str]] = []

    async def fetch_state(donors: list[str], digest: str, max_round: int, rewind: bool = False) -> bool:
        fetched.append(donors)
        if donors[0] == dead:
            return False  # its daemon is gone
        averager.round = max_round
        return True

    async def refresh() -> None:
        pass

    events: list[object] = []
    averager = SimpleNamespace(me=me, round=8, outer=SimpleNamespace(digest=lambda: "mine", theta=None),
                               fetch_state=fetch_state, lifecycle=SimpleNamespace(advance=events.append))  # fmt: skip
    membership = SimpleNamespace(view=view, update=lambda **_: None, refresh=refresh)
    node.status = SimpleNamespace(set=lambda *_: None)  # type: ignore[assignment]
    started = time.monotonic()
    trainer = SimpleNamespace(load_vector=lambda _: None)
    asyncio.run(node._catch_up_until(averager, membership, trainer, started + 30.0))  # type: ignore[arg-type]
    waited = time.monotonic() - started
    assert fetched[0] == [dead] and fetched[-1][:2] == live and [str(e) for e in events] == ["synced"], fetched
    assert waited < SETTLE_WAIT_S + 5, waited  # not until the dead donor's record expires (or the catch-up ends)


def test_a_node_that_every_peer_is_behind_trains_on_after_a_few_heartbeats(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    """Found in the churn lab: the one node that survived a wave of kills was left alone for its round and went to
    catch up. The fresh processes that joined meanwhile were at round 0, behind it: no donor could ever appear, yet
    it waited the whole 30 s, and they waited for it."""
    me = PEERS[0]
    view = {p: record(p, 0).model_copy(update={"state": "starting"}) for p in PEERS[1:4]} | {me: record(me, 4)}
    events: list[object] = []

    async def refresh() -> None:
        pass

    averager = SimpleNamespace(me=me, round=4, outer=SimpleNamespace(digest=lambda: "mine", theta=None),
                               lifecycle=SimpleNamespace(advance=events.append))  # fmt: skip
    membership = SimpleNamespace(view=view, update=lambda **_: None, refresh=refresh)
    node.status = SimpleNamespace(set=lambda *_: None)  # type: ignore[assignment]
    started = time.monotonic()
    asyncio.run(node._catch_up_until(averager, membership, None, started + 30.0))  # type: ignore[arg-type]
    waited = time.monotonic() - started
    assert [str(e) for e in events] == ["no_donor"] and SETTLE_WAIT_S <= waited < SETTLE_WAIT_S + 5, (events, waited)
    # Peers in step but behind are finishing the round I was left out of: I wait for its state, not train on.
    view[PEERS[1]] = record(PEERS[1], 3)
    events.clear()
    started = time.monotonic()
    with caplog.at_level("INFO", logger="swarmtrain.node.node"):
        asyncio.run(node._catch_up_until(averager, membership, None, started + SETTLE_WAIT_S + 6))  # type: ignore[arg-type]
    assert time.monotonic() - started >= SETTLE_WAIT_S + 6 and [str(e) for e in events] == ["no_donor"], events
    # Every few seconds of that wait the log says what the node sees, so a wait like it can be explained.
    seen = "still no donor for round 4; 3 peers in view: peer-b round 3 training 00000003; peer-c round 0"
    assert seen in caplog.text, caplog.text


def test_a_node_that_catches_up_with_the_swarms_final_state_finishes_without_another_round(
    tmp_path: Path, text_file: Path
) -> None:
    """Found in the churn lab: a node left out of round 4 of 6 caught up with the state the swarm had after its last
    round, then trained a seventh round and waited about 90 s for a group that no one would form."""
    node = Node(tiny_config(tmp_path, text_file, **{"node.rounds": 6}))
    lifecycle = SimpleNamespace(phase=Phase.CATCH_UP, advance=lambda _: None)
    averager = SimpleNamespace(me=PEERS[0], round=5, lifecycle=lifecycle, outer=SimpleNamespace(digest=lambda: "d"))
    finished: list[int] = []

    async def catch_up(*_: Any, **__: Any) -> None:
        averager.round, lifecycle.phase = 6, Phase.OBSERVE  # the swarm's final state: round 6 done

    async def finish(_trainer: Any, averager: Any, *_: Any) -> None:
        finished.append(averager.round)

    async def publish() -> None:  # what a node does once it has trained (or sat in on) a round, to average it
        raise AssertionError("went on to a round past the end of the run")

    node._catch_up, node._finish = catch_up, finish  # type: ignore[method-assign]
    trainer = SimpleNamespace(evaluate=lambda: 5.0, tokens=0)
    membership = SimpleNamespace(record=SimpleNamespace(round=6), update=lambda **_: None, publish=publish)
    node.run_dir.mkdir(parents=True)
    asyncio.run(node._train(trainer, averager, membership, None))  # type: ignore[arg-type]
    assert finished == [6]
    final = [json.loads(line) for line in node.metrics_path.read_text().splitlines()][-1]
    assert final["kind"] == "final" and final["round"] == 6


def test_the_swarms_round_is_the_median_of_the_peers_in_step_and_a_node_two_rounds_from_it_is_off_its_line() -> None:
    """A swarm split for longer than a catch-up: each part trained on, and two rounds apart they never meet again
    (a leader takes joins for its round and the next only). The smaller part is off the swarm's line; of two parts
    alike in size, the one behind."""
    me, a, b, c, d = PEERS[:5]

    def view(rounds: dict[str, int], catching_up: tuple[str, ...] = ()) -> dict[str, PeerRecord]:
        return {
            p: record(p, r).model_copy(update={"state": "catching_up" if p in catching_up else "training"})
            for p, r in rounds.items()
        }

    # One node ahead of two (the frozen node that trained alone): it is off, they are not.
    assert swarm_round(view({a: 10, b: 10}), me, 40) == 10 and off_swarm(view({a: 10, b: 10}), me, 40)
    assert not off_swarm(view({a: 10, me: 40}), b, 10)  # b's view: the node ahead is one of three
    # Two ahead of three, and two behind three: the two are off either way, the three are not.
    for far in (40, 2):
        assert off_swarm(view({a: far, b: 10, c: 10, d: 10}), me, far)
        assert not off_swarm(view({a: far, me: far, c: 10, d: 10}), b, 10)
    # Two and two: the pair behind goes to the pair ahead, which stays.
    assert off_swarm(view({a: 10, b: 40, c: 40}), me, 10) and not off_swarm(view({a: 10, me: 10, c: 40}), b, 40)
    # One round apart is a round in progress, not a split; peers catching up say nothing of the swarm's round.
    assert not off_swarm(view({a: 11, b: 11}), me, 10) and not off_swarm(view({a: 9, b: 9}), me, 10)
    assert not off_swarm(view({a: 40, b: 40}, catching_up=(a, b)), me, 10)
    # Records that lag many rounds but show states I began those rounds from are on my line, not a split: rounds
    # can be shorter than a heartbeat, and a node that wakes from a freeze sees the view it had before. Another
    # state at such a round is another line.
    lagging = view({a: 7, b: 8})
    assert off_swarm(lagging, me, 12) and not off_swarm(lagging, me, 12, held={7: "00000007", 8: "00000008"})
    # One record of my line (round 8) and one of another state (round 7): with mine, two of three at my round.
    assert not off_swarm(lagging, me, 12, held={7: "elsewhere", 8: "00000008"})
    assert off_swarm(view({a: 7, b: 7, c: 7, d: 8}), me, 12, held={7: "elsewhere", 8: "00000008"})
    # One peer far off cannot move a swarm of three in step.
    assert not off_swarm(view({a: 10, b: 10, c: 10_000}), me, 10) and not off_swarm(view({a: 10, b: 0}), me, 10)


def catch_up_state(node: Node, me: str, my_round: int, view: dict[str, PeerRecord]) -> tuple[list, list, Any]:
    """Run ``me``'s catch-up at ``my_round`` seeing ``view``: the downloads it asked for (donors, max round,
    rewind), the events, and the averager."""
    fetched: list[tuple[list[str], int, bool]] = []
    events: list[object] = []

    async def fetch_state(donors: list[str], digest: str, max_round: int, rewind: bool = False) -> bool:
        fetched.append((donors, max_round, rewind))
        averager.round = max_round if rewind else max(averager.round, max_round)
        return True

    async def refresh() -> None:
        pass

    averager = SimpleNamespace(me=me, round=my_round, outer=SimpleNamespace(digest=lambda: "mine", theta=None),
                               fetch_state=fetch_state, lifecycle=SimpleNamespace(advance=events.append))  # fmt: skip
    membership = SimpleNamespace(view=view | {me: record(me, my_round)}, update=lambda **_: None, refresh=refresh)
    node.status = SimpleNamespace(set=lambda *_: None)  # type: ignore[assignment]
    trainer = SimpleNamespace(load_vector=lambda _: None)
    asyncio.run(node._catch_up_until(averager, membership, trainer, time.monotonic() + 30.0))  # type: ignore[arg-type]
    return fetched, events, averager


def test_a_node_off_the_swarms_line_takes_the_swarms_state_from_behind_or_ahead(node: Node) -> None:
    """Before, a node ahead of the swarm found no donor (it only looked at peers at its round or later) and trained
    on alone; a node in a part behind took its own part's peers at its round for the swarm and stayed in step with
    them."""
    me = PEERS[0]
    # Ahead of three others, with one peer of my own part beside me: the donors are the three, my round goes back.
    mate = {PEERS[4]: record(PEERS[4], 40).model_copy(update={"digest": "mine"})}
    view = {p: record(p, 10) for p in PEERS[1:4]} | mate
    fetched, events, averager = catch_up_state(node, me, 40, view)
    assert fetched == [(PEERS[1:4], 10, True)] and averager.round == 10 and [str(e) for e in events] == ["synced"]
    # Behind a part ahead as large as mine (two and two): the donors are the part ahead, not my mate at my round.
    view = {PEERS[1]: record(PEERS[1], 10).model_copy(update={"digest": "mine"})} | {
        p: record(p, 40) for p in PEERS[2:4]
    }
    fetched, events, averager = catch_up_state(node, me, 10, view)
    assert fetched == [(PEERS[2:4], 40, True)] and averager.round == 40 and [str(e) for e in events] == ["synced"]


def test_a_node_goes_off_to_the_swarms_state_only_once_the_gap_has_lasted_past_the_records_of_the_dead(
    tmp_path: Path, text_file: Path
) -> None:
    """Peers that died together leave records behind for a while (``node.record_ttl_s`` in the DHT, as long again in
    the view): a gap that lasts no longer than that is not a split."""
    node = Node(tiny_config(tmp_path, text_file, **{"node.heartbeat_s": 0.05, "node.record_ttl_s": 0.2}))
    me = PEERS[0]
    lifecycle = SimpleNamespace(phase=Phase.IN_STEP)
    averager = SimpleNamespace(me=me, round=40, lifecycle=lifecycle)
    membership = SimpleNamespace(view={p: record(p, 10) for p in PEERS[1:3]} | {me: record(me, 40)})
    started = time.monotonic()
    assert not node._off_swarm(membership, averager)  # type: ignore[arg-type]
    while not node._off_swarm(membership, averager):  # type: ignore[arg-type]
        assert time.monotonic() - started < 5, "never went off to the swarm's state"
        time.sleep(0.02)
    assert time.monotonic() - started >= 2 * (0.2 + 0.05)
    # A gap that closes starts the count again; a node catching up or sitting in is never sent off again.
    assert not node._off_swarm(membership, averager)  # type: ignore[arg-type]
    averager.round = 11
    assert not node._off_swarm(membership, averager)  # type: ignore[arg-type]
    # The states it began its rounds from: a round it goes back to forgets the rounds past it (another line's).
    node._hold(39, "a")
    node._hold(40, "b")
    node._hold(10, "c")
    assert node._held == {10: "c"}
    averager.round, lifecycle.phase = 40, Phase.CATCH_UP
    time.sleep(0.6)
    assert not node._off_swarm(membership, averager)  # type: ignore[arg-type]
    lifecycle.phase = Phase.SOLO
    assert not node._off_swarm(membership, averager)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(200))
def test_of_two_parts_of_a_swarm_exactly_one_goes_to_the_others_state(seed: int) -> None:
    """Seeded: a swarm in two parts far apart in rounds (each part's members at its round or the next, mid-round),
    with peers catching up at any round beside them. Each node looks at the records as a node does (``plausible``
    from its own round, then ``off_swarm``): every member of the smaller part is off the swarm's line and no member
    of the larger one is; of two parts alike in size, the one behind is. Never both parts, never neither."""
    rng = random.Random(seed)
    sizes = [rng.randint(1, 5), rng.randint(1, 5)]
    bases = [rng.randint(1000, 2000)]
    bases.append(bases[0] + rng.choice([-1, 1]) * rng.randint(3, 1000))
    records: dict[str, PeerRecord] = {}
    part: dict[str, int] = {}
    for i, (size, base) in enumerate(zip(sizes, bases, strict=True)):
        for j in range(size):
            peer = f"part{i}-{j}"
            records[peer], part[peer] = record(peer, base + rng.randint(0, 1)), i
    for j in range(rng.randint(0, 2)):
        peer = f"joiner-{j}"
        records[peer] = record(peer, rng.randint(0, 3000)).model_copy(update={"state": "catching_up"})
    if sizes[0] != sizes[1]:
        goes = 0 if sizes[0] < sizes[1] else 1
    else:
        goes = 0 if bases[0] < bases[1] else 1
    for peer, i in part.items():
        others = {p: r for p, r in records.items() if p != peer}
        seen = plausible(others, records[peer].round, lambda *_: None)
        assert off_swarm(seen, peer, records[peer].round) == (i == goes), (peer, sizes, bases)
