"""A distant link on one machine: the transport delays each message a node sends by its up delay and each it
receives by its down delay (node.up_delay_ms, node.down_delay_ms; a scenario's link up_ms and down_ms)."""

from __future__ import annotations

import statistics
import time
from collections.abc import AsyncIterator

from swarmtrain.net import P2PTransport

CALLS = 7


async def echo(sender: str, header: dict, frames: AsyncIterator[bytes]) -> tuple[dict, bytes]:
    count = 0
    async for _ in frames:
        count += 1
    return {"frames": count}, b""


async def frames(count: int) -> AsyncIterator[bytes]:
    for _ in range(count):
        yield bytes(1024)


async def _times(client: P2PTransport, server: P2PTransport, count: int) -> list[float]:
    times = []
    for _ in range(CALLS):
        started = time.perf_counter()
        answer, _ = await client.call_stream(server.peer_id, "echo", {}, frames(count), count=count, timeout=30)
        times.append(time.perf_counter() - started)
        assert answer == {"frames": count}
    return times


async def test_a_call_is_late_by_both_ends_delays_each_way_and_a_streamed_call_only_once(pair) -> None:
    """From A (up 30 ms, down 20 ms) to B (up 10 ms, down 5 ms) a call takes 30 + 5 there and 10 + 20 back: 65 ms
    more than the link itself, 50 ms more than from a client without delays; 20 frames of one call add nothing."""
    a, b = pair
    server = P2PTransport(b, up_delay_s=0.010, down_delay_s=0.005)
    await server.serve_stream("echo", echo, max_body=1 << 20, max_frames=64)
    near, far = P2PTransport(a), P2PTransport(a, up_delay_s=0.030, down_delay_s=0.020)
    await _times(near, server, 1)  # the connection is open and warm before anything is timed
    for count in (1, 20):
        direct, delayed = await _times(near, server, count), await _times(far, server, count)
        assert min(direct) >= 0.015 and min(delayed) >= 0.065, (count, direct, delayed)
        extra = statistics.median(delayed) - statistics.median(direct)
        assert 0.025 <= extra <= 0.150, (count, direct, delayed)  # 50 ms, once per call however many frames


SIZE, FRAMES, MBIT = 100_000, 40, 16.0  # 4 MB at 16 Mbit/s: 2 s a direction


async def sink(sender: str, header: dict, frames: AsyncIterator[bytes]) -> tuple[dict, bytes]:
    received = 0
    async for frame in frames:
        received += len(frame)
    return {"received": received}, bytes(header.get("reply", 0))


async def big_frames() -> AsyncIterator[bytes]:
    for _ in range(FRAMES):
        yield bytes(SIZE)


async def _rate(client: P2PTransport, server: P2PTransport, method: str = "sink", reply: int = 0) -> float:
    """Mbit/s of one call that carries 4 MB one way: its frames up to the server, or its reply back."""
    started = time.perf_counter()
    count = 0 if reply else FRAMES
    answer, body = await client.call_stream(
        server.peer_id, method, {"reply": reply}, big_frames() if count else frames(0), count=count, timeout=60,
        max_reply=reply + 1024,
    )  # fmt: skip
    elapsed = time.perf_counter() - started
    assert answer["received"] == count * SIZE and len(body) == reply
    return (count * SIZE + reply) * 8 / elapsed / 1e6


async def test_a_narrow_link_paces_what_a_node_sends_and_receives_at_its_rate(pair) -> None:
    """Without root a scenario's link rate is the node's own pacing (node.up_mbit, node.down_mbit): 4 MB sent by a
    client paced up, received by a server paced down, and a 4 MB reply to a client paced down each arrive within
    10 % of 16 Mbit/s, where the same bytes unpaced go several times faster."""
    a, b = pair
    server, paced_server = P2PTransport(b), P2PTransport(b, down_mbit=MBIT)
    await server.serve_stream("sink", sink, max_body=1 << 20, max_frames=64)
    await paced_server.serve_stream("paced-sink", sink, max_body=1 << 20, max_frames=64)
    free = await _rate(P2PTransport(a), server)
    assert free > 3 * MBIT, free  # loopback alone is much faster: the rates below are the pacing's
    rates = {
        "client up": await _rate(P2PTransport(a, up_mbit=MBIT), server),
        "server down": await _rate(P2PTransport(a), paced_server, "paced-sink"),
        "client down": await _rate(P2PTransport(a, down_mbit=MBIT), server, reply=FRAMES * SIZE),
    }
    assert all(0.9 * MBIT <= rate <= 1.02 * MBIT for rate in rates.values()), rates
