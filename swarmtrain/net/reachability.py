"""Can other machines dial this node on the addresses it announces? Peers dial it back and say.

A node behind a NAT or a firewall still dials out, so it finds the swarm and its own calls work, but no peer can
open a connection to it: it is left out of groups it does not lead, and its DHT records point at an address
nobody reaches. Nothing in the node's own view shows that. So a node asks a few peers to dial it back
("dialback"): each starts a throwaway daemon with relays and NAT traversal off, dials the caller's peer id at the
caller's addresses only, and answers whether it got through. libp2p checks the peer id it reaches, so an answer
says only whether the caller itself answers there; it cannot be used to probe other services. A peer dials back
one caller at a time and each caller at most once a ``DIALBACK_INTERVAL_S``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from multiaddr import Multiaddr

from swarmtrain.net.rpc import PeerUnreachable, Rejected, RpcError, RpcTimeout, Transport

log = logging.getLogger(__name__)

MAX_ADDRS = 4  # addresses dialled per request
START_TIMEOUT = 20.0  # the throwaway daemon's start (a second or two; longer on a loaded machine)
DIAL_TIMEOUT = 8.0  # one dial of all of a caller's addresses
ASK_TIMEOUT = START_TIMEOUT + DIAL_TIMEOUT + 5.0
DIALBACK_INTERVAL_S = 60.0  # per caller
ASKED = 3  # peers a node asks
REACH_WAIT_S = 15.0  # how long a starting node waits to reach the peers it sees (libp2p's dial backoff is 5 s and up)
REACH_PAUSE_S = 0.5
FIX = (
    "other machines cannot open a connection to this node, so it is left out of groups it does not lead. Set "
    "--announce to this machine's public address with the port node.host listens on (e.g. --host "
    "/ip4/0.0.0.0/tcp/31337 --announce /ip4/<public ip>/tcp/31337) and forward that port on your router; or, "
    "without a public address, let relays carry inbound connections: --set node.use_auto_relay=true (and "
    "node.relays=['<a relay's address>'] to name them)"
)

Dial = Callable[[str, list[str]], Awaitable[bool]]


def is_loopback(addr: str) -> bool:
    """Whether a multiaddr names a loopback IP (127.0.0.0/8, ::1)."""
    parts = addr.split("/")
    return len(parts) > 2 and parts[1] in ("ip4", "ip6") and ipaddress.ip_address(parts[2]).is_loopback


def dialable(addrs: Iterable[Any]) -> list[str]:
    """The addresses of ``addrs`` another machine could dial directly: TCP or QUIC over IP or DNS, without the
    ``/p2p/<id>`` suffix and without relayed (``/p2p-circuit``) ones; at most ``MAX_ADDRS``."""
    found = []
    for addr in map(str, addrs):
        addr = addr.split("/p2p/")[0] if "/p2p-circuit" not in addr else ""
        parts = addr.split("/")
        if len(parts) > 4 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6") and parts[3] in ("tcp", "udp"):
            found.append(addr)
    return list(dict.fromkeys(found))[:MAX_ADDRS]


def _checked(addrs: Any) -> list[str]:
    if not isinstance(addrs, list) or not 0 < len(addrs) <= MAX_ADDRS or not all(isinstance(a, str) for a in addrs):
        raise Rejected(f"addrs must be a list of 1-{MAX_ADDRS} multiaddrs")
    if dialable(addrs) != addrs:
        raise Rejected("addrs must be direct TCP or QUIC multiaddrs without /p2p parts")
    for addr in addrs:
        try:
            Multiaddr(addr)
        except Exception as exc:
            raise Rejected(f"{addr!r} is not a multiaddr ({exc})") from None
    return addrs


async def dial_directly(peer: str, addrs: list[str]) -> bool:
    """Dial ``peer`` at ``addrs`` only, from a fresh daemon that knows no other route to it (no relay, no NAT
    traversal, no earlier connection): True when the peer answered with its own id."""
    from hivemind.p2p import P2P, PeerID

    try:
        probe = await asyncio.wait_for(P2P.create(use_relay=False, auto_nat=False, nat_port_map=False), START_TIMEOUT)
    except Exception as exc:  # this peer's trouble, not the caller's: it learns nothing either way
        raise Rejected(f"could not start a daemon to dial from ({exc!r})", code="busy") from None
    try:
        target = PeerID.from_base58(peer)
        await asyncio.wait_for(probe._client.connect(target, [Multiaddr(a) for a in addrs]), DIAL_TIMEOUT)
        return True
    except Exception as exc:  # the daemon's error text varies: unreachable, refused, wrong peer id, timeout
        log.info("dial-back to %s at %s failed: %r", peer[-8:], ", ".join(addrs), exc)
        return False
    finally:
        await probe.shutdown()


async def serve_dialback(transport: Transport, dial: Dial = dial_directly) -> None:
    """Answer "dialback": dial the caller at the addresses it names (see the module's docstring)."""
    lock = asyncio.Lock()
    last: dict[str, float] = {}

    async def on_dialback(sender: str, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        addrs = _checked(header.get("addrs"))
        now = time.monotonic()
        for peer in [p for p, t in last.items() if now - t > DIALBACK_INTERVAL_S]:
            del last[peer]
        if sender in last:
            raise Rejected(f"dialled {sender[-8:]} back less than {DIALBACK_INTERVAL_S:.0f} s ago", code="busy")
        if lock.locked():
            raise Rejected("dialling another peer back", code="busy")
        last[sender] = now
        async with lock:
            return {"reached": await dial(sender, addrs)}, b""

    await transport.serve("dialback", on_dialback, max_body=0)


@dataclass
class Reachability:
    """What the peers asked answered: who reached this node at ``addrs``, who did not, who could not be asked."""

    addrs: list[str]
    reached: list[str] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)
    unasked: dict[str, str] = field(default_factory=dict)  # peer -> why

    @property
    def known(self) -> bool:
        return bool(self.reached or self.missed)

    @property
    def ok(self) -> bool:
        return bool(self.reached)

    def summary(self) -> str:
        where = ", ".join(self.addrs)
        if self.reached:
            return f"reachable at {where}: dialled back by {', '.join(p[-8:] for p in self.reached)}"
        if self.missed:
            return f"not reachable at {where}: {', '.join(p[-8:] for p in self.missed)} could not dial this node back"
        why = "; ".join(f"{p[-8:]}: {e}" for p, e in self.unasked.items()) or "no peer to ask"
        return f"reachability of {where} unknown: no peer dialled back ({why})"


async def ask_dialback(transport: Transport, peers: Iterable[str], addrs: list[str]) -> Reachability:
    """Ask up to ``ASKED`` of ``peers`` at once to dial this node back at ``addrs``."""
    result = Reachability(addrs)
    asked = [p for p in dict.fromkeys(peers) if p != transport.peer_id][:ASKED]

    async def ask(peer: str) -> None:
        try:
            answer, _ = await transport.call(peer, "dialback", {"addrs": addrs}, timeout=ASK_TIMEOUT)
        except RpcError as exc:
            result.unasked[peer] = str(exc)
            return
        (result.reached if answer.get("reached") is True else result.missed).append(peer)

    await asyncio.gather(*(ask(peer) for peer in asked))
    return result


async def reach(
    transport: Transport, header: dict[str, Any], peers: Callable[[], Iterable[str]], wait_s: float
) -> set[str]:
    """Ping ``peers()`` (asked again on every try) until each has answered once or ``wait_s`` passed; returns those
    that answered. Any answer counts, a refusal too: it shows the connection works.

    A starting node sees its peers' records before its daemon has a connection to them. A first dial that fails
    makes libp2p refuse every dial to that address for a few seconds ("dial backoff"), and a first round started
    then finds its leader unreachable: each node leads a group of one, and none applies the round. Waiting until
    the peers answer costs one ping each when nothing is wrong."""
    me = transport.peer_id
    until = time.monotonic() + wait_s
    reached: set[str] = set()

    async def ping(peer: str) -> None:
        try:
            await transport.call(peer, "ping", header, timeout=min(2.0, max(until - time.monotonic(), 0.1)))
        except (PeerUnreachable, RpcTimeout):
            return
        except RpcError:
            pass
        reached.add(peer)

    def pending() -> list[str]:
        return sorted(set(peers()) - reached - {me})

    todo = pending()
    while todo and time.monotonic() < until:
        await asyncio.gather(*(ping(peer) for peer in todo))
        if todo := pending():
            await asyncio.sleep(max(0.0, min(REACH_PAUSE_S, until - time.monotonic())))
    return reached
