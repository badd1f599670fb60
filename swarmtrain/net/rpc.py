"""Request/response RPCs over hivemind's libp2p streams, with deadlines, size limits and byte counters.

Every message is two length-prefixed frames: a msgpack header (a dict, at most ``MAX_HEADER`` bytes) and a
binary body (at most the handler's ``max_body``). p2pd streams do not half-close, so nothing relies on EOF:
both sides read exactly the frames they expect. Lengths are checked before anything is allocated, so a peer
that claims a 1 TB body is refused after 8 bytes.

``Transport`` is the interface the protocol code sees; ``P2PTransport`` runs it on a real ``hivemind.p2p.P2P``
and ``MemoryTransport`` (in ``swarmtrain.net.memory``) runs it in process for fast, deterministic tests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
from hivemind.p2p import P2P, PeerID

from swarmtrain.errors import SwarmtrainError

log = logging.getLogger(__name__)

MAX_HEADER = 1 << 16
_LEN_BYTES = 8
_PREFIX = "swarmtrain/"

Handler = Callable[[str, dict[str, Any], bytes], Awaitable[tuple[dict[str, Any], bytes]]]


class RpcError(SwarmtrainError):
    """An RPC did not complete."""


class PeerUnreachable(RpcError):
    """The peer could not be reached or the stream broke: the peer is probably gone."""


class RpcTimeout(RpcError):
    """The peer did not answer before the deadline."""


class RemoteError(RpcError):
    """The peer answered with an error (it rejected the request)."""


class Rejected(RpcError):
    """Raised by a handler to refuse a request; the caller sees a ``RemoteError`` with the reason."""


class BadMessage(RpcError):
    """A frame was malformed or over its size limit."""


@dataclass
class ByteCounter:
    sent: int = 0
    received: int = 0


class Transport(Protocol):
    peer_id: str
    counter: ByteCounter

    async def call(
        self, peer: str, method: str, header: dict[str, Any], body: bytes = b"", *, timeout: float
    ) -> tuple[dict[str, Any], bytes]: ...

    async def serve(self, method: str, handler: Handler, *, max_body: int) -> None: ...


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


async def run_handler(
    handler: Handler, method: str, remote: str, header: dict[str, Any], body: bytes
) -> tuple[dict[str, Any], bytes]:
    """Run a handler; a rejection or a bug becomes an error answer, never a crash of the node."""
    try:
        return await handler(remote, header, body)
    except RpcError as exc:
        log.warning("rejected %s from %s: %s", method, remote[-8:], exc)
        return {"error": str(exc)}, b""
    except Exception:
        log.exception("handler %s failed on a request from %s", method, remote[-8:])
        return {"error": "internal error"}, b""


class P2PTransport:
    """``Transport`` over a running ``hivemind.p2p.P2P`` daemon."""

    def __init__(self, p2p: P2P, max_response: int = 1 << 31) -> None:
        self.p2p = p2p
        self.peer_id = p2p.peer_id.to_base58()
        self.counter = ByteCounter()
        self.max_response = max_response

    async def call(
        self, peer: str, method: str, header: dict[str, Any], body: bytes = b"", *, timeout: float
    ) -> tuple[dict[str, Any], bytes]:
        try:
            return await asyncio.wait_for(self._call(peer, method, header, body), timeout)
        except TimeoutError:
            raise RpcTimeout(f"{method} to {peer[-8:]} timed out after {timeout:.1f} s") from None

    async def _call(self, peer: str, method: str, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        packed = pack_header(header)
        writer = None
        try:
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), _PREFIX + method)
            self.counter.sent += write_frame(writer, packed) + write_frame(writer, memoryview(body))
            await writer.drain()
            raw = await read_frame(reader, MAX_HEADER)
            response_body = await read_frame(reader, self.max_response)
            self.counter.received += 2 * _LEN_BYTES + len(raw) + len(response_body)
            response = unpack_header(raw)
        except (ConnectionError, asyncio.IncompleteReadError, OSError) as exc:
            raise PeerUnreachable(f"{method} to {peer[-8:]} failed: {exc!r}") from None
        except Exception as exc:  # p2pd control errors (dial failures) surface as assorted exception types
            if isinstance(exc, RpcError | asyncio.CancelledError):
                raise
            raise PeerUnreachable(f"{method} to {peer[-8:]} failed: {exc!r}") from None
        finally:
            if writer is not None:
                writer.close()
        if "error" in response:
            raise RemoteError(f"{peer[-8:]} rejected {method}: {response['error']}")
        return response, response_body

    async def serve(self, method: str, handler: Handler, *, max_body: int) -> None:
        async def on_stream(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            remote = info.peer_id.to_base58()
            try:
                raw = await read_frame(reader, MAX_HEADER)
                body = await read_frame(reader, max_body)
                self.counter.received += 2 * _LEN_BYTES + len(raw) + len(body)
                response, response_body = await run_handler(handler, method, remote, unpack_header(raw), body)
                self.counter.sent += write_frame(writer, pack_header(response)) + write_frame(writer, response_body)
                await writer.drain()
            except BadMessage as exc:
                log.warning("rejected %s from %s: %s", method, remote[-8:], exc)
            except (ConnectionError, asyncio.IncompleteReadError, OSError):
                pass  # the caller went away; nothing to answer
            finally:
                writer.close()

        await self.p2p.add_binary_stream_handler(_PREFIX + method, on_stream)
