"""Private swarms and identity-bound records, in process: the swarm key and the allowlist on every RPC (memory
transport), the hello check that turns a key mismatch into an error, and the peer records a reader accepts."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, PeerID

from swarmtrain.averaging import PROTOCOL_VERSION, Averager
from swarmtrain.compression import get_codec
from swarmtrain.dht import Membership, PeerRecord, load_identity_key
from swarmtrain.net import (
    PUBLIC,
    MemoryNetwork,
    PeerUnreachable,
    RemoteError,
    SwarmAuth,
    SwarmKeyError,
    serve_hello,
    verify_swarm,
)
from swarmtrain.net.auth import read_swarm_key, write_swarm_key

NUMEL = 4096
HEADER = {"run": "test", "v": PROTOCOL_VERSION}
KEY, OTHER_KEY = b"k" * 32, b"o" * 32


def make_averager(net: MemoryNetwork, name: str, auth: SwarmAuth) -> Averager:
    return Averager(
        net.transport(name, auth), torch.zeros(NUMEL), run_id="test", group_size=16, outer_lr=0.7,
        outer_momentum=0.9, codec_up=get_codec("fp32"), codec_down=get_codec("fp32"), part_numel=1024,
        min_deadline=2.0, deadline_factor=4.0,
    )  # fmt: skip


async def parts(n: int, size: int):
    for _ in range(n):
        yield bytes(size)


async def test_an_outsider_gets_no_join_no_state_and_no_route() -> None:
    """A process without the key, or with another one, is refused on every RPC before any handler runs: no join,
    no state bytes, no route in the member's table; a key holder is served."""
    net = MemoryNetwork()
    member = make_averager(net, "member", SwarmAuth(KEY))
    member.outer.step(torch.ones(NUMEL))
    member.round = 3
    await member.start()
    friend = make_averager(net, "friend", SwarmAuth(KEY))
    for name, auth in [("outsider", SwarmAuth()), ("wrong", SwarmAuth(OTHER_KEY))]:
        stranger = make_averager(net, name, auth)
        await stranger.start()
        join = {**HEADER, "round": 3, "weight": 1.0, "numel": NUMEL, "codec": "fp32", "group": "g" * 8}
        group = {**HEADER, "group": "g" * 8}
        calls = [("join", join), ("ping", HEADER), ("state", {**HEADER, "chunk": 8192}), ("report", group)]
        for method, header in [*calls, ("digest", group)]:
            with pytest.raises(RemoteError) as refused:
                await stranger.transport.call("member", method, header, timeout=2)
            assert refused.value.code == "swarm-key", (name, method, refused.value)
        with pytest.raises(PeerUnreachable):  # a streamed call from outside is cut without an answer
            await stranger.transport.call_stream(
                "member", "parts", {**HEADER, "group": "g" * 8}, parts(3, 64), count=3, timeout=2
            )
        assert not await stranger.fetch_state(["member"], None, timeout=2)
        assert stranger.round == 0 and torch.count_nonzero(stranger.outer.theta) == 0
        assert stranger.transport.counter.received == 0, f"{name} received {stranger.transport.counter.received} B"
    assert member._routes == {}, "a refused caller made a route in the member's table"
    assert await friend.fetch_state(["member"], None, timeout=5)
    assert friend.round == 3 and torch.equal(friend.outer.theta, member.outer.theta)


async def test_the_allowlist_admits_only_its_peers() -> None:
    net = MemoryNetwork()
    allow = frozenset({"member", "friend"})
    member = make_averager(net, "member", SwarmAuth(None, allow))
    await member.start()
    friend = make_averager(net, "friend", SwarmAuth(None, allow))
    stranger = make_averager(net, "stranger", SwarmAuth(None, allow))
    assert (await friend.transport.call("member", "ping", HEADER, timeout=2))[0]["round"] == 0
    with pytest.raises(RemoteError) as refused:
        await stranger.transport.call("member", "ping", HEADER, timeout=2)
    assert refused.value.code == "not-allowed"


async def test_a_key_mismatch_with_the_join_peer_is_an_error_that_names_the_fix() -> None:
    net = MemoryNetwork()
    for name, auth in [("private", SwarmAuth(KEY)), ("public", SwarmAuth())]:
        await serve_hello(net.transport(name, auth))
    assert await verify_swarm(net.transport("friend", SwarmAuth(KEY)), ["private"]) == 1
    assert await verify_swarm(net.transport("anyone", SwarmAuth()), ["public"]) == 1
    cases = [
        (SwarmAuth(OTHER_KEY), "private", "refused this node's swarm key.*copy of the swarm's key file"),
        (SwarmAuth(), "private", "refused this node's swarm key.*set node.swarm_key"),
        (SwarmAuth(KEY), "public", "does not hold this node's swarm key.*public swarm"),
        (SwarmAuth(KEY, frozenset({"me"})), "private", "not on node.allow_peers"),
    ]
    for auth, peer, message in cases:
        with pytest.raises(SwarmKeyError, match=message):
            await verify_swarm(net.transport("me", auth), [peer])


def test_swarm_key_files(tmp_path: Path) -> None:
    path = tmp_path / "swarm.key"
    write_swarm_key(path)
    assert len(read_swarm_key(path)) == 32
    with pytest.raises(FileExistsError):
        write_swarm_key(path)
    (tmp_path / "bad.key").write_text("not a key\n")
    with pytest.raises(SwarmKeyError, match="is not a swarm key file.*keygen --swarm"):
        read_swarm_key(tmp_path / "bad.key")
    with pytest.raises(SwarmKeyError, match="cannot read node.swarm_key"):
        read_swarm_key(tmp_path / "missing.key")


# ---- records ------------------------------------------------------------------------------------------------


class Identity:
    """A libp2p identity file, its peer id and the DHT signer built from it, as a node has them."""

    def __init__(self, path: Path) -> None:
        P2P.generate_identity(str(path))
        self.peer_id = PeerID.from_identity(path.read_bytes()).to_base58()
        self.signer = RSASignatureValidator(load_identity_key(path))


class FakeDHT:
    """What ``Membership`` reads: the records of ``<run>_peers`` as hivemind returns them (signatures checked)."""

    def __init__(self) -> None:
        self.values: dict[bytes, Any] = {}

    async def get(self, key: str, latest: bool = False) -> Any:
        return SimpleNamespace(value={k: SimpleNamespace(value=v) for k, v in self.values.items()})

    async def store(self, key: str, value: Any, expiration: float, subkey: bytes) -> bool:
        self.values[subkey] = value
        return True


def record(peer_id: str, **changes: Any) -> PeerRecord:
    return PeerRecord(
        peer_id=peer_id, proto=PROTOCOL_VERSION, run_id="test", round=5, phase="training", tokens_per_s=1.0,
        batch_size=1, digest="d" * 8,
    ).model_copy(update=changes)  # fmt: skip


@pytest.fixture(scope="module")
def identities(tmp_path_factory: pytest.TempPathFactory) -> list[Identity]:
    root = tmp_path_factory.mktemp("ids")
    return [Identity(root / f"id{i}.key") for i in range(4)]


def member(dht: FakeDHT, who: Identity, auth: SwarmAuth = PUBLIC, **changes: Any) -> Membership:
    return Membership(dht, who.signer, record(who.peer_id, **changes), ttl=30, auth=auth)  # type: ignore[arg-type]


async def test_a_record_for_another_peer_id_is_ignored(identities: list[Identity]) -> None:
    """Fails on 15d95af: a process could publish a record for any peer id under a subkey that starts with it."""
    me, honest, attacker = identities[:3]
    dht = FakeDHT()
    await member(dht, honest).publish()
    forged = record(honest.peer_id, round=6, digest="f" * 8).model_dump()
    dht.values[honest.peer_id.encode() + b"-forged" + attacker.signer.local_public_key] = forged
    dht.values[honest.peer_id.encode() + attacker.signer.local_public_key] = forged
    dht.values[attacker.peer_id.encode() + attacker.signer.local_public_key] = record(honest.peer_id).model_dump()
    view = await member(dht, me).refresh()
    assert set(view) == {me.peer_id, honest.peer_id}
    assert view[honest.peer_id].digest == "d" * 8


async def test_private_records_need_the_swarm_key(identities: list[Identity]) -> None:
    me, friend, outsider, wrong = identities
    dht = FakeDHT()
    await member(dht, friend, SwarmAuth(KEY)).publish()
    await member(dht, outsider).publish()
    await member(dht, wrong, SwarmAuth(OTHER_KEY)).publish()
    assert set(await member(dht, me, SwarmAuth(KEY)).refresh()) == {me.peer_id, friend.peer_id}
    allow = frozenset({me.peer_id, outsider.peer_id})
    assert set(await member(dht, me, SwarmAuth(None, allow)).refresh()) == {me.peer_id, outsider.peer_id}


async def test_forged_round_and_inner_phase_claims_are_ignored(identities: list[Identity]) -> None:
    """Fails on 15d95af: one record claiming round 10**15 (or an inner phase of inf seconds, which stretched the
    leader's gather without end) was taken at its word."""
    me, a, b, liar = identities
    dht = FakeDHT()
    for honest in (a, b):
        await member(dht, honest).publish()
    await member(dht, liar, round=10**15).publish()
    view = await member(dht, me, round=5).refresh()
    assert set(view) == {me.peer_id, a.peer_id, b.peer_id}
    await member(dht, liar, inner_s=float("inf")).publish()
    assert liar.peer_id not in await member(dht, me, round=5).refresh()
    # One round ahead is a peer that finished its round first, not a liar.
    await member(dht, liar, round=6).publish()
    assert liar.peer_id in await member(dht, me, round=5).refresh()
    # A peer lagging behind does not make an honest one in step with me look like a liar (3 nodes: it used to).
    lagging = FakeDHT()
    await member(lagging, a, round=11).publish()
    await member(lagging, b, round=9).publish()
    assert set(await member(lagging, me, round=11).refresh()) == {me.peer_id, a.peer_id, b.peer_id}
    # A node far behind (a joiner, a resumed node) follows the swarm however far ahead it is, a swarm of one too;
    # a liar next to it is still outvoted.
    behind = FakeDHT()
    await member(behind, a, round=900).publish()
    assert set(await member(behind, me, round=3).refresh()) == {me.peer_id, a.peer_id}
    await member(behind, b, round=900).publish()
    await member(behind, liar, round=10**15).publish()
    assert set(await member(behind, me, round=0, digest="").refresh()) == {me.peer_id, a.peer_id, b.peer_id}


async def test_the_tokens_a_record_accounts_for_are_the_whole_tokens_its_node_counted(
    identities: list[Identity],
) -> None:
    """Failed in CI at be74b02: a node publishes ``tokens / inner_s`` and a leader multiplies back by ``inner_s``;
    that came to 384.00000000000006 for 384 tokens, so the cap on a member claiming more was a hair above twice its
    record."""
    me, a, silent = identities[:3]
    dht = FakeDHT()
    inner_s = 17.674177716896725
    await member(dht, a, phase="averaging", tokens_per_s=384 / inner_s, inner_s=inner_s).publish()
    leader = member(dht, me)
    await leader.refresh()
    assert await leader.published_tokens([a.peer_id, silent.peer_id], 5) == {a.peer_id: 384.0}


async def test_half_a_swarm_still_waiting_to_start_does_not_hide_the_half_that_started(
    identities: list[Identity],
) -> None:
    """Found by tests/test_swarm.py under load: with node.min_peers = 6, three nodes saw six peers and started,
    three did not yet and waited at round 0. The waiting ones then dropped the started ones' records as "too far
    ahead" (the lower median of the others' rounds was 0), so they never saw six peers: they waited for ever.
    Fails on 680b362 for the survivor of the churn lab."""
    me, waiting, started, other = identities
    dht = FakeDHT()
    await member(dht, waiting, round=0, state="starting").publish()
    await member(dht, started, round=2).publish()
    await member(dht, other, round=2).publish()
    view = await member(dht, me, round=0, state="starting").refresh()
    assert set(view) == {me.peer_id, waiting.peer_id, started.peer_id, other.peer_id}
    # Nor does it hide the one node that survived when the others are fresh processes that joined together (the
    # churn lab: they dropped it at round 4, "the swarm holds 0", and started the swarm again from round 0).
    survivor = FakeDHT()
    await member(survivor, waiting, round=0, state="starting").publish()
    await member(survivor, started, round=0, state="catching_up").publish()
    await member(survivor, other, round=4).publish()
    assert set(await member(survivor, me, round=0, state="starting").refresh()) == {
        me.peer_id, waiting.peer_id, started.peer_id, other.peer_id,
    }  # fmt: skip
    # A peer in step still vouches against a liar: it is dropped as soon as one peer in step holds another round.
    await member(survivor, started, round=0).publish()
    assert other.peer_id not in await member(survivor, me, round=0, state="starting").refresh()


async def test_a_node_catching_up_sees_the_peers_ahead_of_one_that_lags(identities: list[Identity]) -> None:
    """Found by tests/test_swarm.py under load (gossip groups of 3): a node at round 1 catching up, one peer in step
    at round 1 (alone, waiting for a group) and two at round 3. With the lower median of the others' rounds (1 and
    3 for each of the two), the node dropped both peers at round 3, the only ones it could catch up from, and
    stayed behind for four rounds."""
    me, lagging, ahead, other = identities
    dht = FakeDHT()
    await member(dht, lagging, round=1).publish()
    await member(dht, ahead, round=3).publish()
    await member(dht, other, round=3).publish()
    view = await member(dht, me, round=1, state="catching_up").refresh()
    assert set(view) == {me.peer_id, lagging.peer_id, ahead.peer_id, other.peer_id}


async def test_a_forger_saying_every_peer_left_far_ahead_changes_no_honest_view(
    identities: list[Identity], caplog: pytest.LogCaptureFixture
) -> None:
    """attack.kind = forge-records, in process: the forger stores a record for each peer it sees, under its own
    key, saying that peer left FORGED_AHEAD rounds ahead. An honest reader keeps every peer, at its own round, and
    logs each forgery once, not once per heartbeat."""
    import asyncio

    from swarmtrain.averaging.attack import FORGED_AHEAD
    from swarmtrain.node.node import _forge_records

    me, honest, forger = identities[:3]
    dht = FakeDHT()
    members = [member(dht, who) for who in (me, honest, forger)]
    for m in members:
        await m.publish()
    await members[2].refresh()
    forging = asyncio.create_task(_forge_records(members[2], 0.01))
    await asyncio.sleep(0.1)  # several rounds of forgeries
    forging.cancel()
    await asyncio.gather(forging, return_exceptions=True)
    lies = [v for k, v in dht.values.items() if v["phase"] == "leaving" and v["round"] == 5 + FORGED_AHEAD]
    assert {v["peer_id"] for v in lies} == {me.peer_id, honest.peer_id}, dht.values  # the attack did run
    with caplog.at_level("WARNING", logger="swarmtrain.dht.membership"):
        for _ in range(3):  # three heartbeats
            view = await members[0].refresh()
    assert {p: (r.round, r.phase) for p, r in view.items()} == {
        who.peer_id: (5, "training") for who in (me, honest, forger)
    }
    assert not members[0].left
    forged = [r.getMessage() for r in caplog.records if "signed with another identity's key" in r.getMessage()]
    assert sorted(forged) == sorted(
        f"ignoring a peer record for {who.peer_id[-8:]} signed with another identity's key" for who in (me, honest)
    )
