"""The round protocol in process: real Averagers over an in-memory network with seeded faults (milliseconds)."""

from __future__ import annotations

import asyncio
import struct

import pytest
import torch

from swarmtrain.averaging import Averager, Group, gossip_groups, leader_candidates, outer_digest
from swarmtrain.averaging.matchmaking import Lobby
from swarmtrain.averaging.outer import OuterOptimizer, chunk_numel
from swarmtrain.averaging.round import Phase
from swarmtrain.compression import get_codec
from swarmtrain.errors import IncompatibleSwarm
from swarmtrain.net import MemoryNetwork, PeerUnreachable, Rejected, RemoteError

NUMEL = 10_000


def make_swarm(
    n: int, codec: str = "fp32", *, lr: float = 1.0, momentum: float = 0.0, part_numel: int = 1000,
    min_deadline: float = 2.0,
):  # fmt: skip
    net = MemoryNetwork()
    averagers = []
    for i in range(n):
        transport = net.transport(f"peer{i}")
        averagers.append(
            Averager(
                transport, torch.zeros(NUMEL), run_id="test", group_size=16, outer_lr=lr, outer_momentum=momentum,
                codec_up=get_codec(codec), codec_down=get_codec(codec), part_numel=part_numel,
                min_deadline=min_deadline, deadline_factor=4.0,
            )
        )  # fmt: skip
    return net, averagers


async def run_round(averagers, deltas, weights, alive=None):
    peers = [a.me for a in averagers]
    alive = alive or peers
    tasks = [
        a.run_round(d, w, leader_candidates(alive, a.me, 16, "test", a.round), set(alive), gather_timeout=2.0)
        for a, d, w in zip(averagers, deltas, weights, strict=True)
        if a.me in alive
    ]
    return await asyncio.gather(*tasks, return_exceptions=True)


async def test_group_applies_the_token_weighted_average_bit_identically() -> None:
    net, averagers = make_swarm(4)
    for a in averagers:
        await a.start()
    torch.manual_seed(0)
    deltas = [torch.randn(NUMEL) for _ in averagers]
    weights = [100.0, 200.0, 300.0, 400.0]
    outcomes = await run_round(averagers, deltas, weights)
    assert {o.outcome for o in outcomes} == {"applied"}
    assert len({o.digest for o in outcomes}) == 1 and outcomes[0].group.size == 4
    expected = -sum(w * d for w, d in zip(weights, deltas, strict=True)) / sum(weights)
    torch.testing.assert_close(averagers[0].outer.theta, expected)
    assert all(a.round == 1 for a in averagers)


async def test_a_round_whose_members_all_answer_at_once_pings_nobody() -> None:
    """A member pings a peer only once it has waited on it a ping interval: where every part, result, report and
    digest is there at once, each ping would be a stream opened and served at both ends for nothing."""
    net, averagers = make_swarm(4)
    for a in averagers:
        await a.start()
    calls: list[str] = []
    net.before_call = lambda src, dst, method, header: calls.append(method)
    outcomes = await run_round(averagers, [torch.randn(NUMEL) for _ in averagers], [1.0] * 4)
    assert {o.outcome for o in outcomes} == {"applied"} and len({o.digest for o in outcomes}) == 1
    assert {"parts", "results", "report", "digest"} <= set(calls) and "ping" not in calls


async def test_a_reducer_killed_after_its_first_part_is_dropped_the_same_way_by_all() -> None:
    net, averagers = make_swarm(4)
    for a in averagers:
        await a.start()
    sent = {"peer3": 0}

    def fail_at(src: str, dst: str, method: str, header: dict) -> None:
        if src == "peer3" and method == "parts#frame":
            sent["peer3"] += 1
            if sent["peer3"] == 2:
                net.kill("peer3")
                raise PeerUnreachable("killed")

    net.before_call = fail_at
    deltas = [torch.randn(NUMEL) for _ in averagers]
    loop = asyncio.get_running_loop()
    started = loop.time()
    survivors = (await run_round(averagers, deltas, [1.0] * 4))[:3]
    assert loop.time() - started < averagers[0].deadline_s() + 3.0
    assert len({o.digest for o in survivors}) == 1
    assert {o.outcome for o in survivors} == {"fallback"}
    assert all("peer3" in o.excluded for o in survivors)
    # The dead reducer's shard (the last quarter) got the same fallback everywhere: no update there.
    assert torch.count_nonzero(averagers[0].outer.theta[-NUMEL // 4 :]) == 0
    # And the next round among the survivors is clean.
    outcomes = await run_round(averagers[:3], deltas[:3], [1.0] * 3)
    assert {o.outcome for o in outcomes} == {"applied"} and len({o.digest for o in outcomes}) == 1


async def test_bad_payload_excludes_the_sender_but_keeps_replicas_identical() -> None:
    net, averagers = make_swarm(3)
    for a in averagers:
        await a.start()
    fp32 = get_codec("fp32")

    class NaNInjector:  # a malicious or broken peer: valid framing, a NaN in every payload
        name, sparse = "fp32", False

        def encode(self, tensor, state=None):
            payload = bytearray(fp32.encode(tensor))
            payload[-4:] = struct.pack("<f", float("nan"))
            return bytes(payload)

        def encode_feedback(self, tensor, residual, decoded):
            return self.encode(tensor)

        def decode(self, payload, numel, **options):
            return fp32.decode(payload, numel, **options)

    averagers[2].codec_up = NaNInjector()
    deltas = [torch.randn(NUMEL) for _ in averagers]
    outcomes = await run_round(averagers, deltas, [1.0] * 3)
    assert outcomes[0].digest == outcomes[1].digest
    assert torch.isfinite(averagers[0].outer.theta).all()
    assert all("peer2" in o.excluded for o in outcomes[:2])
    # The others still send the bad sender their reports and digests, so it applies the same fallback and ends
    # with their state: nothing to catch up.
    assert [o.outcome for o in outcomes] == ["fallback"] * 3 and outcomes[2].digest == outcomes[0].digest
    assert averagers[2].lifecycle.phase is not Phase.CATCH_UP


async def test_a_member_whose_join_answer_was_lost_asks_again_and_averages_with_the_group() -> None:
    """Under load a join's answer can be cut after the leader put the member in its group: the member asks the
    same leader again and gets that group, instead of leading alone while the group waits for it in vain."""
    net, averagers = make_swarm(3)
    for a in averagers:
        await a.start()
    transport = averagers[2].transport
    original = transport.call_stream
    lost: list[str] = []

    async def answer_lost_once(peer, method, header, frames, *, count, timeout):
        answer = await original(peer, method, header, frames, count=count, timeout=timeout)
        if method == "join" and not lost:
            lost.append(peer)
            raise PeerUnreachable(f"join to {peer}: stream reset")
        return answer

    transport.call_stream = answer_lost_once
    outcomes = await run_round(averagers, [torch.randn(NUMEL) for _ in averagers], [1.0] * 3)
    assert lost == ["peer0"]
    assert [o.outcome for o in outcomes] == ["applied"] * 3 and len({o.digest for o in outcomes}) == 1


@pytest.mark.parametrize("answered", ["peer1", "peer2"])
async def test_members_whose_leader_froze_while_answering_them_still_average_together(answered: str) -> None:
    """The leader formed the group and froze (SIGSTOP) after answering one member: the other never heard of it and
    gives up on the leader. It asks its next candidate (peer2 asks peer1) or, itself next, leads and finds no one
    (peer1). Either way it must learn the group from the member that holds it: it led a group of one and the member
    with the group averaged with nobody, and both live members diverged (what test_churn's frozen node showed once
    in CI)."""
    net, averagers = make_swarm(3)
    for a in averagers:
        await a.start()
    leader = averagers[0]
    on_join = leader.matchmaker.on_join

    async def answer_one_then_freeze(sender, header, position):
        answer = await on_join(sender, header, position)
        if sender != answered:
            net.freeze(leader.me)
            await asyncio.sleep(3600)  # its answer never leaves the frozen process
        return answer

    leader.matchmaker.on_join = answer_one_then_freeze
    outcomes = await run_round(averagers, [torch.randn(NUMEL) for _ in averagers], [1.0] * 3)
    live = {o.group.members: o for o in outcomes[1:]}
    seen = [(o.outcome, o.group.members) for o in outcomes[1:]]
    assert set(live) == {("peer0", "peer1", "peer2")}, f"the live members did not meet in the leader's group: {seen}"
    assert {o.outcome for o in outcomes[1:]} == {"fallback"}, seen  # the frozen leader's shard falls back
    assert outcomes[1].digest == outcomes[2].digest


async def test_a_probe_is_answered_at_once_and_only_a_group_matching_the_senders_messages_is_taken() -> None:
    """A probe never waits in a lobby: a peer whose group is not formed refuses it at once and takes no joiner. A
    member waiting on its leader takes a probed group only if it is the group whose messages that member sent it,
    with the leader in it: a peer that sends one group's messages and answers with another is ignored."""
    net, (leader, member, other) = make_swarm(3)
    for a in (leader, member, other):
        await a.start()
    request = {**member.matchmaker.header, "round": 0, "weight": 1.0, "digest": "x", "cap_s": 10.0}
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(RemoteError) as refused:
        await member.transport.call(other.me, "join", {**request, "probe": True}, timeout=5.0)
    assert refused.value.code == "no-group" and loop.time() - started < 0.5
    assert not other.matchmaker.lobbies[0].joined, "a probe joined a lobby"

    group = Group(0, (leader.me, member.me, other.me), (1.0, 1.0, 1.0))
    forged = Group(0, (leader.me, member.me, other.me), (1.0, 1.0, 9.0))  # another weight: another group id
    for answered, expected in [(forged, None), (group, group)]:
        other.matchmaker.lobbies[0] = lobby = Lobby(0)
        lobby.settle(answered)
        member.matchmaker.heard = {other.me: (group.group_id, loop.time() - 10.0)}
        answer = await member.matchmaker._probe(leader.me, request, probed := set())
        taken = None if answer is None else member.matchmaker._parse_group(0, answer, request)
        assert taken == expected, f"took {taken} from a peer whose messages were for {group.group_id}"
    assert probed == {other.me}


async def test_a_leader_alone_at_its_gather_timeout_waits_for_a_member_still_finishing_the_last_round() -> None:
    net, averagers = make_swarm(2)
    for a in averagers:
        await a.start()
    peers = [a.me for a in averagers]

    async def late_member():
        await asyncio.sleep(1.5)  # still in the last round's exchange when the leader's gather timeout passes
        return await averagers[1].run_round(torch.ones(NUMEL), 1.0, peers, set(peers), gather_timeout=0.5)

    leader = averagers[0].run_round(torch.ones(NUMEL), 1.0, peers, set(peers), gather_timeout=0.5)
    outcomes = await asyncio.gather(leader, late_member())
    assert [o.group.size for o in outcomes] == [2, 2] and {o.outcome for o in outcomes} == {"applied"}


async def test_a_diverged_node_contributes_nothing_and_still_receives_the_average() -> None:
    net, averagers = make_swarm(3)
    for a in averagers:
        await a.start()
    deltas = [torch.ones(NUMEL), 3 * torch.ones(NUMEL), torch.full((NUMEL,), float("inf"))]
    outcomes = await run_round(averagers, deltas, [1.0] * 3)
    assert len({o.digest for o in outcomes}) == 1 and {o.outcome for o in outcomes} == {"applied"}
    torch.testing.assert_close(averagers[2].outer.theta, torch.full((NUMEL,), -2.0))


def test_gossip_groups_cover_everyone_and_change_with_the_round() -> None:
    peers = [f"p{i}" for i in range(10)]
    groups = gossip_groups(peers, 3, "run", 0)
    assert sorted(p for g in groups for p in g) == sorted(peers)
    assert all(3 <= len(g) <= 3 for g in groups[:-1]) or all(2 <= len(g) <= 3 for g in groups)
    assert groups != gossip_groups(peers, 3, "run", 1)
    assert gossip_groups(peers[:4], 16, "run", 0) == [sorted(peers[:4])]
    assert leader_candidates(peers[:4], "p2", 16, "run", 0) == sorted(peers[:4])


async def test_without_an_outer_momentum_the_state_members_hash_and_mix_is_theta_g_alone() -> None:
    """FedAvg and SparseLoCo's outer step keep no momentum: no buffer of zeros as large as the model to keep, hash
    and mix. A gossip round (members whose theta_g differ) then sends a third fewer bytes: theta_g and the update
    (fp32) instead of theta_g, the momentum and the update."""
    sent, rng = {}, torch.Generator().manual_seed(3)
    thetas, deltas = [torch.randn(NUMEL, generator=rng) for _ in range(3)], [torch.randn(NUMEL, generator=rng)] * 3
    for momentum in (0.0, 0.9):
        net, averagers = make_swarm(3, lr=0.7, momentum=momentum)
        for a, theta in zip(averagers, thetas, strict=True):
            a.outer.theta.copy_(theta)
            await a.start()
        outcomes = await run_round(averagers, deltas, [1.0] * 3)
        assert all(o.group.mixed and o.outcome == "applied" for o in outcomes), outcomes
        assert len({o.digest for o in outcomes}) == 1
        sent[momentum] = sum(a.transport.counter.sent for a in averagers)
        if momentum == 0.0:
            assert all(a.outer.buf is None and list(a.outer.state_tensors()) == ["theta"] for a in averagers)
            assert outcomes[0].digest == outer_digest(averagers[0].outer.theta)
    assert 0.6 < sent[0.0] / sent[0.9] < 0.7, sent


@pytest.mark.parametrize(("numel", "momentum"), [(NUMEL, 0.0), (NUMEL, 0.9), (3001, 0.9)])
def test_the_step_a_member_claims_is_how_far_its_last_outer_step_moved_each_chunk_of_its_state(
    numel: int, momentum: float
) -> None:
    """``OuterOptimizer.moved``, what a member claims in a gossip mix (``Aggregator.floor``): zero before the first
    step whatever theta_g is, then the squares of what the last step changed in each chunk of theta_g and the
    momentum end to end (with 3001 elements a chunk spans the end of theta_g and the start of the momentum)."""
    rng = torch.Generator().manual_seed(1)
    outer = OuterOptimizer(torch.randn(numel, generator=rng), lr=0.7, momentum=momentum)
    assert torch.equal(outer.moved, torch.zeros_like(outer.moved))
    for _ in range(3):
        before = [t.clone() for t in outer.state_tensors().values()]
        outer.step(torch.randn(numel, generator=rng))
        change = torch.cat([t - b for t, b in zip(outer.state_tensors().values(), before, strict=True)])
        chunk = chunk_numel(change.numel())
        expected = torch.stack([c.double().square().sum() for c in change.split(chunk)])
        torch.testing.assert_close(outer.moved, expected, rtol=1e-4, atol=0.0)


@pytest.mark.parametrize("codec", ["fp16", "int8", "int4", "topk:frac=0.05", "powersgd:rank=2"])
async def test_lossy_down_codec_still_gives_identical_replicas(codec: str) -> None:
    # No member fails here, so the deadline only bounds compute: PowerSGD's takes over a second a round in
    # process, and a busy machine must not turn that into a missed deadline.
    net, averagers = make_swarm(4, codec, lr=0.7, momentum=0.9, min_deadline=30.0)
    for a in averagers:
        await a.start()
    for _ in range(3):
        deltas = [torch.randn(NUMEL) for _ in averagers]
        outcomes = await run_round(averagers, deltas, [1.0, 2.0, 3.0, 4.0])
        assert len({o.digest for o in outcomes}) == 1 and {o.outcome for o in outcomes} == {"applied"}
    # Error feedback: what the lossy uplink dropped waits in each sender's residual for the next round.
    assert all(a.residual is not None and a.residual.abs().sum() > 0 for a in averagers)


async def test_error_feedback_delivers_what_a_sparse_codec_dropped() -> None:
    """One member, the same update every round: with top-k and error feedback the applied total catches up
    with the sum of the updates, instead of losing 95 % of every round."""
    net, averagers = make_swarm(2, "topk:frac=0.05")
    for a in averagers:
        await a.start()
    delta = torch.randn(NUMEL)
    rounds = 30
    for _ in range(rounds):
        await run_round(averagers, [delta, torch.zeros(NUMEL)], [1.0, 1.0])
    # FedAvg with two equal weights: the ideal theta is -rounds * delta / 2.
    ideal = -rounds * delta / 2
    error = (averagers[0].outer.theta - ideal).norm() / ideal.norm()
    assert error < 0.35, error


async def test_a_node_with_another_model_shape_stops_with_a_clear_error() -> None:
    net = MemoryNetwork()
    averagers = [
        Averager(
            net.transport(f"peer{i}"), torch.zeros(numel), run_id="test", group_size=16, outer_lr=1.0,
            outer_momentum=0.0, codec_up=get_codec("fp16"), codec_down=get_codec("fp16"), part_numel=1000,
            min_deadline=2.0, deadline_factor=4.0,
        )
        for i, numel in enumerate([NUMEL, NUMEL + 1])
    ]  # fmt: skip
    for a in averagers:
        await a.start()
    outcomes = await run_round(averagers, [torch.zeros(NUMEL), torch.zeros(NUMEL + 1)], [1.0, 1.0])
    assert isinstance(outcomes[1], IncompatibleSwarm), outcomes[1]
    assert f"{NUMEL + 1} parameters, but this swarm trains {NUMEL}" in str(outcomes[1])


async def test_a_report_lost_to_a_broken_stream_is_sent_again() -> None:
    net, averagers = make_swarm(3)
    for a in averagers:
        await a.start()
    broken = {"left": 1}

    def break_once(src: str, dst: str, method: str, header: dict) -> None:
        if (src, dst, method) == ("peer1", "peer2", "report") and broken["left"]:
            broken["left"] -= 1
            raise PeerUnreachable("stream reset")

    net.before_call = break_once
    loop = asyncio.get_running_loop()
    started = loop.time()
    outcomes = await run_round(averagers, [torch.randn(NUMEL) for _ in averagers], [1.0] * 3)
    assert broken["left"] == 0 and loop.time() - started < 2.0  # not a wait for the deadline
    assert {o.outcome for o in outcomes} == {"applied"} and len({o.digest for o in outcomes}) == 1
    assert all(not o.excluded for o in outcomes)


async def test_an_update_that_missed_its_round_joins_the_next_one_damped_by_its_staleness() -> None:
    net, averagers = make_swarm(3)
    for a in averagers:
        await a.start()
    peers = [a.me for a in averagers]
    stale = torch.randn(NUMEL)
    # Round 0: peer2 is too slow for the group of the other two; it ends alone with live peers.
    late = averagers[2].run_round(stale, 1.0, ["peer2"], set(peers), gather_timeout=0.5)
    fast = [a.run_round(torch.randn(NUMEL), 1.0, ["peer0", "peer1"], {"peer0", "peer1"}, 2.0) for a in averagers[:2]]
    outcomes = await asyncio.gather(late, *fast)
    assert outcomes[0].outcome == "diverged" and averagers[2].lifecycle.phase is Phase.CATCH_UP
    assert await averagers[2].fetch_state(["peer0"], outcomes[1].digest)
    # Round 1: everyone contributes; peer2's round-0 update rides along at 1 / (1 + 1).
    before = averagers[0].outer.theta.clone()
    deltas = [torch.randn(NUMEL) for _ in averagers]
    outcomes = await run_round(averagers, deltas, [1.0] * 3)
    assert {o.outcome for o in outcomes} == {"applied"} and len({o.digest for o in outcomes}) == 1
    expected = before - (deltas[0] + deltas[1] + deltas[2] + stale / 2) / 3
    torch.testing.assert_close(averagers[0].outer.theta, expected)
    assert averagers[2].lifecycle.stale is None  # carried once, not again


async def test_a_swarm_of_short_rounds_never_runs_out_of_routes() -> None:
    """Finished exchanges keep their route a while to refuse late messages; a node whose rounds are shorter than
    that grace period must still take part in every round (it used to refuse round 64: too many groups)."""
    net, averagers = make_swarm(2)
    for a in averagers:
        await a.start()
    for round_ in range(70):
        outcomes = await run_round(averagers, [torch.ones(NUMEL)] * 2, [1.0, 1.0])
        assert [getattr(o, "outcome", o) for o in outcomes] == ["applied", "applied"], f"round {round_}"


async def test_members_do_not_wait_on_a_leader_that_is_catching_up() -> None:
    """The first leader candidate is behind and downloading the swarm's state: the others are sent on to the next
    candidate at once, not after their join timeout (a frozen node's resync used to stall its group 30 s a round)."""
    net, averagers = make_swarm(3)
    for a in averagers:
        await a.start()
        a.matchmaker.join_timeout = 30.0
    behind, others = averagers[0], averagers[1:]
    behind.outer.theta.add_(1.0)  # an older state than theirs (one in step is told to ask again: next test)
    peers = [a.me for a in averagers]
    loop = asyncio.get_running_loop()
    started = loop.time()
    expected = {a.me for a in others}
    rounds = asyncio.gather(
        *(a.run_round(torch.ones(NUMEL), 1.0, leader_candidates(peers, a.me, 16, "test", 0), expected, 2.0)
          for a in others)
    )  # fmt: skip
    await asyncio.sleep(0.5)  # the others wait on it as their leader; then it finds it is behind
    assert behind.matchmaker.lobbies[0].joined.keys() == expected
    behind.matchmaker.catching_up = True
    outcomes = await rounds
    assert [o.group.members for o in outcomes] == [("peer1", "peer2")] * 2
    assert {o.outcome for o in outcomes} == {"applied"}
    assert loop.time() - started < 10.0, "the members waited on the leader that is catching up"


async def test_every_member_runs_the_same_budget_when_the_leader_measured_slower_rounds() -> None:
    # The leader's last transfer was slow (its deadline adapted to 40 s); the other members' were fast, so each
    # caps the leader's budget at 4 x 2 s. Capping it on its own, a member would run shorter phase deadlines than
    # the leader and decide on the reports while a live member's report is still due (sim seed 109288).
    net, averagers = make_swarm(3)
    for a in averagers:
        await a.start()
    averagers[0]._durations.append(10.0)
    for a in averagers[1:]:
        a._durations.append(0.1)
    outcomes = await run_round(averagers, [torch.ones(NUMEL)] * 3, [1.0, 1.0, 1.0])
    budgets = {a.me: a.budget_s(o.group) for a, o in zip(averagers, outcomes, strict=True)}
    assert set(budgets.values()) == {4 * 2.0}, f"one budget for the whole group (the least cap), got {budgets}"
    assert {o.outcome for o in outcomes} == {"applied"}


async def test_a_leader_catching_up_in_step_with_its_members_leads_them_once_it_is_done() -> None:
    """A peer froze (SIGSTOP) for a round: the leader waited for it, formed no group and, like the frozen peer
    after it resumed, kept theta_g and looked for peers ahead. Both are at the same round with the same state.
    The member asks the leader while the leader is still looking: it must be told to ask again, not sent on.
    Sent on, it led a group of its own while the leader, done looking, led another: two groups of one, and both
    live members diverged, round after round (scenario kill-pause-join, rounds 6 and 7)."""
    net, averagers = make_swarm(2, min_deadline=0.5)
    for a in averagers:
        await a.start()
    leader, member = averagers
    peers = [a.me for a in averagers]
    asked = asyncio.Event()
    on_join = leader.matchmaker.on_join

    async def recording(*args, **kwargs):
        try:
            return await on_join(*args, **kwargs)
        finally:
            asked.set()

    leader.matchmaker.on_join = recording
    leader.matchmaker.catching_up = True  # its last round ended alone: it looks for peers ahead
    member_round = asyncio.ensure_future(
        member.run_round(torch.ones(NUMEL), 1.0, peers, set(peers), gather_timeout=0.5)
    )
    await asyncio.wait_for(asked.wait(), 10.0)  # the member asked the leader while it was catching up
    leader.matchmaker.catching_up = False  # it found the member in step (same round, same digest)
    leader_round = leader.run_round(torch.ones(NUMEL), 1.0, peers, set(peers), gather_timeout=0.5)
    outcomes = await asyncio.gather(leader_round, member_round)
    seen = [(o.outcome, o.group.members) for o in outcomes]
    assert seen == [("applied", ("peer0", "peer1"))] * 2, f"the two live members averaged apart: {seen}"
    assert leader.outer.digest() == member.outer.digest()


@pytest.mark.parametrize("head_start", [0.0, 0.3])
async def test_two_members_that_take_each_other_for_leader_agree_on_one(head_start: float) -> None:
    """A member that just caught up sits in on the round and asks the others first (itself last); a member with a
    higher peer id asks it first, as everyone asks the lowest. Each asks the other while the other asks it: the
    lower one must lead. Each telling the other to lead, both led a group of one and diverged."""
    net, (low, high) = make_swarm(2, min_deadline=0.5)
    for a in (low, high):
        await a.start()
    peers = [low.me, high.me]
    observing = asyncio.ensure_future(
        low.run_round(torch.zeros(NUMEL), 0.0, [high.me, low.me], set(peers), gather_timeout=0.5)
    )
    await asyncio.sleep(head_start)  # 0.3: its join already waits in the higher one's lobby
    training = high.run_round(torch.ones(NUMEL), 1.0, [low.me, high.me], set(peers), gather_timeout=0.5)
    outcomes = await asyncio.gather(observing, training)
    seen = [(o.outcome, o.group.members) for o in outcomes]
    assert seen == [("applied", ("peer0", "peer1"))] * 2, f"the two members averaged apart: {seen}"


async def test_a_member_sent_on_to_a_leader_that_refuses_asks_the_one_that_sent_it_again() -> None:
    """A peer that resumed from SIGSTOP is far behind and refuses every join; only one of the two others sees it
    yet (its record was just republished). The one that sees it asks it first; the other asks that one meanwhile
    and is sent on to the same peer, which refuses both. The one sent on must ask again the member that sent it,
    which leads now. It took that member for tried and led a group of one: the two live members averaged apart and
    one diverged (test_churn's frozen node, under load)."""
    net, (behind, first, second) = make_swarm(3, min_deadline=0.5)
    for a in (behind, first, second):
        await a.start()

    async def refuse(*args, **kwargs):  # a process just woken up: it answers late, and no
        await asyncio.sleep(0.5)
        raise Rejected("round 66 is too far ahead of this peer's round 4")

    behind.matchmaker.on_join = refuse
    live = [first.me, second.me]
    sees_it = first.run_round(torch.ones(NUMEL), 1.0, [behind.me, *live], {behind.me, *live}, gather_timeout=1.0)
    leading = asyncio.ensure_future(sees_it)
    await asyncio.sleep(0.1)  # its join waits on the peer behind: its lobby sends joiners there
    does_not = second.run_round(torch.ones(NUMEL), 1.0, live, set(live), gather_timeout=1.0)
    outcomes = await asyncio.gather(leading, does_not)
    seen = [(o.outcome, o.group.members) for o in outcomes]
    assert seen == [("applied", ("peer1", "peer2"))] * 2, f"the two live members averaged apart: {seen}"


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1]], ids=["in-order", "out-of-order"])
async def test_a_shards_result_hash_folded_in_as_its_parts_arrive_is_the_hash_of_the_whole(order: list[int]) -> None:
    """Members hash each result part as it lands (``_result_hash``), not the whole shard after the transfer; the
    hash members compare must still be that of the shard's payloads in order and its masks, whatever order the
    parts came in."""
    import blake3

    from swarmtrain.averaging.allreduce import AllReduce

    group = Group(0, ("a", "b"), (1.0, 1.0))
    fp16 = get_codec("fp16")
    exchange = AllReduce(
        group, "a", torch.zeros(6000), MemoryNetwork().transport("a"), header={}, codec_up=fp16, codec_down=fp16,
        part_numel=1000, deadline=1e9,
    )  # fmt: skip
    values = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    masks = [b"\x03", b"\x02", b"\x03"]  # whom each part included: both members, then only b
    payloads = [fp16.encode(values[part * 1000 : (part + 1) * 1000]) for part in range(3)]
    for part in order:
        exchange.on_result("b", {"shard": 1, "part": part, "codec": "fp16"}, masks[part] + payloads[part])
    box = exchange.results[1]
    assert box.complete.is_set() and torch.equal(box.buffer, fp16.decode(fp16.encode(values), 3000))
    whole = blake3.blake3(b"".join(payloads) + b"".join(masks)).hexdigest()[:24]
    assert exchange._result_hash(1) == whole and not box.unhashed
