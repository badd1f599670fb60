"""Bad input through the real RPC (two p2pd daemons in one loop): every malformed message is refused with a
reason, the sender is left out of the round, and the node finishes its round with the others."""

from __future__ import annotations

import asyncio
import struct

import msgpack
import pytest
import torch
from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator
from hivemind.p2p import P2P, PeerID
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from swarmtrain.averaging import PROTOCOL_VERSION, Averager, Group
from swarmtrain.compression import get_codec
from swarmtrain.dht import Membership, PeerRecord, record_validators
from swarmtrain.dht.identity import peer_id_of, record_subkey
from swarmtrain.net import P2PTransport, PeerUnreachable, RemoteError

NUMEL = 4096
HEADER = {"run": "test", "v": PROTOCOL_VERSION}


def make_averager(p2p: P2P, codec: str = "fp16") -> Averager:
    return Averager(
        P2PTransport(p2p), torch.zeros(NUMEL), run_id="test", group_size=16, outer_lr=1.0, outer_momentum=0.0,
        codec_up=get_codec(codec), codec_down=get_codec(codec), part_numel=NUMEL, min_deadline=4.0,
        deadline_factor=2.0,
    )  # fmt: skip


async def stream(frames: list[bytes]):
    for frame in frames:
        yield frame


async def pong(sender: str, header: dict, body: bytes) -> tuple[dict, bytes]:
    return {"round": 0}, b""


def _payloads(length: int) -> list[tuple[dict, bytes, str]]:
    """(header changes, body, expected reason) for every kind of bad part."""
    fp16 = get_codec("fp16")
    good = fp16.encode(torch.ones(length))
    unknown_codec = bytearray(good)
    unknown_codec[5] = 99
    nan = bytearray(good)
    nan[-2:] = struct.pack("<e", float("nan"))
    return [
        ({"run": "other"}, good, "run id"),
        ({"v": PROTOCOL_VERSION + 1}, good, "protocol version"),
        ({"codec": "fp32"}, get_codec("fp32").encode(torch.ones(length)), "not this round's"),  # wrong dtype
        ({}, bytes(unknown_codec), "bad part payload"),
        ({}, good[:-3], "bad part payload"),  # truncated
        ({}, fp16.encode(torch.ones(length + 1)), "bad part payload"),  # wrong shape
        ({}, bytes(nan), "bad part payload"),  # non-finite
        ({"extra_frame": True}, good, "bad part index"),  # more frames than the shard has parts
        ({"shard": 9}, good, "sent to the reducer of shard"),
    ]


async def test_malformed_parts_are_refused_and_the_round_finishes_without_the_sender(pair) -> None:
    a, b = pair
    victim = make_averager(a)
    await victim.start()
    attacker = P2PTransport(b)
    for method in ("ping", "parts", "results", "report", "digest"):  # alive and listening, but sends garbage
        await attacker.serve(method, pong, max_body=1 << 20)
    me, evil = victim.me, attacker.peer_id
    loop = asyncio.get_running_loop()
    for round_, (changes, body, reason) in enumerate(_payloads(NUMEL // 2)):
        group = Group(round_, tuple(sorted([me, evil])), (1.0, 1.0))
        allreduce = victim._allreduce(group, torch.ones(NUMEL), loop.time() + 8.0)
        header = {**HEADER, "group": allreduce.route, "shard": group.index(me), "codec": "fp16"}
        run = asyncio.create_task(allreduce.run())
        frames = [body, body] if changes.pop("extra_frame", False) else [body]
        with pytest.raises(RemoteError, match=reason):
            await attacker.call_stream(
                me, "parts", {**header, **changes}, stream(frames), count=len(frames), timeout=10
            )
        if "run id" in reason or "protocol" in reason:
            run.cancel()  # refused before the round saw it: nothing to exclude
            continue
        started = loop.time()
        result = await asyncio.wait_for(run, 10)
        assert evil in result.excluded, reason
        assert loop.time() - started < 4.0, "the round waited on an excluded peer"
        # Nothing of the garbage is applied: with no second report to agree with, my shard falls back (no update).
        assert result.applied == [False, False], reason
        assert torch.equal(result.average, torch.zeros(NUMEL)), reason

    group = Group(99, tuple(sorted([me, evil])), (1.0, 1.0))
    allreduce = victim._allreduce(group, torch.ones(NUMEL), loop.time() + 8.0)
    header = {**HEADER, "group": allreduce.route, "shard": group.index(me), "codec": "fp16"}
    with pytest.raises(PeerUnreachable):  # over the size limit: the stream is reset after 8 bytes
        await attacker.call_stream(me, "parts", header, stream([b"\0" * (victim.max_body + 1)]), count=1, timeout=10)
    with pytest.raises(PeerUnreachable):  # announces 10^9 frames: refused at the header
        await attacker.call_stream(me, "parts", header, stream([]), count=10**9, timeout=10)
    with pytest.raises(RemoteError, match="no group"):
        await attacker.call(me, "report", {**header, "group": "feedfacefeedface"}, b"", timeout=10)
    answer, _ = await attacker.call(me, "ping", HEADER, timeout=5)  # the victim still serves
    assert answer["round"] == 0


async def test_a_garbled_frame_never_crashes_the_handler(pair) -> None:
    a, b = pair
    victim = make_averager(a)
    await victim.start()
    _, reader, writer = await b.call_binary_stream_handler(PeerID.from_base58(victim.me), "swarmtrain/ping")
    garbage = msgpack.packb([1, 2, 3])  # a list, not a map
    writer.write(len(garbage).to_bytes(8, "big") + garbage + (0).to_bytes(8, "big"))
    await writer.drain()
    with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
        await asyncio.wait_for(reader.readexactly(8), 5)
    writer.close()
    answer, _ = await P2PTransport(b).call(victim.me, "ping", HEADER, timeout=5)
    assert answer["round"] == 0


async def test_join_refuses_bad_weights_and_models_of_another_size(pair) -> None:
    a, b = pair
    victim = make_averager(a)
    await victim.start()
    attacker = P2PTransport(b)
    join = {**HEADER, "round": 0, "digest": "x", "numel": NUMEL}
    for weight, needle in [(float("inf"), "finite"), (-1.0, "out of bounds"), ("many", "finite")]:
        with pytest.raises(RemoteError, match=needle):
            await attacker.call(victim.me, "join", {**join, "weight": weight}, timeout=5)
    with pytest.raises(RemoteError, match="parameters"):
        await attacker.call(victim.me, "join", {**join, "weight": 1.0, "numel": NUMEL + 1}, timeout=5)
    with pytest.raises(RemoteError, match="round 7 is too far ahead"):
        await attacker.call(victim.me, "join", {**join, "weight": 1.0, "round": 7}, timeout=5)


async def test_malformed_dht_records_are_ignored(pair) -> None:
    """Records that every swarm DHT node stores (schema-valid, signed by the key their subkey names) but that no
    view may take: one of another run, one claiming a peer id its signing key does not derive, one out of bounds.
    They reach the honest node's own lookup; ``Membership.refresh`` drops them all."""
    a, b = pair
    c = await P2P.create(initial_peers=await a.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    key, keys = RSAPrivateKey(), [RSAPrivateKey(), RSAPrivateKey()]
    honest = await DHTNode.create(p2p=a, record_validator=CompositeValidator(record_validators("test", key)))
    # Two rogues that sign what they store like any swarm node (a DHT node holds one identity, so two of them).
    rogues = [
        await DHTNode.create(
            p2p=p2p, initial_peers=await a.get_visible_maddrs(),
            record_validator=CompositeValidator(record_validators("test", k)),
        )
        for p2p, k in zip((b, c), keys, strict=True)
    ]  # fmt: skip
    try:
        me = peer_id_of(key.get_public_key().to_bytes())
        record = PeerRecord(peer_id=me, proto=PROTOCOL_VERSION, run_id="test", round=0, phase="training",
                            tokens_per_s=0.0, batch_size=1)  # fmt: skip
        signer, _ = record_validators("test", key)
        membership = Membership(honest, signer, record, ttl=30)
        assert await membership.publish()
        expiration = get_dht_time() + 30
        base = {**record.model_dump(), "mac": ""}
        (signer0, _), (signer1, _) = (record_validators("test", k) for k in keys)
        ids = [peer_id_of(k.get_public_key().to_bytes()) for k in keys]
        rogue_records = [  # (rogue, subkey, value): each breaks one rule Membership checks
            (0, record_subkey(ids[0], signer0), {**base, "peer_id": ids[0], "run_id": "other"}),
            (0, record_subkey("QmImpostor", signer0), {**base, "peer_id": "QmImpostor"}),
            (1, record_subkey(ids[1], signer1), {**base, "peer_id": ids[1], "tokens_per_s": -1.0}),
        ]
        for rogue, subkey, value in rogue_records:
            assert await rogues[rogue].store("test_peers", value, expiration, subkey=subkey), subkey[:16]
        # They landed: the honest node's own lookup (what refresh reads) returns them next to its record.
        found = await honest.get("test_peers", latest=True)
        assert found is not None
        stored = {subkey: item.value for subkey, item in found.value.items()}
        assert set(stored) == {membership.subkey, *(subkey for _, subkey, _ in rogue_records)}
        assert all(stored[subkey] == value for _, subkey, value in rogue_records)
        view = await membership.refresh()
        assert list(view) == [me]
    finally:
        for rogue in rogues:
            await rogue.shutdown()
        await honest.shutdown()
        await c.shutdown()


async def test_over_p2p_a_reply_over_its_bound_and_calls_over_a_peers_share_are_refused(pair) -> None:
    """The reply bound is checked on the 8-byte length (the body is never read), and a peer's calls beyond its
    share are dropped at once while another peer's are served."""
    a, b = pair
    client, server = P2PTransport(a), P2PTransport(b)
    release = asyncio.Event()

    async def big(sender: str, header: dict, body: bytes) -> tuple[dict, bytes]:
        if header.get("wait"):
            await release.wait()
        return {}, bytes(8 << 20)

    await server.serve("big", big, max_body=0)
    with pytest.raises(PeerUnreachable, match="exceeds the limit of 4096"):
        await client.call(server.peer_id, "big", {}, timeout=30, max_reply=4096)
    assert client.counter.received < 4096
    # The server holds that call open until its write of the refused reply fails (under load, after the calls
    # below arrived: one more of them was dropped, found in a fresh clone's run with a core busy).
    for _ in range(200):  # bounded
        if not server.limit.open.get(client.peer_id):
            break
        await asyncio.sleep(0.05)
    assert not server.limit.open.get(client.peer_id), "the refused reply's call is still open at the server"
    share = server.limit.limit
    calls = [
        asyncio.create_task(client.call(server.peer_id, "big", {"wait": True}, timeout=60, max_reply=0))
        for _ in range(share + 4)
    ]
    for _ in range(300):  # bounded: the dropped streams fail within a few seconds
        if sum(t.done() for t in calls) >= 4:
            break
        await asyncio.sleep(0.05)
    assert sum(t.done() and isinstance(t.exception(), PeerUnreachable) for t in calls) == 4
    release.set()
    await asyncio.gather(*calls, return_exceptions=True)
