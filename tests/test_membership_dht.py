"""Membership over real hivemind DHT nodes in process: peers the DHT dropped are asked back (seconds)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator
from hivemind.p2p import P2P, PeerID
from hivemind.utils.crypto import RSAPrivateKey

from swarmtrain.averaging import PROTOCOL_VERSION
from swarmtrain.dht import Membership, PeerRecord, load_identity_key, record_validators
from swarmtrain.dht.membership import REINTRODUCE_S


async def test_peers_the_dht_dropped_from_its_routing_table_see_each_other_again(tmp_path: Path) -> None:
    """What a node frozen by SIGSTOP found on waking (tests/test_churn.py under load): hivemind's DHT drops a peer
    from its routing table after one request it did not answer in time, and takes it back only when a request from
    it comes in. The node's requests timed out as it woke, and its peers had timed out on it while it slept: each
    side had dropped the other, no lookup found anyone again, and the node trained alone for good."""
    p2ps, dhts, members = [], [], []
    try:
        for name in ("a", "b"):
            identity = tmp_path / f"{name}.key"
            P2P.generate_identity(str(identity))
            join = await p2ps[0].get_visible_maddrs() if p2ps else None
            p2p = await P2P.create(
                identity_path=str(identity), initial_peers=join, host_maddrs=["/ip4/127.0.0.1/tcp/0"]
            )
            p2ps.append(p2p)
            signers = record_validators("test", load_identity_key(identity))
            dht = await DHTNode.create(p2p=p2p, initial_peers=join, record_validator=CompositeValidator(signers))
            dhts.append(dht)
            record = PeerRecord(peer_id=p2p.peer_id.to_base58(), proto=PROTOCOL_VERSION, run_id="test", round=0,
                                phase="training", tokens_per_s=1.0, batch_size=1)  # fmt: skip
            members.append(Membership(dht, signers[0], record, ttl=2.0))
        a, b = members

        async def both_see(round_: int, within: float) -> bool:
            """Whether, within ``within`` s of heartbeats, each member sees the other's record of ``round_``."""
            deadline = time.monotonic() + within
            while time.monotonic() < deadline:
                for m in members:
                    assert await m.publish() or round_ > 0  # a store may find no other node to take it
                views = [await m.refresh() for m in members]
                if all(
                    (r := view.get(other.record.peer_id)) is not None and r.round == round_
                    for view, other in zip(views, (b, a), strict=True)
                ):
                    return True
                await asyncio.sleep(0.3)
            return False

        assert await both_see(0, 30.0)
        # What hivemind does to a peer that left a request unanswered, on both sides at once.
        del dhts[0].protocol.routing_table[dhts[1].node_id]
        del dhts[1].protocol.routing_table[dhts[0].node_id]
        for m in members:
            m.update(round=1)
        # Their round-0 records expire within the ttl; then each lookup misses the other and asks it back.
        assert await both_see(1, 15.0), [list(m.view.values()) for m in members]
    finally:
        for dht in dhts:
            await dht.shutdown()
        for p2p in p2ps:
            await p2p.shutdown()


async def test_a_lookup_that_finds_no_one_asks_the_join_peers_back(tmp_path: Path) -> None:
    """A node whose lookups find no record, and that met no peer lately (or only long ago), asks node.join's peers
    into the DHT's routing table again: once every REINTRODUCE_S while that lasts, and not once a peer is found."""
    ids = []
    for name in ("me", "join"):
        P2P.generate_identity(str(tmp_path / f"{name}.key"))
        ids.append(PeerID.from_identity((tmp_path / f"{name}.key").read_bytes()).to_base58())
    me, join = ids
    pinged: list[str] = []

    async def call_ping(peer: PeerID) -> None:
        pinged.append(peer.to_base58())

    async def get(key: str, latest: bool = False) -> Any:
        return None  # the lookup reached no one

    dht = SimpleNamespace(get=get, protocol=SimpleNamespace(call_ping=call_ping))
    record = PeerRecord(peer_id=me, proto=PROTOCOL_VERSION, run_id="test", round=0, phase="training",
                        tokens_per_s=1.0, batch_size=1)  # fmt: skip
    signer = RSASignatureValidator(RSAPrivateKey())
    membership = Membership(dht, signer, record, ttl=2.0, bootstrap=[me, join])  # type: ignore[arg-type]
    await membership.refresh()
    await membership.refresh()  # at once: not asked again yet
    await asyncio.sleep(0.1)
    assert pinged == [join]
    membership.reintroduce({me, join}, time.monotonic() + REINTRODUCE_S)  # found: nothing to ask
    membership.reintroduce(set(), time.monotonic() + REINTRODUCE_S)  # no one found again: asked again
    await asyncio.sleep(0.1)
    assert pinged == [join, join]
