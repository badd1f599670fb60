"""Whose state counts when a gossip round mixes (``Group.counted``, ``RoundSigner.check_held``).

A member's theta_g digest in its join is its own claim. Signed, a state counts in a mix only where another peer
certified that it held it at the end of a recent round, or most members of the group hold it (or no member's
state does either: a swarm's first rounds). So a member cannot bring a state of its own into an honest group and
pull it there; a member with a certified state of another gossip line still mixes with the others. Any key can
certify, so a public swarm also mixes states with its robust aggregator, whose radius is at least twice the
median step the members claim: a state certified by its own holder's second key counts, and moves the mix by at
most that radius, a share of it for each such state. In process
(memory transport), members signing with identity keys as nodes do; FedAvg outer step (lr 1, no momentum).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarmtrain.averaging import RoundSigner
from swarmtrain.averaging.group import Group, mixes
from swarmtrain.averaging.matchmaking import Lobby
from tests.test_byzantine import NUMEL, identities, make_group, play_round


def test_a_certificate_is_another_peers_signature_of_the_state_in_one_of_the_last_two_rounds() -> None:
    (alice, alice_key), (bob, bob_key), (carol, _) = identities()[:3]
    checker, bob_signs = RoundSigner(alice_key), RoundSigner(bob_key)
    cert = {"round": 4, "key": bob_signs.public, "sig": bob_signs.sign_held(4, "abcd")}
    assert checker.check_held(carol, "abcd", 5, cert) is None
    assert checker.check_held(carol, "abcd", 6, cert) is None  # a round of one in between keeps the state
    assert "round 4" in (checker.check_held(carol, "abcd", 7, cert) or "")  # an old state, replayed
    assert "round 4" in (checker.check_held(carol, "abcd", 4, cert) or "")
    assert "does not hold" in (checker.check_held(carol, "abce", 5, cert) or "")  # another state
    assert "does not hold" in (checker.check_held(carol, "abcd", 5, {**cert, "round": 3}) or "")
    assert "own holder" in (checker.check_held(bob, "abcd", 5, cert) or "")  # a member certifying itself
    for junk in (None, {}, {**cert, "round": True}, {**cert, "sig": "x"}, {**cert, "key": b"junk"}):
        assert checker.check_held(carol, "abcd", 5, junk) is not None, junk


async def test_a_member_bringing_a_state_of_its_own_is_not_mixed_in_and_takes_the_groups_state() -> None:
    """Three honest members on one state, a fourth (attack.kind = own-state) that moves its theta_g 10 times its
    norm away before every round (a state no peer certified). The group never mixes; the honest theta_g moves by
    the round's update alone, and the fourth member ends each round in the minority and resyncs to the group's
    state."""
    averagers = make_group("centered-clip", "own-state", members=4, hostile=1)
    for a in averagers:
        await a.start()
    honest = averagers[:3]
    generator = torch.Generator().manual_seed(5)
    for round_ in range(3):
        deltas = [0.01 * torch.randn(NUMEL, generator=generator) for _ in averagers]
        before = honest[0].outer.theta.clone()
        outcomes = await play_round(averagers, deltas, [1.0] * 4)
        for outcome in outcomes:
            assert outcome.group.size == 4 and not outcome.group.mixed and not outcome.mixed, (round_, outcome)
            assert outcome.group.counted == (True, True, True, False), (round_, outcome.group)
            assert outcome.group.certs == {}, outcome.group  # a state most members hold needs none
        assert {o.outcome for o in outcomes[:3]} == {"applied"}, (round_, outcomes)
        assert outcomes[3].outcome == "diverged-resynced", (round_, outcomes[3])
        moved = (honest[0].outer.theta - before).abs().max().item()
        assert moved < 0.1, f"round {round_}: the honest state moved by {moved}"
        assert all(torch.equal(a.outer.theta, honest[0].outer.theta) for a in averagers), round_


async def test_members_whose_states_did_not_count_do_not_outvote_the_members_whose_states_did() -> None:
    """Two honest members and two (attack.kind = own-state) that move their theta_g away before every round: half
    of a group of four. From round 1 on, the honest states carry certificates of round 0 and count, the others do
    not, so the group does not mix. Only members whose state counted vote on the round's digest: the honest two
    confirm every round (with all four digests voting, two of four was no majority and both counted themselves
    diverged every round: two peers stalled the group). The other two do not take the honest state from a vote of
    half the group; they catch up from the swarm."""
    averagers = make_group("centered-clip", "own-state", members=4, hostile=2)
    for a in averagers:
        await a.start()
    honest = averagers[:2]
    generator = torch.Generator().manual_seed(6)
    await play_round(averagers, [0.01 * torch.randn(NUMEL, generator=generator) for _ in averagers], [1.0] * 4)
    for round_ in (1, 2):
        deltas = [0.01 * torch.randn(NUMEL, generator=generator) for _ in averagers]
        before = honest[0].outer.theta.clone()
        outcomes = await play_round(averagers, deltas, [1.0] * 4)
        for outcome in outcomes:
            assert outcome.group.counted == (True, True, False, False) and not outcome.group.mixed, outcome.group
        assert [o.outcome for o in outcomes] == ["applied", "applied", "diverged", "diverged"], (round_, outcomes)
        assert torch.equal(honest[0].outer.theta, honest[1].outer.theta), round_
        moved = (honest[0].outer.theta - before).abs().max().item()
        assert moved < 0.1, f"round {round_}: the honest state moved by {moved}"


@pytest.mark.parametrize(("members", "hostile"), [(4, 1), (8, 3)])
async def test_a_state_certified_by_its_holders_second_identity_moves_a_robust_mix_by_at_most_its_radius(
    members: int, hostile: int
) -> None:
    """``hostile`` of ``members`` (attack.kind = self-certified) each move their theta_g 10 times its norm away
    before every round and join with a certificate of that state signed by a second key of their own: a peer id
    that never runs, which the certificate check cannot tell from a real peer's. Their states count and the group
    mixes, and they claim steps a million times their own. The public default mixes states with centered-clip,
    whose radius is at least twice the median claimed step (the honest members', as most are honest): the mix
    moves the honest state by at most ``hostile / (members - hostile)`` times that radius (under the plain mean
    each hostile state pulled it 1 / ``members`` of the way to 10 times its norm; with the mean of the claims, the
    radius would be the hostile ones'), not at all in round 0 (no step yet), and every member ends on one state."""
    averagers = make_group("centered-clip", "self-certified", members=members, hostile=hostile)
    for a in averagers:
        await a.start()
    honest = averagers[: members - hostile]
    mixed: list[torch.Tensor] = []  # honest[0]'s theta_g after the mix, before the round's update
    step = honest[0].outer.step
    honest[0].outer.step = lambda grad: (mixed.append(honest[0].outer.theta.clone()), step(grad))[-1]
    generator = torch.Generator().manual_seed(5)
    for round_ in range(3):
        deltas = [0.01 * torch.randn(NUMEL, generator=generator) for _ in averagers]
        before = honest[0].outer.theta.clone()
        radius = 2 * float(honest[0].outer.moved.sum()) ** 0.5  # every part's radius, in quadrature
        outcomes = await play_round(averagers, deltas, [1.0] * members)
        for outcome in outcomes:
            assert outcome.group.size == members and outcome.group.mixed and outcome.mixed, (round_, outcome)
            assert outcome.group.counted == (True,) * members, (round_, outcome.group)
            assert outcome.outcome == "applied", (round_, outcome)
        pulled = float((mixed[-1] - before).norm())
        bound = hostile / (members - hostile) * radius
        assert pulled <= bound * 1.0001, f"round {round_}: the mix moved the honest state by {pulled} > {bound}"
        assert round_ > 0 or pulled == 0, f"round 0: the mix moved the honest state by {pulled} with no step yet"
        assert all(torch.equal(a.outer.theta, honest[0].outer.theta) for a in averagers), round_


async def test_a_member_with_a_certified_state_of_another_line_mixes_with_the_group() -> None:
    """Round 0 in two pairs, each applying its own update: two lines, each certified by the other member of its
    pair. Round 1: both members of line A and one of line B. B's state is held by one member only, yet counts (its
    pair partner certified it), so the group mixes, and every member ends on the weighted mean of the two lines
    plus the round's update."""
    averagers = make_group("mean", "sign-flip", members=4, hostile=0)
    for a in averagers:
        await a.start()
    a1, a2, b1, b2 = averagers
    line_a, line_b = torch.full((NUMEL,), 0.5), torch.full((NUMEL,), -0.5)
    firsts = await asyncio.gather(
        play_round([a1, a2], [line_a, line_a], [1.0, 1.0]), play_round([b1, b2], [line_b, line_b], [1.0, 1.0])
    )
    assert [o.outcome for pair in firsts for o in pair] == ["applied"] * 4, firsts
    assert a1.certified is not None and b1.certified is not None
    assert a1.certified[0] != b1.certified[0]  # two lines
    mixed_state = (2 * a1.outer.theta + b1.outer.theta) / 3
    zero = torch.zeros(NUMEL)
    outcomes = await play_round([a1, a2, b1], [zero, zero, zero], [1.0, 1.0, 1.0])
    for outcome in outcomes:
        assert outcome.group.mixed and outcome.mixed and outcome.outcome == "applied", outcome
        assert outcome.group.counted == (True, True, True), outcome.group
    for a in (a1, a2, b1):
        assert torch.allclose(a.outer.theta, mixed_state, atol=1e-6)


@pytest.mark.parametrize(("line_b_members", "line_b_step"), [(2, 0.5), (1, 0.25), (1, 2.0)])
async def test_a_robust_mix_takes_a_line_within_twice_the_median_step_whole_and_a_farther_one_by_the_radius(
    line_b_members: int, line_b_step: float
) -> None:
    """The public default (centered-clip) mixes states too. Round 0 in two pairs, as above: line A steps by 0.5 in
    every coordinate, line B by ``line_b_step`` the other way. Round 1: both members of line A and
    ``line_b_members`` of line B. Two against two, the mix is the mean of the two lines, as the plain mean's. Two
    against one, the radius is twice the median claimed step (line A's, 0.5 per coordinate): a line within it (0.75
    from A) counts as in the mean, and one beyond it (2.5 from A), as a made-up state would be, pulls the mix
    121/243 of the radius toward it (five centered-clip steps of r / 3 against the others' pull back)."""
    averagers = make_group("centered-clip", "sign-flip", members=4, hostile=0)
    for a in averagers:
        await a.start()
    a1, a2, b1, b2 = averagers
    line_a, line_b = torch.full((NUMEL,), 0.5), torch.full((NUMEL,), -line_b_step)
    await asyncio.gather(
        play_round([a1, a2], [line_a, line_a], [1.0, 1.0]), play_round([b1, b2], [line_b, line_b], [1.0, 1.0])
    )
    group = [a1, a2, b1, b2][: 2 + line_b_members]
    theta_a, theta_b = a1.outer.theta.clone(), b1.outer.theta.clone()
    if line_b_members == 2:
        expected = (theta_a + theta_b) / 2
    elif line_b_step == 0.25:
        expected = (2 * theta_a + theta_b) / 3
    else:
        radius = 2 * 0.5 * NUMEL**0.5
        expected = theta_a + (theta_b - theta_a) / float((theta_b - theta_a).norm()) * radius * 121 / 243
    outcomes = await play_round(group, [torch.zeros(NUMEL)] * len(group), [1.0] * len(group))
    for outcome in outcomes:
        assert outcome.group.mixed and outcome.mixed and outcome.outcome == "applied", outcome
        assert outcome.group.counted == (True,) * len(group), outcome.group
    for a in group:
        assert torch.allclose(a.outer.theta, expected, atol=1e-5), (a.outer.theta[:4], expected[:4])


async def test_a_member_refuses_a_group_that_left_out_its_certificate_or_counts_an_uncertified_state() -> None:
    """The group a leader answers with is checked by each member: a leader that drops a member's certificate (so
    that no state is certified and every one counts, its own too), or counts a state no certificate backs, is
    refused."""
    averagers = make_group("mean", "sign-flip", members=3, hostile=0)
    leader, member, other = averagers
    certifier = RoundSigner(identities()[-1][1])
    cert = {"round": 0, "key": certifier.public, "sig": certifier.sign_held(0, "mine")}
    request = {"round": 1, "weight": 1.0, "digest": "mine", "cap_s": 10.0, "cert": cert}
    members = (leader.me, member.me, other.me)

    def answer(counted: list[bool], certs: dict) -> dict:
        digests = ("x", "mine", "y")
        lobby = Lobby(1)
        lobby.settle(
            Group(1, members, (1.0,) * 3, mixes(list(digests), counted), counted=tuple(counted), digests=digests,
                  certs=certs)
        )  # fmt: skip
        return lobby.answer()

    honest = member.matchmaker._parse_group(1, answer([False, True, False], {member.me: cert}), request)
    assert honest is not None and honest.counted == (False, True, False) and not honest.mixed, honest
    for counted, certs in [([True, True, True], {}), ([True, True, False], {member.me: cert})]:
        assert member.matchmaker._parse_group(1, answer(counted, certs), request) is None, (counted, certs)


@pytest.mark.parametrize("where", ["every shard", "its own shard"])
async def test_a_member_that_sends_another_state_than_the_one_it_joined_with_is_refused_and_banned(where: str) -> None:
    """Round 1 as above (a1, a2 of line A, b1 of line B, each certified), but b1 sends its state plus 100 in the mix
    instead of the state it joined with: to every reducer, or only into its own shard (which it reduces itself).
    An honest reducer refuses such parts (each must hash to the member's chunk hash, and those to its digest);
    b1's own shard holds them, and every member checks it (verify = 7): the evidence holds parts that are not b1's
    state, so its shard is withheld. Either way the group does not mix: the honest members keep line A, bit for
    bit alike, and ban b1."""
    averagers = make_group("mean", "sign-flip", members=4, hostile=0, verify=7.0)
    for a in averagers:
        a.matchmaker.bans.rounds = 3
        await a.start()
    a1, a2, b1, b2 = averagers
    line_a, line_b = torch.full((NUMEL,), 0.5), torch.full((NUMEL,), -0.5)
    await asyncio.gather(
        play_round([a1, a2], [line_a, line_a], [1.0, 1.0]), play_round([b1, b2], [line_b, line_b], [1.0, 1.0])
    )
    honest_allreduce = b1._allreduce

    def another_state(group, vector, deadline, **kwargs):
        exchange = honest_allreduce(group, vector, deadline, **kwargs)
        if kwargs.get("tag") == "/state":
            own_start, own_end = exchange.bounds[exchange.index]
            honest_encode = exchange._encode_up

            def encode_up(start: int, end: int) -> bytes:
                if where == "every shard" or own_start <= start < own_end:
                    return exchange.codec_up.encode(vector[start:end] + 100.0)
                return honest_encode(start, end)

            exchange._encode_up = encode_up
            exchange._check_chunk = lambda *args: None  # a hostile member does not check its own parts
        return exchange

    b1._allreduce = another_state
    before = a1.outer.theta.clone()
    zero = torch.zeros(NUMEL)
    outcomes = await play_round([a1, a2, b1], [zero, zero, zero], [1.0, 1.0, 1.0])
    for outcome in outcomes[:2]:
        assert outcome.group.mixed and not outcome.mixed, outcome
    assert torch.equal(a1.outer.theta, before) and torch.equal(a2.outer.theta, before)
    for a in (a1, a2):
        reason = a.matchmaker.bans.reason(b1.me, 2) or ""
        assert "not the state its sender joined with" in reason, a.matchmaker.bans.bans
