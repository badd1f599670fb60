"""An in-process ``Transport`` for fast, deterministic protocol tests: no daemons, no sockets.

Faults are injected per peer: ``kill(peer)`` makes every call to or from it fail as a dead peer's would,
``delay`` adds latency, and ``fail_on`` runs a hook before a call (for "die after the first part" tests).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from swarmtrain.net.rpc import (
    MAX_HEADER,
    BadMessage,
    ByteCounter,
    Handler,
    PeerUnreachable,
    RemoteError,
    RpcTimeout,
    pack_header,
    run_handler,
    unpack_header,
)


class MemoryNetwork:
    def __init__(self) -> None:
        self.handlers: dict[str, dict[str, tuple[Handler, int]]] = {}
        self.dead: set[str] = set()
        self.delay = 0.0
        self.before_call: Callable[[str, str, str, dict[str, Any]], None] | None = None

    def transport(self, peer_id: str) -> MemoryTransport:
        self.handlers.setdefault(peer_id, {})
        return MemoryTransport(self, peer_id)

    def kill(self, peer_id: str) -> None:
        self.dead.add(peer_id)


class MemoryTransport:
    def __init__(self, network: MemoryNetwork, peer_id: str) -> None:
        self.network = network
        self.peer_id = peer_id
        self.counter = ByteCounter()

    async def call(
        self, peer: str, method: str, header: dict[str, Any], body: bytes = b"", *, timeout: float
    ) -> tuple[dict[str, Any], bytes]:
        net = self.network
        if net.before_call is not None:
            net.before_call(self.peer_id, peer, method, header)
        if self.peer_id in net.dead or peer in net.dead or method not in net.handlers.get(peer, {}):
            raise PeerUnreachable(f"{method} to {peer}: unreachable")
        handler, max_body = net.handlers[peer][method]
        packed = pack_header(header)
        self.counter.sent += len(packed) + len(body) + 16
        if len(body) > max_body:
            raise PeerUnreachable(f"{method} to {peer}: body over the limit, stream reset")
        try:
            async with asyncio.timeout(timeout):
                if net.delay:
                    await asyncio.sleep(net.delay)
                response, response_body = await run_handler(handler, method, self.peer_id, unpack_header(packed), body)
        except TimeoutError:
            raise RpcTimeout(f"{method} to {peer} timed out") from None
        if self.peer_id in net.dead or peer in net.dead:
            raise PeerUnreachable(f"{method} to {peer}: connection lost")
        raw = pack_header(response)
        if len(raw) > MAX_HEADER:
            raise BadMessage("response header over the limit")
        self.counter.received += len(raw) + len(response_body) + 16
        if "error" in response:
            raise RemoteError(f"{peer} rejected {method}: {response['error']}")
        return response, response_body

    async def serve(self, method: str, handler: Handler, *, max_body: int) -> None:
        self.network.handlers[self.peer_id][method] = (handler, max_body)
