"""Resource bounds against hostile peers, in process: a reply is refused by its announced length when it is over
what the call can legitimately return, a stranger cannot crowd a real group's early route out of the route table,
and a payload encoded with other codec parameters than the round's is refused before it is decoded."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from swarmtrain.averaging import PROTOCOL_VERSION, Averager
from swarmtrain.compression import CodecError, get_codec
from swarmtrain.net import MemoryNetwork, PeerUnreachable, RemoteError
from swarmtrain.net.rpc import DEFAULT_MAX_REPLY, MAX_CALLS_PER_PEER

NUMEL = 10_000
HEADER = {"run": "test", "v": PROTOCOL_VERSION}


def make_averager(net: MemoryNetwork, name: str) -> Averager:
    return Averager(
        net.transport(name), torch.zeros(NUMEL), run_id="test", group_size=16, outer_lr=0.7, outer_momentum=0.9,
        codec_up=get_codec("fp32"), codec_down=get_codec("fp32"), part_numel=1000, min_deadline=2.0,
        deadline_factor=4.0,
    )  # fmt: skip


async def test_a_reply_over_its_bound_is_refused() -> None:
    net = MemoryNetwork()
    server, client = net.transport("server"), net.transport("client")

    async def big(sender: str, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        return {}, bytes(header["size"])

    await server.serve("big", big, max_body=0)
    assert len((await client.call("server", "big", {"size": 5000}, timeout=2, max_reply=5000))[1]) == 5000
    before = client.counter.received
    with pytest.raises(PeerUnreachable, match="over 4096"):
        await client.call("server", "big", {"size": 5000}, timeout=2, max_reply=4096)
    assert client.counter.received - before < 4096
    # A call that names no bound gets a header's worth of answer, as every protocol answer but state is.
    assert len((await client.call("server", "big", {"size": DEFAULT_MAX_REPLY}, timeout=2))[1]) == DEFAULT_MAX_REPLY
    with pytest.raises(PeerUnreachable, match="over"):
        await client.call("server", "big", {"size": DEFAULT_MAX_REPLY + 1}, timeout=2)


async def test_a_donor_cannot_make_a_joiner_buffer_a_giant_manifest() -> None:
    """Fails on 15d95af: the probe read a donor's whole answer (here 64 MiB) before checking its size."""
    net = MemoryNetwork()
    donor, joiner = make_averager(net, "donor"), make_averager(net, "joiner")
    donor.outer.step(torch.ones(NUMEL))
    donor.round = 2
    await donor.start()
    handler, max_body, max_frames = net.handlers["donor"]["state"]

    async def bloated(sender: str, header: dict[str, Any], frames: Any) -> tuple[dict[str, Any], bytes]:
        answer, body = await handler(sender, header, frames)
        return answer, body + bytes(64 << 20)

    net.handlers["donor"]["state"] = (bloated, max_body, max_frames)
    assert not await joiner.fetch_state(["donor"], None, timeout=5)
    assert joiner.transport.counter.received < 1 << 16, joiner.transport.counter.received
    assert joiner.round == 0


async def test_a_stranger_spraying_group_ids_cannot_evict_a_real_groups_early_route() -> None:
    """Fails on 15d95af: 64 routes, the oldest unclaimed evicted, so a peer sending 100 made-up group ids pushed
    out the route a real member's early report was waiting on, and that report was refused ('no group')."""
    net = MemoryNetwork()
    victim = make_averager(net, "victim")
    await victim.start()
    friend, stranger = net.transport("friend"), net.transport("stranger")
    early = asyncio.create_task(friend.call("victim", "report", {**HEADER, "group": "real"}, timeout=10))
    await asyncio.sleep(0.01)  # the friend's report waits on the route of its group, which we have not claimed yet
    spray = [
        asyncio.create_task(stranger.call("victim", "report", {**HEADER, "group": f"fake{i}"}, timeout=10))
        for i in range(100)
    ]
    await asyncio.sleep(0.05)
    busy = [t for t in spray if t.done() and isinstance(t.exception(), RemoteError)]
    assert len(busy) >= 90, f"only {len(busy)} of 100 made-up groups refused at once"
    reports: list[str] = []
    victim._route("real").set_result(SimpleNamespace(on_report=lambda sender, header: reports.append(sender)))
    try:
        assert await early == ({}, b"")
        assert reports == ["friend"]
    finally:
        for task in spray:
            task.cancel()
        await asyncio.gather(*spray, return_exceptions=True)


def test_a_payload_with_other_codec_parameters_than_the_rounds_is_refused() -> None:
    """Fails on 15d95af: the receiver checked the codec id only, so a 'topk:frac=1.0,value=2bit' payload was
    decoded (allocating for every element) where 'topk:frac=0.01' was agreed."""
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    forged = get_codec("topk:frac=1.0,value=2bit").encode(x)
    with pytest.raises(CodecError, match=r"k=10000, but the round agreed on topk:frac=0.01"):
        get_codec("topk:frac=0.01").decode(forged, NUMEL)
    with pytest.raises(CodecError, match="block=16, but the round agreed"):
        get_codec("int8").decode(get_codec("int8:block=16").encode(x), NUMEL)
    agreed = get_codec("topk:frac=0.01")
    assert torch.count_nonzero(agreed.decode(agreed.encode(x), NUMEL)) == 100
    powersgd = get_codec("powersgd:rank=2")  # its scale depends on the data, not on the agreed options
    assert powersgd.decode(powersgd.encode(x), NUMEL).shape == (NUMEL,)


async def test_one_peer_cannot_hold_more_than_its_share_of_open_calls() -> None:
    """Fails on 15d95af: a peer could keep any number of calls open at a node (each with its stream and buffers)."""
    net = MemoryNetwork()
    server = net.transport("server")
    release = asyncio.Event()

    async def slow(sender: str, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        await release.wait()
        return {}, b""

    await server.serve("slow", slow, max_body=0)
    greedy, other = net.transport("greedy"), net.transport("other")
    calls = [asyncio.create_task(greedy.call("server", "slow", {}, timeout=10)) for _ in range(MAX_CALLS_PER_PEER + 8)]
    await asyncio.sleep(0.05)
    refused = [t for t in calls if t.done() and isinstance(t.exception(), PeerUnreachable)]
    assert len(refused) == 8, f"{len(refused)} of {len(calls)} calls of one peer refused at once"
    served = asyncio.create_task(other.call("server", "slow", {}, timeout=10))
    release.set()
    assert await served == ({}, b"")
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert sum(r == ({}, b"") for r in results) == MAX_CALLS_PER_PEER
