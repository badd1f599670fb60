"""Request/response RPCs over hivemind's libp2p streams, with deadlines, size limits and byte counters.

A request is a msgpack header (a dict, at most ``MAX_HEADER`` bytes, with the number of body frames that follow
under ``"frames"``) and that many length-prefixed binary frames (each at most the handler's ``max_body``); the
answer is a header and one body frame. A unary call sends one frame; a streamed call sends many over the same
stream without waiting for acknowledgements, which is how shards move in parts. p2pd streams do not half-close,
so nothing relies on EOF: both sides read exactly the frames they expect. Lengths are checked before anything
is allocated, so a peer that claims a 1 TB body is refused after 8 bytes.

``Transport`` is the interface the protocol code sees; ``P2PTransport`` runs it on a real ``hivemind.p2p.P2P``
and ``MemoryTransport`` (in ``swarmtrain.net.memory``) runs it in process for fast, deterministic tests.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import msgpack
from hivemind.p2p import P2P, PeerID

from swarmtrain.errors import SwarmtrainError
from swarmtrain.net.auth import PUBLIC, Refused, SwarmAuth

log = logging.getLogger(__name__)

MAX_HEADER = 1 << 16
MAX_CALLS_PER_PEER = 32
DEFAULT_MAX_REPLY = 1 << 20  # the reply body of a call that names no bound: the protocol's answers are headers
_LEN_BYTES = 8
_PREFIX = "swarmtrain/"

Handler = Callable[[str, dict[str, Any], bytes], Awaitable[tuple[dict[str, Any], bytes]]]
StreamHandler = Callable[[str, dict[str, Any], AsyncIterator[bytes]], Awaitable[tuple[dict[str, Any], bytes]]]


class RpcError(SwarmtrainError):
    """An RPC did not complete."""


class PeerUnreachable(RpcError):
    """The peer could not be reached or the stream broke: the peer is probably gone."""


class RpcTimeout(RpcError):
    """The peer did not answer before the deadline."""


class RemoteError(RpcError):
    """The peer answered with an error (it rejected the request); ``code`` says why in one word."""

    def __init__(self, message: str, code: str = "rejected") -> None:
        super().__init__(message)
        self.code = code


class Rejected(RpcError):
    """Raised by a handler to refuse a request; the caller sees a ``RemoteError`` with the reason and code."""

    def __init__(self, message: str, code: str = "rejected") -> None:
        super().__init__(message)
        self.code = code


class BadMessage(RpcError):
    """A frame was malformed or over its size limit."""


@dataclass
class ByteCounter:
    sent: int = 0
    received: int = 0


class PeerLimit:
    """Calls each remote peer has open at this node: one peer cannot hold streams (and their buffers) without
    bound. A round needs a handful per peer (parts, results, report, digest, ping, a few state chunks)."""

    def __init__(self, limit: int = MAX_CALLS_PER_PEER) -> None:
        self.limit = limit
        self.open: Counter[str] = Counter()

    def acquire(self, peer: str) -> bool:
        if self.open[peer] >= self.limit:
            return False
        self.open[peer] += 1
        return True

    def release(self, peer: str) -> None:
        self.open[peer] -= 1
        if self.open[peer] <= 0:
            del self.open[peer]


class Transport(ABC):
    """What the protocol code sees: streamed calls and handlers; the one-frame forms are built on them."""

    peer_id: str
    counter: ByteCounter
    auth: SwarmAuth = PUBLIC  # who may call this node and how its calls prove the swarm key
    limit: PeerLimit  # calls each peer may have open at this node

    @abstractmethod
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
        """Send ``count`` frames after the header on one stream and return the answer, whose body may be at most
        ``max_reply`` bytes (checked before it is read; None: ``DEFAULT_MAX_REPLY``). A call whose answer carries
        data names what that data can legitimately be (a state chunk: the chunk size)."""

    @abstractmethod
    async def serve_stream(self, method: str, handler: StreamHandler, *, max_body: int, max_frames: int) -> None:
        """Answer calls to ``method``; each call's frames reach ``handler`` as they arrive."""

    async def call(
        self,
        peer: str,
        method: str,
        header: dict[str, Any],
        body: bytes = b"",
        *,
        timeout: float,
        max_reply: int | None = None,
    ) -> tuple[dict[str, Any], bytes]:
        bound = {} if max_reply is None else {"max_reply": max_reply}  # wrappers of call_stream need not know it
        return await self.call_stream(peer, method, header, single(body), count=1, timeout=timeout, **bound)

    async def serve(self, method: str, handler: Handler, *, max_body: int) -> None:
        await self.serve_stream(method, unary(handler), max_body=max_body, max_frames=1)


@lru_cache(maxsize=4096)
def peer_id(peer: str) -> PeerID:
    """The ``PeerID`` of a base58 peer id, decoded once: hivemind's ``PeerID`` re-encodes its base58 form on every
    construction, a cost each call paid again (about 3 % of an all-reduce peer's CPU time)."""
    return PeerID.from_base58(peer)


def pack_header(header: dict[str, Any]) -> bytes:
    data = msgpack.packb(header, use_bin_type=True)
    if len(data) > MAX_HEADER:
        raise BadMessage(f"header of {len(data)} bytes exceeds {MAX_HEADER}")
    return data


def unpack_header(data: bytes) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=MAX_HEADER)
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        raise BadMessage(f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise BadMessage(f"header must be a map, got {type(header).__name__}")
    return header


async def read_frame(reader: asyncio.StreamReader, limit: int) -> bytes:
    length = int.from_bytes(await reader.readexactly(_LEN_BYTES), "big")
    if length > limit:
        raise BadMessage(f"frame of {length} bytes exceeds the limit of {limit}")
    return await reader.readexactly(length)


def write_frame(writer: asyncio.StreamWriter, data: bytes | memoryview) -> int:
    writer.write(len(data).to_bytes(_LEN_BYTES, "big"))
    writer.write(data)
    return len(data) + _LEN_BYTES


def admit(transport: Transport, method: str, remote: str, header: dict[str, Any]) -> dict[str, Any] | None:
    """None if ``remote`` may make this call (the swarm key and allowlist), else the error answer that says why."""
    try:
        transport.auth.check(remote, transport.peer_id, method, header)
    except Refused as exc:
        log.warning("refused %s from %s: %s", method, remote[-8:], exc)
        return {"error": str(exc), "code": exc.code}
    return None


async def run_handler(
    handler: Callable[[str, dict[str, Any], Any], Awaitable[tuple[dict[str, Any], bytes]]],
    method: str,
    remote: str,
    header: dict[str, Any],
    body: Any,
) -> tuple[dict[str, Any], bytes]:
    """Run a handler; a rejection or a bug becomes an error answer, never a crash of the node."""
    try:
        return await handler(remote, header, body)
    except (asyncio.IncompleteReadError, ConnectionError):
        raise  # the caller went away mid-stream; there is nobody to answer
    except RpcError as exc:
        log.warning("rejected %s from %s: %s", method, remote[-8:], exc)
        return {"error": str(exc), "code": getattr(exc, "code", "rejected")}, b""
    except Exception:
        log.exception("handler %s failed on a request from %s", method, remote[-8:])
        return {"error": "internal error"}, b""


class P2PTransport(Transport):
    """``Transport`` over a running ``hivemind.p2p.P2P`` daemon."""

    def __init__(
        self,
        p2p: P2P,
        max_response: int = DEFAULT_MAX_REPLY,
        auth: SwarmAuth = PUBLIC,
        up_delay_s: float = 0.0,
        down_delay_s: float = 0.0,
        up_mbit: float = 0.0,
        down_mbit: float = 0.0,
    ) -> None:
        self.p2p = p2p
        self.peer_id = p2p.peer_id.to_base58()
        self.counter = ByteCounter()
        self.max_response = max_response
        self.auth = auth
        self.limit = PeerLimit()
        # A distant link on one machine (node.up_delay_ms, node.down_delay_ms): each message this node sends
        # leaves up_delay_s late, each it receives is read down_delay_s late. A message's frames follow its
        # header down the stream, so a streamed call is late once, as on a long pipe, not once per frame.
        self.up_delay_s = up_delay_s
        self.down_delay_s = down_delay_s
        # A narrow link on one machine without root (node.up_mbit, node.down_mbit): frames go out, and are read,
        # no faster than the rate allows, one after another over all of this node's calls.
        self.up = Pacer(up_mbit)
        self.down = Pacer(down_mbit)

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
        """Send ``count`` frames after the header on one stream (each written as soon as the previous drained)."""
        limit = self.max_response if max_reply is None else max_reply
        try:
            return await asyncio.wait_for(self._call(peer, method, header, frames, count, limit), timeout)
        except TimeoutError:
            raise RpcTimeout(f"{method} to {peer[-8:]} timed out after {timeout:.1f} s") from None

    async def _call(
        self, peer: str, method: str, header: dict[str, Any], frames: AsyncIterator[bytes], count: int, limit: int
    ) -> tuple[dict[str, Any], bytes]:
        packed = pack_header({**header, "frames": count, **self.auth.stamp(self.peer_id, peer, method)})
        writer = None
        try:
            _, reader, writer = await self.p2p.call_binary_stream_handler(peer_id(peer), _PREFIX + method)
            await _late(self.up_delay_s)
            await self.up.wait(len(packed))
            self.counter.sent += write_frame(writer, packed)
            sent = 0
            async for frame in frames:
                await self.up.wait(len(frame))
                self.counter.sent += write_frame(writer, memoryview(frame))
                await writer.drain()
                sent += 1
            if sent != count:
                raise BadMessage(f"{method}: {sent} frames produced, {count} announced")
            await writer.drain()
            raw = await read_frame(reader, MAX_HEADER)
            response_body = await read_frame(reader, limit)  # refused after its 8-byte length if over the bound
            self.counter.received += 2 * _LEN_BYTES + len(raw) + len(response_body)
            await self.down.wait(len(raw) + len(response_body))
            response = unpack_header(raw)
            await _late(self.down_delay_s)
        except (ConnectionError, asyncio.IncompleteReadError, OSError) as exc:
            raise PeerUnreachable(f"{method} to {peer[-8:]} failed: {exc!r}") from None
        except BadMessage as exc:  # a garbled answer: treat the peer as broken, like a dropped stream
            raise PeerUnreachable(f"{method} to {peer[-8:]}: bad answer: {exc}") from None
        except Exception as exc:  # p2pd control errors (dial failures) surface as assorted exception types
            if isinstance(exc, RpcError | asyncio.CancelledError):
                raise
            raise PeerUnreachable(f"{method} to {peer[-8:]} failed: {exc!r}") from None
        finally:
            if writer is not None:
                writer.close()
        if "error" in response:
            raise RemoteError(f"{peer[-8:]} rejected {method}: {response['error']}", str(response.get("code")))
        return response, response_body

    async def serve_stream(self, method: str, handler: StreamHandler, *, max_body: int, max_frames: int) -> None:
        async def on_stream(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            remote = info.peer_id.to_base58()
            if not self.limit.acquire(remote):
                log.warning(
                    "dropped a %s stream from %s: %d calls of it open here", method, remote[-8:], self.limit.limit
                )
                writer.close()
                return
            try:
                raw = await read_frame(reader, MAX_HEADER)
                await self.down.wait(len(raw))
                await _late(self.down_delay_s)
                self.counter.received += _LEN_BYTES + len(raw)
                header = unpack_header(raw)
                count = header.pop("frames", None)
                if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= max_frames:
                    raise BadMessage(f"{method}: frame count {count!r} is not within 0..{max_frames}")
                refusal = admit(self, method, remote, header)
                if refusal is not None:
                    if count > 1:  # a stream from outside the swarm: no answer is worth reading its parts
                        return
                    if count == 1:
                        await read_frame(reader, max_body)
                    await _late(self.up_delay_s)
                    self.counter.sent += write_frame(writer, pack_header(refusal)) + write_frame(writer, b"")
                    await writer.drain()
                    return
                consumed, oversized = 0, None

                async def frames() -> AsyncIterator[bytes]:
                    nonlocal consumed, oversized
                    while consumed < count:
                        try:
                            data = await read_frame(reader, max_body)
                        except BadMessage as exc:
                            oversized = exc  # the stream is out of step now: no answer can follow
                            raise
                        consumed += 1
                        self.counter.received += _LEN_BYTES + len(data)
                        await self.down.wait(len(data))
                        yield data

                response, response_body = await run_handler(handler, method, remote, header, frames())
                if oversized is not None:
                    raise oversized
                while consumed < count:  # a refusal mid-stream: read the rest (bounded) so the answer arrives
                    consumed += 1
                    self.counter.received += _LEN_BYTES + len(await read_frame(reader, max_body))
                await _late(self.up_delay_s)
                packed = pack_header(response)
                await self.up.wait(len(packed) + len(response_body))
                self.counter.sent += write_frame(writer, packed) + write_frame(writer, response_body)
                await writer.drain()
            except BadMessage as exc:
                log.warning("rejected %s from %s: %s", method, remote[-8:], exc)
            except (ConnectionError, asyncio.IncompleteReadError, OSError):
                pass  # the caller went away; nothing to answer
            except asyncio.CancelledError:
                # The node is shutting down with this call open (a join waiting for its group): end the stream
                # quietly. Re-raised, the stream callback's ``task.exception()`` logged a traceback per open call.
                return
            finally:
                self.limit.release(remote)
                writer.close()

        await self.p2p.add_binary_stream_handler(_PREFIX + method, on_stream)


class Pacer:
    """One direction of a link at ``mbit`` Mbit/s (0: unlimited): each frame waits until the frames before it, of
    every call, would have crossed the link, plus its own time on it (length prefix included)."""

    def __init__(self, mbit: float) -> None:
        self.bytes_per_s = mbit * 1e6 / 8
        self.free_at = 0.0  # the loop time at which the link has carried everything given to it

    async def wait(self, size: int) -> None:
        if self.bytes_per_s <= 0:
            return
        now = asyncio.get_running_loop().time()
        self.free_at = max(self.free_at, now) + (size + _LEN_BYTES) / self.bytes_per_s
        await asyncio.sleep(self.free_at - now)


async def _late(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


async def single(body: bytes) -> AsyncIterator[bytes]:
    yield body


def unary(handler: Handler) -> StreamHandler:
    """A one-frame handler as a stream handler."""

    async def wrapped(
        sender: str, header: dict[str, Any], frames: AsyncIterator[bytes]
    ) -> tuple[dict[str, Any], bytes]:
        body = b""
        async for frame in frames:
            body = frame
        return await handler(sender, header, body)

    return wrapped
