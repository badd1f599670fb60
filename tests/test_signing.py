"""Signed reports and digests (``averaging.signing``): a signature binds a member, a round and a value, a relayer
cannot make a member say what it did not, and an honest round pays one signature per message."""

from __future__ import annotations

import asyncio
import functools

import torch
from hivemind.utils.crypto import RSAPrivateKey

from swarmtrain.averaging import Averager, RoundOutcome, RoundSigner, leader_candidates
from swarmtrain.compression import get_codec
from swarmtrain.dht.identity import peer_id_of
from swarmtrain.net import MemoryNetwork, PeerUnreachable

NUMEL = 8_000


@functools.cache
def keys() -> list[tuple[str, RSAPrivateKey]]:
    made = [RSAPrivateKey() for _ in range(8)]
    return sorted((peer_id_of(k.get_public_key().to_bytes()), k) for k in made)


def test_a_signature_holds_for_its_member_round_kind_and_value_only() -> None:
    (alice, alice_key), (bob, bob_key) = keys()[:2]
    signer, checker = RoundSigner(alice_key), RoundSigner(bob_key)
    proof = signer.sign("group-1", "digest", "abcd")
    assert checker.check(alice, "group-1", "digest", "abcd", proof)
    assert not checker.check(alice, "group-2", "digest", "abcd", proof)  # replayed in another round
    assert not checker.check(alice, "group-1", "report", "abcd", proof)
    assert not checker.check(alice, "group-1", "digest", "abce", proof)
    assert not checker.check(bob, "group-1", "digest", "abcd", proof)  # alice's key does not derive to bob's id
    forged = {"sig": RoundSigner(bob_key).sign("group-1", "digest", "abcd")["sig"], "key": proof["key"]}
    assert not checker.check(alice, "group-1", "digest", "abcd", forged)  # bob's signature under alice's key
    for junk in (None, {}, {"sig": "x", "key": proof["key"]}, {"sig": proof["sig"], "key": b"ssh-rsa junk"}):
        assert not checker.check(alice, "group-1", "digest", "abcd", junk)


def signed_group(n: int, signed: bool = True) -> tuple[MemoryNetwork, list[Averager]]:
    net = MemoryNetwork()
    averagers = [
        Averager(
            net.transport(peer), torch.zeros(NUMEL), run_id="test", group_size=16, outer_lr=1.0, outer_momentum=0.0,
            codec_up=get_codec("fp16"), codec_down=get_codec("fp16"), part_numel=1 << 12, min_deadline=1.0,
            deadline_factor=4.0, ban_rounds=3, signer=RoundSigner(key) if signed else None,
        )
        for peer, key in keys()[:n]
    ]  # fmt: skip
    return net, averagers


async def one_round(averagers: list[Averager]) -> list[RoundOutcome]:
    for a in averagers:
        await a.start()
    peers = [a.me for a in averagers]
    deltas = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) for i in range(len(averagers))]
    return await asyncio.gather(
        *(
            a.run_round(d, 1.0, leader_candidates(peers, a.me, 16, "test", 0), set(peers), gather_timeout=2.0)
            for a, d in zip(averagers, deltas, strict=True)
        )
    )


async def test_a_relayer_that_puts_a_value_in_another_members_mouth_is_banned_and_changes_nothing() -> None:
    """Unsigned, a relayer could "show" a second value for every honest member, and the rule that leaves an
    equivocating member out would have left out all of them. Signed, the others ask it to prove the value it
    relayed; it cannot, so they ban it and keep the member's own, signed, report."""
    net, averagers = signed_group(4)
    liar, victim = averagers[3].me, averagers[1].me

    def lie(src: str, dst: str, method: str, header: dict) -> None:
        relay = header.get("relay")
        if src == liar and method == "report" and relay and len(relay["values"]) == 1:
            relay["values"].append(["f" * 16] * len(relay["values"][0]))
            relay["from"][victim] = 1

    net.before_call = lie
    outcomes = await one_round(averagers)
    assert {o.outcome for o in outcomes} == {"applied"} and len({o.digest for o in outcomes}) == 1, outcomes
    for a in (averagers[0], averagers[2]):  # the victim itself never asks for proof of its own report
        assert f"relayed a report of {victim[-8:]} it could not prove" in (a.matchmaker.bans.reason(liar, 1) or "")
    assert all(a.matchmaker.bans.reason(victim, 1) is None for a in averagers)


async def test_signatures_cost_one_per_message_not_one_per_member_per_relay() -> None:
    """An honest round asks for no proofs: each report and digest carries one signature and its key (about 750
    bytes); relays carry none. With 8 members that is about 7 x 2 x 750 bytes more per member and round."""
    sent = {}
    for signed in (False, True):
        net, averagers = signed_group(8, signed)
        before = [a.transport.counter.sent for a in averagers]
        outcomes = await one_round(averagers)
        assert {o.outcome for o in outcomes} == {"applied"}
        sent[signed] = sum(a.transport.counter.sent - b for a, b in zip(averagers, before, strict=True)) / 8
    assert 0 < sent[True] - sent[False] < 7 * 2 * 1000, sent


async def test_a_report_that_reached_a_member_only_through_relays_is_proven_and_counts() -> None:
    """One member's own report never reaches another (its stream breaks every time): the relays bring it, the
    member asks a relayer for its signature, and the round applies with one digest as if nothing had been lost."""
    net, averagers = signed_group(4)
    sender, cut_off = averagers[2].me, averagers[0].me

    asked: list[tuple[str, str]] = []

    def drop(src: str, dst: str, method: str, header: dict) -> None:
        if (src, dst, method) == (sender, cut_off, "report") and "relay" not in header:
            raise PeerUnreachable("report lost")
        if method == "proofs":
            asked.append((src, header["kind"]))

    net.before_call = drop
    outcomes = await one_round(averagers)
    assert {o.outcome for o in outcomes} == {"applied"} and len({o.digest for o in outcomes}) == 1, outcomes
    assert asked and set(asked) == {(cut_off, "report")}, asked  # only the member that missed it asked
    assert all(o.decisions == (True,) * 4 for o in outcomes)
    assert not any(a.matchmaker.bans.active(1) for a in averagers)
