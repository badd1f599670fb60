"""Bans as users see them (in process, memory transport): the banning node shows whom it bans, until which round and
why, in its DHT record (`swarmtrain status`), its /status and its events; the banned node is in state ``banned``
with the leader's words; a record whose ``bans`` field is over its bounds is refused."""

from __future__ import annotations

import asyncio
import io
import time
from typing import Any

import pytest
import torch
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey
from rich.console import Console

from swarmtrain.averaging import PROTOCOL_VERSION, leader_candidates
from swarmtrain.averaging.bans import Bans
from swarmtrain.dht import BanEntry, PeerRecord, ban_table, read_record, record_validators
from swarmtrain.dht.membership import BAN_PEER_CHARS, BAN_REASON_CHARS, MAX_RECORD_BANS
from swarmtrain.node.commands import status_table
from swarmtrain.node.node import _peer_table
from swarmtrain.node.state import Miss, NodeState, NodeStatus, round_state
from tests.test_byzantine import HOSTILE, MEMBERS, NUMEL, make_group
from tests.test_private_swarm import FakeDHT, Identity, member

BAN_ROUNDS = 3


@pytest.fixture(scope="module")
def identities(tmp_path_factory: pytest.TempPathFactory) -> list[Identity]:
    root = tmp_path_factory.mktemp("ids")
    return [Identity(root / f"id{i}.key") for i in range(2)]


async def test_a_ban_shows_in_the_banning_nodes_record_and_status_and_the_banned_node_is_in_state_banned(
    identities: list[Identity],
) -> None:
    """Round 0: the two nan senders are banned by every honest member. Round 1: they are refused with code
    ``banned``. The honest leader's record (read back as `swarmtrain status` reads it) and /status name each
    banned peer, the round its ban ends and the reason; the banned nodes end round 1 in state ``banned``."""
    averagers = make_group("centered-clip", "nan")
    for a in averagers:
        a.matchmaker.bans.rounds = BAN_ROUNDS
        await a.start()
    peers = [a.me for a in averagers]
    honest, hostile = averagers[: MEMBERS - HOSTILE], averagers[MEMBERS - HOSTILE :]
    for _ in range(2):
        runs = [
            a.run_round(torch.randn(NUMEL), 1.0, leader_candidates(peers, a.me, 16, "test", a.round), set(peers), 1.0)
            for a in averagers
        ]
        outcomes = await asyncio.gather(*runs)

    # The banning node: its record and its /status.
    leader = honest[0]
    bans = ban_table(leader.matchmaker.bans.active(leader.round))
    assert set(bans) == {h.me[-BAN_PEER_CHARS:] for h in hostile}, bans
    for ban in bans.values():
        assert ban.until == 0 + 1 + BAN_ROUNDS and "non-finite" in ban.reason, ban
    me, reader = identities
    dht = FakeDHT()
    await member(dht, me, state="averaging", bans=bans).publish()
    view = await member(dht, reader).refresh()
    assert view[me.peer_id].bans == bans
    seen = _peer_table(member(dht, reader))  # what another node's /status says about it
    seen_bans = {p: b.model_dump() for p, b in bans.items()}
    records = [read_record(k, v) for k, v in dht.values.items()]
    table = io.StringIO()
    Console(file=table, width=400).print(status_table("test", [r for r in records if r is not None]))
    for peer, ban in bans.items():
        assert f"{peer} until round {ban.until}: {ban.reason}" in table.getvalue(), table.getvalue()
    status = NodeStatus(me.peer_id)
    status.peers_source = lambda: seen
    status.set_bans(seen_bans)
    snapshot = status.snapshot()
    assert snapshot["bans"] == seen_bans
    ban_events = [e["reason"] for e in snapshot["events"] if e["state"] == "ban"]
    assert sorted(ban_events) == sorted(f"banned {p} until round {b.until}: {b.reason}" for p, b in bans.items())

    # The banned nodes: refused with code ``banned`` by the leader, so the round leaves them banned, with its words.
    for banned, outcome in zip(hostile, outcomes[len(honest) :], strict=True):
        assert outcome.group.size == 1
        state, reason = round_state(
            outcome.outcome, outcome.group.size, False, [Miss(*m) for m in banned.matchmaker.misses]
        )
        assert state is NodeState.BANNED, (state, reason, banned.matchmaker.misses)
        assert f"you are banned until round {1 + BAN_ROUNDS}" in reason and "non-finite" in reason, reason
        status = NodeStatus(banned.me)
        status.set(state, reason)
        assert (status.snapshot()["state"], status.snapshot()["reason"]) == ("banned", reason)


def _valid(identity: Identity, **changes: Any) -> tuple[bytes, dict[str, Any]]:
    subkey = identity.peer_id.encode() + identity.signer.local_public_key
    value = PeerRecord(
        peer_id=identity.peer_id, proto=PROTOCOL_VERSION, run_id="test", round=3, phase="training", tokens_per_s=1.0,
        batch_size=1,
    ).model_dump()  # fmt: skip
    return subkey, {**value, **changes, "mac": ""}


def test_a_record_with_a_bans_field_over_its_bounds_is_refused(identities: list[Identity]) -> None:
    me = identities[0]
    ok = {f"peer{i:07d}": {"until": 9, "reason": "non-finite values"} for i in range(MAX_RECORD_BANS)}
    subkey, value = _valid(me, bans=ok)
    record = read_record(subkey, value)
    assert record is not None and len(record.bans) == MAX_RECORD_BANS
    too_many = {**ok, "peer9999999": {"until": 9, "reason": "x"}}
    long_reason = {"peer0000000": {"until": 9, "reason": "x" * (BAN_REASON_CHARS + 1)}}
    long_peer = {"p" * (BAN_PEER_CHARS + 1): {"until": 9, "reason": "x"}}
    huge = {f"peer{i}": {"until": 9, "reason": "x" * 10_000} for i in range(1_000)}
    for bans in (too_many, long_reason, long_peer, huge, {"peer1": {"until": -1, "reason": "x"}}, {"peer1": 3}):
        assert read_record(*_valid(me, bans=bans)) is None, str(bans)[:200]


def test_the_dht_schema_stores_a_record_with_bans() -> None:
    """Every DHT peer checks a record against the swarm's schema before storing it: bans must pass it."""
    signer, schema = record_validators("test", RSAPrivateKey())
    subkey = b"peer" + signer.local_public_key
    bans = {"peer0000001": BanEntry(until=4, reason="non-finite values").model_dump()}
    record = PeerRecord(
        peer_id="peer", proto=PROTOCOL_VERSION, run_id="test", round=3, phase="training", tokens_per_s=1.0,
        batch_size=1,
    )  # fmt: skip
    value = {**record.model_dump(), "mac": ""}

    def stored(record_value: dict[str, Any]) -> bool:
        record = DHTRecord(
            key=DHTID.generate(source="test_peers").to_bytes(), subkey=DHTProtocol.serializer.dumps(subkey),
            value=DHTProtocol.serializer.dumps(record_value), expiration_time=time.time() + 30,
        )  # fmt: skip
        return schema.validate(record)

    assert stored({**value, "bans": bans})
    assert not stored({**value, "bans": {"peer0000001": {"until": 4.5, "reason": "x"}}})


def test_an_offence_recorded_after_two_phases_of_one_round_is_one_ban_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The averager records a round's offenders after its exchange and again after its digests, so that an
    # offence is banned even when the digests never come; the same offence must not be logged twice.
    bans = Bans("me", BAN_ROUNDS)
    with caplog.at_level("WARNING", logger="swarmtrain.averaging.bans"):
        bans.record({"peer-a": "invalid payload"}, 7)
        bans.record({"peer-a": "invalid payload"}, 7)
        bans.record({"peer-a": "equivocated", "peer-b": "invalid payload"}, 7)
    banned = [r.getMessage() for r in caplog.records]
    assert banned == [
        f"banned peer {'peer-a'[-8:]} until round {7 + 1 + BAN_ROUNDS}: invalid payload",
        f"banned peer {'peer-a'[-8:]} until round {7 + 1 + BAN_ROUNDS}: equivocated",
        f"banned peer {'peer-b'[-8:]} until round {7 + 1 + BAN_ROUNDS}: invalid payload",
    ], banned
    assert bans.reason("peer-a", 8) == f"banned until round {7 + 1 + BAN_ROUNDS}: equivocated"
