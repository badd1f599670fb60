"""Dial-back: a node asks peers whether other machines can open a connection to it on its addresses."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from hivemind.p2p import P2P

from swarmtrain.net import MemoryNetwork, P2PTransport, PeerUnreachable, Rejected, RemoteError
from swarmtrain.net.reachability import REACH_PAUSE_S, ask_dialback, dialable, is_loopback, reach, serve_dialback
from swarmtrain.node.doctor import check_reachable

HOME = "/ip4/203.0.113.5/tcp/31337"


def test_only_direct_addresses_are_dialled_back() -> None:
    found = dialable([
        f"{HOME}/p2p/QmSelf", "/ip4/198.51.100.7/tcp/4001/p2p/QmRelay/p2p-circuit/p2p/QmSelf",
        "/ip6/::1/udp/4001/quic", f"{HOME}/p2p/QmSelf", "/dns4/node.example.org/tcp/31337", "/unix/tmp/sock",
    ])  # fmt: skip
    assert found == [HOME, "/ip6/::1/udp/4001/quic", "/dns4/node.example.org/tcp/31337"]
    assert is_loopback("/ip4/127.0.0.1/tcp/1") and is_loopback("/ip6/::1/udp/4001/quic")
    assert not is_loopback(HOME) and not is_loopback("/dns4/localhost/tcp/1")


async def test_a_peer_dials_back_once_a_minute_per_caller_one_at_a_time_and_only_direct_addresses() -> None:
    net = MemoryNetwork()
    dialled: list[tuple[str, list[str]]] = []
    release = asyncio.Event()

    async def dial(peer: str, addrs: list[str]) -> bool:
        dialled.append((peer, addrs))
        await release.wait()
        return peer == "reachable"

    await serve_dialback(net.transport("helper"), dial)
    reachable, hidden = net.transport("reachable"), net.transport("hidden")
    first = asyncio.create_task(reachable.call("helper", "dialback", {"addrs": [HOME]}, timeout=5))
    await asyncio.sleep(0.05)
    with pytest.raises(RemoteError, match="dialling another peer back"):  # one at a time
        await hidden.call("helper", "dialback", {"addrs": [HOME]}, timeout=5)
    release.set()
    assert (await first)[0] == {"reached": True}
    with pytest.raises(RemoteError, match="less than 60 s ago"):  # each caller once a minute
        await reachable.call("helper", "dialback", {"addrs": [HOME]}, timeout=5)
    for bad in [[], [HOME] * 5, "x", [f"{HOME}/p2p/QmOther"], ["/ip4/1.2.3.4/tcp/1/p2p/QmR/p2p-circuit"]]:
        with pytest.raises(RemoteError, match="addrs must be"):
            await hidden.call("helper", "dialback", {"addrs": bad}, timeout=5)
    assert dialled == [("reachable", [HOME])]  # nothing refused was dialled
    answer = await hidden.call("helper", "dialback", {"addrs": [HOME]}, timeout=5)
    assert answer[0] == {"reached": False}


async def test_the_answers_of_several_peers_make_one_verdict_with_the_fix() -> None:
    net = MemoryNetwork()

    async def reaches(peer: str, addrs: list[str]) -> bool:
        return True

    async def misses(peer: str, addrs: list[str]) -> bool:
        return False

    await serve_dialback(net.transport("reaches1"), reaches)
    await serve_dialback(net.transport("misses01"), misses)
    await serve_dialback(net.transport("misses02"), misses)
    net.transport("oldnode1")  # serves no dialback: cannot be asked
    me = net.transport("me")
    both = await ask_dialback(me, ["me", "misses01", "reaches1"], [HOME])
    assert both.ok and both.summary() == f"reachable at {HOME}: dialled back by reaches1"
    assert check_reachable(both).ok
    me2 = net.transport("me2")
    none = await ask_dialback(me2, ["misses01", "misses02", "oldnode1", "reaches1"], [HOME])  # 3 asked
    assert none.known and not none.ok and list(none.unasked) == ["oldnode1"]
    check = check_reachable(none)
    assert not check.ok
    assert check.detail == f"not reachable at {HOME}: misses01, misses02 could not dial this node back"
    assert "--announce" in check.fix and "node.use_auto_relay=true" in check.fix


async def test_over_p2p_a_peer_reaches_the_caller_at_its_address_and_not_at_a_wrong_port(pair) -> None:
    """The helper dials from a fresh daemon: its existing connection to the caller does not count."""
    a, b = pair
    helper, caller = P2PTransport(a), P2PTransport(b)
    await serve_dialback(helper)
    right = await ask_dialback(caller, [helper.peer_id], dialable(await b.get_visible_maddrs()))
    assert right.ok, right
    other = P2PTransport(await P2P.create(initial_peers=await a.get_visible_maddrs()))  # rate limit is per caller
    try:
        wrong = await ask_dialback(other, [helper.peer_id], ["/ip4/127.0.0.1/tcp/1"])
    finally:
        await other.p2p.shutdown()
    assert wrong.known and not wrong.ok, wrong


async def test_a_starting_node_pings_its_peers_until_a_dial_backoff_ends_and_gives_up_on_the_dead_in_time() -> None:
    """The first round of two nodes that saw each other's records but whose daemons refused to dial each other
    (libp2p's dial backoff after a failed first dial) was lost: each led a group of one. A starting node now pings
    the peers it sees until each answers: through a backoff, and not past its wait on a peer that never does."""
    net = MemoryNetwork()
    me, late, refusing, dead = (net.transport(p) for p in ("me", "late", "refusing", "dead"))
    calls: dict[str, int] = {}

    async def pong(sender: str, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        return {}, b""

    async def refuse(sender: str, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        raise Rejected("not this swarm's run")

    def backoff(sender: str, peer: str, method: str, header: dict[str, Any]) -> None:
        if method != "ping":
            return  # a call's frames
        calls[peer] = calls.get(peer, 0) + 1
        if peer == "late" and calls[peer] <= 3:
            raise PeerUnreachable(f"{method} to {peer}: all dials failed: dial backoff")

    await late.serve("ping", pong, max_body=0)
    await refusing.serve("ping", refuse, max_body=0)  # an answer all the same: the connection works
    net.before_call = backoff
    started = time.monotonic()
    assert await reach(me, {}, lambda: ["late", "refusing", "me"], wait_s=10.0) == {"late", "refusing"}
    assert calls == {"late": 4, "refusing": 1}  # the late one until it answered, the others once
    assert time.monotonic() - started < 10.0 - 3 * REACH_PAUSE_S

    started = time.monotonic()
    assert await reach(me, {}, lambda: ["late", "dead"], wait_s=1.5) == {"late"}
    assert 1.5 <= time.monotonic() - started < 1.5 + 2 * REACH_PAUSE_S  # its time for the dead one, not much more
    assert calls["dead"] >= 2
