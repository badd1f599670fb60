"""Signed reports and digests (``averaging.signing``): a signature binds a member, a round and a value, and a relay
cannot carry a value its member did not sign."""

from __future__ import annotations

import asyncio
import functools

import msgpack
import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from swarmtrain.averaging import AllReduce, Group, RoundSigner
from swarmtrain.compression import get_codec
from swarmtrain.dht.identity import peer_id_of
from swarmtrain.net import MemoryNetwork, Rejected


@functools.cache
def keys() -> list[tuple[str, RSAPrivateKey]]:
    made = [RSAPrivateKey() for _ in range(3)]
    return sorted((peer_id_of(k.get_public_key().to_bytes()), k) for k in made)


def test_a_signature_holds_for_its_member_round_kind_and_value_only() -> None:
    (alice, alice_key), (bob, bob_key), _ = keys()
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


async def test_a_relay_that_puts_a_value_in_another_members_mouth_is_refused_and_its_sender_banned() -> None:
    """Unsigned, a relayer could "show" a second value for every honest member, and the rule that leaves an
    equivocating member out would have left out all of them."""
    (alice, alice_key), (bob, bob_key), (carol, carol_key) = keys()
    group = Group(0, (alice, bob, carol), (1.0, 1.0, 1.0))
    net = MemoryNetwork()
    loop_deadline = asyncio.get_running_loop().time() + 5.0
    exchange = AllReduce(
        group, alice, torch.zeros(12), net.transport(alice), header={"run": "test"}, codec_up=get_codec("fp32"),
        codec_down=get_codec("fp32"), part_numel=4, deadline=loop_deadline, signer=RoundSigner(alice_key),
    )  # fmt: skip
    honest = ["h0", "h1", "h2"]
    carol_proof = RoundSigner(carol_key).sign(exchange.route, "report", honest)
    exchange.on_report(carol, {"hashes": honest, "proof": carol_proof})  # carol's own, signed: taken
    bob_proof = RoundSigner(bob_key).sign(exchange.route, "report", honest)
    relay = {"values": [honest, ["x", "x", "x"]], "from": {bob: 0, carol: 1}}
    proofs = msgpack.packb({bob: bob_proof, carol: bob_proof}, use_bin_type=True)  # bob's signature as carol's
    with pytest.raises(Rejected, match="without its member's signature"):
        exchange.on_report(bob, {"relay": relay}, proofs)
    assert bob in exchange.invalid and bob not in exchange.values["report"].relays
    with pytest.raises(Rejected, match="without a valid signature"):
        exchange.on_report(bob, {"hashes": honest})  # unsigned, in a signed group
    assert carol not in exchange.equivocators


async def test_a_relay_of_the_largest_group_fits_the_limits() -> None:
    """averaging.group_size goes up to 256: the relay's header (values and who holds which) and its body (the
    signatures, about 750 bytes each) stay under what the report and digest calls accept."""
    from swarmtrain.averaging.averager import _RELAY
    from swarmtrain.net.rpc import MAX_HEADER, pack_header

    (alice, alice_key), *_ = keys()
    members = tuple(sorted([alice, *(f"Qm{i:044d}" for i in range(255))]))
    group = Group(0, members, (1.0,) * len(members))
    exchange = AllReduce(
        group, alice, torch.zeros(len(members)), MemoryNetwork().transport(alice), header={"run": "test"},
        codec_up=get_codec("fp32"), codec_down=get_codec("fp32"), part_numel=4,
        deadline=asyncio.get_running_loop().time() + 5.0, signer=RoundSigner(alice_key),
    )  # fmt: skip
    report = [f"{i:016x}" for i in range(len(members))]
    proof = RoundSigner(alice_key).sign(exchange.route, "report", report)
    values = exchange.values["report"]
    for peer in members:
        values.held[peer], values.proofs[peer] = report, proof
    relay, body = exchange._pack_relay("report", dict(values.held))
    assert len(pack_header({**exchange.header, "relay": relay})) < MAX_HEADER and len(body) < _RELAY, len(body)
