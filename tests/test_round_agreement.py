"""Round agreement under faults, honest peers only: every apply/fallback decision (per shard, whether a gossip
round mixes, the digest vote) is made from data every surviving member ends up holding identically.

Each test is one interleaving found by review (issue 10) on the in-memory transport; each failed on 15d95af.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from swarmtrain.averaging import Averager
from swarmtrain.averaging.attack import Attack
from swarmtrain.averaging.round import Event, Phase
from swarmtrain.compression import get_codec
from swarmtrain.net import MemoryNetwork, PeerUnreachable

NUMEL = 3_000


def make_swarm(thetas: list[torch.Tensor], *, part_numel: int = 500, min_deadline: float = 1.0, momentum: float = 0.0):
    net = MemoryNetwork()
    averagers = [
        Averager(
            net.transport(f"peer{i}"), theta.clone(), run_id="test", group_size=16, outer_lr=1.0,
            outer_momentum=momentum,
            codec_up=get_codec("fp32"), codec_down=get_codec("fp32"), part_numel=part_numel,
            min_deadline=min_deadline, deadline_factor=4.0,
        )
        for i, theta in enumerate(thetas)
    ]  # fmt: skip
    return net, averagers


async def run_round(averagers, deltas, weights, delays=None, peers=None):
    peers = peers or [a.me for a in averagers]

    async def one(a, d, w, delay):
        await asyncio.sleep(delay)
        return await a.run_round(d, w, peers, set(peers), gather_timeout=2.0)

    delays = delays or [0.0] * len(averagers)
    return await asyncio.gather(
        *(one(*args) for args in zip(averagers, deltas, weights, delays, strict=True)), return_exceptions=True
    )


def state_route(header: dict) -> bool:
    return str(header.get("group", "")).endswith("/state")


async def test_an_observer_that_lost_its_only_contributor_never_zeroes_theta() -> None:
    """Scenario 1: a mixed round of two, peer0 observes (weight 0); peer1's parts of the state exchange to peer0
    break once. peer0's shard of the state has no contributor: it must fall back, not average nothing into 0."""
    thetas = [torch.full((NUMEL,), 5.0), torch.full((NUMEL,), 7.0)]
    net, averagers = make_swarm(thetas)
    for a in averagers:
        await a.start()
    broken = []

    def break_once(src: str, dst: str, method: str, header: dict) -> None:
        if (src, dst, method) == ("peer1", "peer0", "parts") and state_route(header) and not broken:
            broken.append(header["group"])
            raise PeerUnreachable("stream reset")

    net.before_call = break_once
    delta = torch.randn(NUMEL)
    outcomes = await run_round(averagers, [torch.zeros(NUMEL), delta], [0.0, 1.0])
    assert broken, "the fault never fired"
    assert all(o.group.mixed for o in outcomes)
    # Both members decide alike: the state is not mixed (a shard of it had no contributor), the update is applied.
    assert [o.outcome for o in outcomes] == ["fallback", "fallback"], outcomes
    for a, theta in zip(averagers, thetas, strict=True):
        torch.testing.assert_close(a.outer.theta, theta - delta, msg=f"{a.me}: theta_g is not its own minus delta")
        assert a.lifecycle.phase is not Phase.CATCH_UP


async def test_whether_a_gossip_round_mixes_does_not_depend_on_who_saw_a_peer_die() -> None:
    """Scenario 2: mixed round of three; peer1's report to peer0 in the state exchange is slow, peer2 dies just
    after the state exchange. peer0's pings see peer2 die, peer1 does not: both must still mix alike."""
    torch.manual_seed(1)
    thetas = [torch.randn(NUMEL) for _ in range(3)]
    net, averagers = make_swarm(thetas)
    for a in averagers:
        await a.start()
    transport = averagers[1].transport
    original = transport.call_stream
    slowed = []

    async def slow_state_report(peer, method, header, frames, *, count, timeout):
        if (peer, method) == ("peer0", "report") and state_route(header) and not slowed:
            slowed.append(peer)
            await asyncio.sleep(2.0)
        return await original(peer, method, header, frames, count=count, timeout=timeout)

    transport.call_stream = slow_state_report

    def kill_after_state_exchange(src: str, dst: str, method: str, header: dict) -> None:
        if src == "peer2" and method == "parts" and "group" in header and not state_route(header):
            net.kill("peer2")
            raise PeerUnreachable("killed")

    net.before_call = kill_after_state_exchange
    deltas = [torch.randn(NUMEL) for _ in range(3)]
    weights = [1.0, 3.0, 2.0]
    outcomes = await run_round(averagers, deltas, weights)
    assert slowed and "peer2" in net.dead
    survivors = outcomes[:2]
    assert all(o.group.mixed and o.group.size == 3 for o in survivors)
    assert survivors[0].digest == survivors[1].digest, [o.outcome for o in survivors]
    assert [o.outcome for o in survivors] == ["fallback", "fallback"]
    # theta_g: the weighted mix of the three states, minus the average of the two updates that arrived; the dead
    # reducer's shard (the last third) gets no update on either member.
    mix = sum(w * t for w, t in zip(weights, thetas, strict=True)) / sum(weights)
    update = (weights[0] * deltas[0] + weights[1] * deltas[1]) / (weights[0] + weights[1])
    update[2 * NUMEL // 3 :] = 0
    for a in averagers[:2]:
        torch.testing.assert_close(a.outer.theta, mix - update)


async def test_a_report_that_reached_only_one_survivor_is_relayed_to_the_other() -> None:
    """Scenario 3: plain round of three. peer0's results stream to peer2 breaks, so peer2 reports shard 0
    missing; peer2 delivers that report to peer0 and dies before reaching peer1. Both survivors fall back alike."""
    net, averagers = make_swarm([torch.zeros(NUMEL) for _ in range(3)])
    for a in averagers:
        await a.start()

    def faults(src: str, dst: str, method: str, header: dict) -> None:
        if (src, dst, method) == ("peer0", "peer2", "results"):
            raise PeerUnreachable("stream reset")
        if (src, dst, method) == ("peer2", "peer1", "report"):
            net.kill("peer2")
            raise PeerUnreachable("killed")

    net.before_call = faults
    deltas = [torch.randn(NUMEL) for _ in range(3)]
    outcomes = await run_round(averagers, deltas, [1.0] * 3)
    assert "peer2" in net.dead
    survivors = outcomes[:2]
    assert survivors[0].digest == survivors[1].digest, [o.outcome for o in survivors]
    assert [o.outcome for o in survivors] == ["fallback", "fallback"]
    expected = -sum(deltas) / 3
    expected[: NUMEL // 3] = 0  # shard 0: the agreed fallback, no update
    for a in averagers[:2]:
        torch.testing.assert_close(a.outer.theta, expected)
        assert a.lifecycle.phase is not Phase.CATCH_UP


async def test_two_identical_survivors_of_four_confirm_each_other() -> None:
    """Half the group dies before the digest exchange: the two survivors hold the same state and say so."""
    net, averagers = make_swarm([torch.zeros(NUMEL) for _ in range(4)])
    for a in averagers:
        await a.start()

    def die_before_digest(src: str, dst: str, method: str, header: dict) -> None:
        if src in ("peer2", "peer3") and method == "digest":
            net.kill(src)
            raise PeerUnreachable("killed")

    net.before_call = die_before_digest
    deltas = [torch.randn(NUMEL) for _ in range(4)]
    outcomes = await run_round(averagers, deltas, [1.0] * 4)
    assert {"peer2", "peer3"} <= net.dead
    survivors = outcomes[:2]
    assert survivors[0].digest == survivors[1].digest
    assert [o.outcome for o in survivors] == ["applied", "applied"]
    assert all(a.lifecycle.phase is not Phase.CATCH_UP for a in averagers[:2])
    torch.testing.assert_close(averagers[0].outer.theta, -sum(deltas) / 4)


async def test_two_members_that_caught_up_together_sit_in_on_no_round_of_their_own() -> None:
    """Found by test_partition_heal under a busy core (343fe00): two nodes caught up to the same state after the
    others' group of that round had formed. The lower peer id led the two into a group of their own, weight 0
    each, and the outer momentum alone moved their theta_g off the line they had caught up to. A member that sits
    in does not lead: both find no group, keep theta_g and catch up again."""
    net, averagers = make_swarm([torch.zeros(NUMEL)] * 2, momentum=0.9)
    for a in averagers:
        await a.start()
    first = await run_round(averagers, [torch.randn(NUMEL)] * 2, [1.0, 1.0])
    assert [o.outcome for o in first] == ["applied", "applied"], first
    caught_up = averagers[0].outer.theta.clone()
    for a in averagers:
        a.lifecycle.advance(Event.OFF_SWARM)
        a.lifecycle.advance(Event.SYNCED)
    outcomes = await run_round(averagers, [torch.zeros(NUMEL)] * 2, [0.0, 0.0])
    assert [o.group.size for o in outcomes] == [1, 1], outcomes
    for a in averagers:
        assert torch.equal(a.outer.theta, caught_up), f"{a.me} moved off the state it caught up to"
        assert a.lifecycle.phase is Phase.CATCH_UP


@pytest.mark.parametrize(
    "delays", [(0.0, 0.0, 0.0), (0.0, 0.5, 0.5), (0.5, 0.0, 0.0)], ids=["together", "observer-first", "observer-last"]
)
async def test_a_member_sitting_in_with_the_lowest_peer_id_joins_the_group_the_others_form(delays) -> None:
    """peer0 just caught up and sits in (weight 0); it is everyone's first leader candidate, but does not lead.
    Whichever asks first, the three meet in one group, and peer0 ends in step with the state the others applied."""
    net, averagers = make_swarm([torch.zeros(NUMEL)] * 3)
    for a in averagers:
        await a.start()
    averagers[0].lifecycle.advance(Event.SYNCED)
    deltas = [torch.zeros(NUMEL), torch.randn(NUMEL), torch.randn(NUMEL)]
    outcomes = await run_round(averagers, deltas, [0.0, 1.0, 3.0], list(delays))
    assert all(o.group.members == ("peer0", "peer1", "peer2") for o in outcomes), outcomes
    assert [o.outcome for o in outcomes] == ["applied"] * 3, outcomes
    for a in averagers:
        torch.testing.assert_close(a.outer.theta, -(deltas[1] + 3 * deltas[2]) / 4)
    assert averagers[0].lifecycle.phase is Phase.IN_STEP


async def test_members_whose_first_candidate_sends_them_on_to_made_up_peers_meet_without_it() -> None:
    """peer0, everyone's first candidate, answers every join with a redirect to a made-up peer id, a new one each
    time, and never moves on from the round (``attack.kind = redirect``). Asking it again after each made-up peer
    failed, peer1 and peer2 went round for ever. Now each follows its redirects ``SENT_ON`` times and asks its next
    candidate: the two meet in a group of their own once peer1's gather timeout ends, and apply their mean."""
    net, averagers = make_swarm([torch.zeros(NUMEL)] * 3)
    for a in averagers:
        await a.start()
    averagers[0].matchmaker.hostile_join = Attack("redirect", seed=1).answer_join
    deltas = [torch.randn(NUMEL) for _ in range(2)]
    honest = averagers[1:]
    outcomes = await asyncio.wait_for(run_round(honest, deltas, [1.0, 1.0], peers=[a.me for a in averagers]), 15)
    assert all(o.group.members == ("peer1", "peer2") for o in outcomes), outcomes
    assert [o.outcome for o in outcomes] == ["applied"] * 2, outcomes
    for a in honest:
        torch.testing.assert_close(a.outer.theta, -(deltas[0] + deltas[1]) / 2)


@pytest.mark.parametrize("codec", ["fp32", "int8"])
async def test_what_a_shard_that_fell_back_carried_goes_back_into_the_residual_once(codec: str) -> None:
    """Nothing lost, nothing twice: a reducer dies after the others sent it their parts; its shard falls back
    everywhere, and each survivor keeps what it sent there for the next round (and nothing more elsewhere)."""
    net = MemoryNetwork()
    averagers = [
        Averager(
            net.transport(f"peer{i}"), torch.zeros(NUMEL), run_id="test", group_size=16, outer_lr=1.0,
            outer_momentum=0.0, codec_up=get_codec(codec), codec_down=get_codec(codec), part_numel=500,
            min_deadline=1.0, deadline_factor=4.0,
        )
        for i in range(3)
    ]  # fmt: skip
    for a in averagers:
        await a.start()

    def die_before_results(src: str, dst: str, method: str, header: dict) -> None:
        if src == "peer2" and method == "results":
            net.kill("peer2")
            raise PeerUnreachable("killed")

    net.before_call = die_before_results
    deltas = [torch.randn(NUMEL) for _ in range(3)]
    outcomes = await run_round(averagers, deltas, [1.0] * 3)
    assert [o.outcome for o in outcomes[:2]] == ["fallback", "fallback"]
    shard = slice(2 * NUMEL // 3, NUMEL)
    for a, delta in zip(averagers[:2], deltas[:2], strict=True):
        assert a.residual is not None
        # The fallen-back shard: all of the update waits in the residual (what was sent plus what the codec kept).
        torch.testing.assert_close(a.residual[shard], delta[shard])
        if codec == "fp32":  # lossless: nothing else is owed
            assert torch.count_nonzero(a.residual[: 2 * NUMEL // 3]) == 0
        # And theta_g got nothing of it there.
        assert torch.count_nonzero(a.outer.theta[shard]) == 0


async def test_a_part_its_reducer_left_out_of_a_shard_that_applied_goes_back_into_the_residual_once() -> None:
    """Nothing lost: peer1's stream of parts to peer0 (the reducer of shard 0) breaks after the first part, and
    peer1 stays live. peer0 reduces the rest of shard 0 without peer1 at its deadline and says so with each part;
    the shard applies everywhere, and peer1 (only peer1, only there) keeps what it sent for the next round."""
    net, averagers = make_swarm([torch.zeros(NUMEL) for _ in range(3)])
    for a in averagers:
        await a.start()
    broken = []

    def break_after_first_part(src: str, dst: str, method: str, header: dict) -> None:
        if (src, dst, method) == ("peer1", "peer0", "parts#frame") and header["frame"] == 1 and not broken:
            broken.append(header)
            raise ConnectionError("stream reset")

    net.before_call = break_after_first_part
    deltas = [torch.randn(NUMEL) for _ in range(3)]
    outcomes = await run_round(averagers, deltas, [1.0] * 3)
    assert broken and [o.outcome for o in outcomes] == ["applied"] * 3, outcomes
    assert len({o.digest for o in outcomes}) == 1
    shard0 = NUMEL // 3
    left_out = slice(500, shard0)  # parts 1.. of shard 0 (part_numel 500)
    theta = averagers[0].outer.theta
    # theta_g = -(average of what was included): all three everywhere but there, peer0 and peer2 there.
    torch.testing.assert_close(theta[left_out], -(deltas[0] + deltas[2])[left_out] / 2)
    torch.testing.assert_close(theta[shard0:], -sum(deltas)[shard0:] / 3)
    for i, a in enumerate(averagers):
        owed = torch.zeros(NUMEL)
        if i == 1:
            owed[left_out] = deltas[1][left_out]
        assert a.residual is not None
        torch.testing.assert_close(a.residual, owed)


async def test_a_member_cut_off_from_the_reports_sets_its_residual_to_the_groups_decision_once_it_asks() -> None:
    """Nothing twice: peer2 sends its parts, then hears no report and no digest (its links to them break; it
    stays live). Alone, it sees every shard fall back and keeps all it sent in its residual, while peer0 and
    peer1 apply the round with peer2's update in it. Before its next round it asks them for the decision they
    applied (``ledger``) and takes back out of its residual what the group did apply.

    peer0 and peer1 wait for peer2's reports until about the exchange's deadline, so their digests have little
    more than the digest exchange's floor (a tenth of the budget, half of it for the direct sends). A budget of
    9 s leaves the direct sends about half a second, room for a loaded machine's stalls; with 3 s they had 0.15 s,
    once too little under load, and both diverged."""
    net, averagers = make_swarm([torch.zeros(NUMEL) for _ in range(3)], min_deadline=3.0)
    for a in averagers:
        await a.start()

    def cut_peer2(src: str, dst: str, method: str, header: dict) -> None:
        if "peer2" in (src, dst) and method.split("#")[0] in ("report", "digest"):
            raise PeerUnreachable(f"{method}: stream reset")

    net.before_call = cut_peer2
    deltas = [torch.randn(NUMEL) for _ in range(3)]
    outcomes = await run_round(averagers, deltas, [1.0] * 3)
    net.before_call = None
    assert [o.outcome for o in outcomes] == ["applied", "applied", "diverged"], outcomes
    torch.testing.assert_close(averagers[0].outer.theta, -sum(deltas) / 3)
    cut = averagers[2]
    assert cut.residual is not None and cut.unsettled is not None
    torch.testing.assert_close(cut.residual, deltas[2])  # its own view: nothing applied
    for malformed in (["applied"], {"applied": [True] * 3, "masks": "ff"}, {"applied": [True] * 3, "masks": [[]] * 3}):
        assert cut.unsettled.returned(malformed) is None  # a hostile answer is ignored, not raised on
    await cut.reconcile()
    torch.testing.assert_close(cut.residual, torch.zeros(NUMEL))  # the group's: all of it applied, once
    assert cut.unsettled is None
    for a in averagers[:2]:
        assert a.residual is not None and torch.count_nonzero(a.residual) == 0


def test_the_ranges_given_back_are_those_the_masks_would_select() -> None:
    """``_give_back`` works by ranges: the gaps between the encoded parts, and a returned range cut to the parts
    that were encoded, select exactly what boolean masks over the whole update would."""
    from swarmtrain.averaging.allreduce import _gaps, _overlaps

    rng = random.Random(7)
    for _ in range(300):
        length = rng.randint(1, 60)
        cuts = sorted(rng.sample(range(length + 1), rng.randint(0, min(8, length + 1))))
        parts = [(a, b) for a, b in zip([0, *cuts], [*cuts, length], strict=True) if a < b]
        encoded = sorted(rng.sample(parts, rng.randint(0, len(parts))))
        mask = torch.zeros(length, dtype=torch.bool)
        for s, e in encoded:
            mask[s:e] = True
        gaps = torch.zeros(length, dtype=torch.bool)
        for s, e in _gaps(encoded, length):
            gaps[s:e] = True
        assert torch.equal(gaps, ~mask), (encoded, length)
        start = rng.randint(0, length - 1)
        end = rng.randint(start + 1, length)
        cut = torch.zeros(length, dtype=torch.bool)
        for s, e in _overlaps(encoded, start, end):
            cut[s:e] = True
        window = torch.zeros(length, dtype=torch.bool)
        window[start:end] = True
        assert torch.equal(cut, window & mask), (encoded, start, end)
