"""An in-process ``Transport`` for fast, deterministic protocol tests: no daemons, no sockets.

Faults are injected per peer: ``kill(peer)`` makes every call to or from it fail as a dead peer's would,
``freeze(peer)`` makes every later one stall until its timeout (SIGSTOP: the daemon keeps the connections open, the
process answers nothing), ``delay`` adds latency, and ``before_call`` runs a hook before a call (for "die after the
first part" tests).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from swarmtrain.net.auth import PUBLIC, SwarmAuth
from swarmtrain.net.rpc import (
    DEFAULT_MAX_REPLY,
    MAX_HEADER,
    BadMessage,
    ByteCounter,
    PeerLimit,
    PeerUnreachable,
    RemoteError,
    RpcTimeout,
    StreamHandler,
    Transport,
    admit,
    pack_header,
    run_handler,
    unpack_header,
)


class MemoryNetwork:
    def __init__(self) -> None:
        self.handlers: dict[str, dict[str, tuple[StreamHandler, int, int]]] = {}
        self.transports: dict[str, MemoryTransport] = {}
        self.dead: set[str] = set()
        self.frozen: set[str] = set()
        self.delay = 0.0
        self.before_call: Callable[[str, str, str, dict[str, Any]], None] | None = None

    def transport(self, peer_id: str, auth: SwarmAuth = PUBLIC) -> MemoryTransport:
        self.handlers.setdefault(peer_id, {})
        self.transports[peer_id] = MemoryTransport(self, peer_id, auth)
        return self.transports[peer_id]

    def kill(self, peer_id: str) -> None:
        self.dead.add(peer_id)

    def freeze(self, peer_id: str) -> None:
        self.frozen.add(peer_id)


class MemoryTransport(Transport):
    def __init__(self, network: MemoryNetwork, peer_id: str, auth: SwarmAuth = PUBLIC) -> None:
        self.network = network
        self.peer_id = peer_id
        self.counter = ByteCounter()
        self.auth = auth
        self.limit = PeerLimit()

    async def call_stream(
        self,
        peer: str,
        method: str,
        header: dict[str, Any],
        frames: AsyncIterator[bytes],
        *,
        count: int,
        timeout: float,
        max_reply: int | None = None,
    ) -> tuple[dict[str, Any], bytes]:
        net = self.network
        if net.before_call is not None:
            net.before_call(self.peer_id, peer, method, header)
        if self.peer_id in net.dead or peer in net.dead or method not in net.handlers.get(peer, {}):
            raise PeerUnreachable(f"{method} to {peer}: unreachable")
        if self.peer_id in net.frozen or peer in net.frozen:
            await asyncio.sleep(timeout)
            raise RpcTimeout(f"{method} to {peer} timed out (frozen)")
        handler, max_body, max_frames = net.handlers[peer][method]
        packed = pack_header({**header, **self.auth.stamp(self.peer_id, peer, method)})
        self.counter.sent += len(packed) + 8
        if count > max_frames:
            raise PeerUnreachable(f"{method} to {peer}: too many frames, stream reset")
        refusal = admit(net.transports[peer], method, self.peer_id, received := unpack_header(packed))
        if refusal is not None:
            if count > 1:
                raise PeerUnreachable(f"{method} to {peer}: refused stream reset")
            raise RemoteError(f"{peer} rejected {method}: {refusal['error']}", refusal["code"])

        async def delivered() -> AsyncIterator[bytes]:
            index = 0
            async for frame in frames:
                if net.before_call is not None:
                    net.before_call(self.peer_id, peer, f"{method}#frame", {"frame": index})
                if self.peer_id in net.dead or peer in net.dead:
                    raise ConnectionError("connection lost mid-stream")
                if len(frame) > max_body:
                    raise ConnectionError("frame over the limit, stream reset")
                self.counter.sent += len(frame) + 8
                index += 1
                yield frame

        limit = net.transports[peer].limit
        if not limit.acquire(self.peer_id):
            raise PeerUnreachable(f"{method} to {peer}: {limit.limit} calls open there already, stream reset")
        try:
            async with asyncio.timeout(timeout):
                if net.delay:
                    await asyncio.sleep(net.delay)
                response, response_body = await run_handler(handler, method, self.peer_id, received, delivered())
        except TimeoutError:
            raise RpcTimeout(f"{method} to {peer} timed out") from None
        except (ConnectionError, PeerUnreachable) as exc:
            raise PeerUnreachable(f"{method} to {peer}: {exc}") from None
        finally:
            limit.release(self.peer_id)
        if self.peer_id in net.dead or peer in net.dead:
            raise PeerUnreachable(f"{method} to {peer}: connection lost")
        raw = pack_header(response)
        if len(raw) > MAX_HEADER:
            raise BadMessage("response header over the limit")
        max_reply = DEFAULT_MAX_REPLY if max_reply is None else max_reply
        if len(response_body) > max_reply:  # over P2P only its length is read before it is refused
            self.counter.received += len(raw) + 16
            raise PeerUnreachable(f"{method} to {peer}: bad answer: a body of {len(response_body)} B over {max_reply}")
        self.counter.received += len(raw) + len(response_body) + 16
        if "error" in response:
            raise RemoteError(f"{peer} rejected {method}: {response['error']}", str(response.get("code")))
        return response, response_body

    async def serve_stream(self, method: str, handler: StreamHandler, *, max_body: int, max_frames: int) -> None:
        self.network.handlers[self.peer_id][method] = (handler, max_body, max_frames)
