"""State sync: theta_g and the outer optimizer state, served in chunks and downloaded from several donors.

Donor side (``SnapshotStore``): a probe serialises the state to safetensors at once (no await between reading
the tensors and serialising, so the bytes are one consistent state) and keeps those bytes under their digest for
a while, so a download that outlasts a round still reads one state. A probe may name the digest it wants: a
donor that still holds that snapshot answers with it even after it moved on a round. The probe's answer is the
donor's round, digest, byte size and a manifest: the sha256 of every chunk. A chunk request names the digest and
an index.

Joiner side (``download_state``): probe the candidate donors, keep those at the wanted digest and round, group
them by manifest (honest donors of one digest serialise identical bytes), and fetch the chunks of the largest
group from all its donors at once. Every donor pulls the next chunk as soon as one of its calls returns, so the
donors that answer fastest serve the most. A chunk that fails (error, timeout, wrong length, hash not in the
manifest) goes back to the front of the queue for the next free donor; a donor is dropped after its second
failed call in a row (bad bytes or a state it no longer holds drop it at once). The whole download has one
deadline (``Deadline``): from the state's size at first, then from the rate measured. The assembled bytes must
parse as safetensors with our own names, shapes and dtypes and hash to the agreed digest; otherwise the next
group is tried. Nothing is unpickled, and every size a donor claims is bounded by the size of our own state.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from swarmtrain.averaging.outer import outer_digest
from swarmtrain.net import Rejected, RpcError, Transport

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20  # default chunk of a download
MIN_CHUNK, MAX_CHUNK = 1 << 10, 64 << 20  # chunk sizes are powers of two in this range
MAX_CHUNKS = 1 << 16  # so a manifest is at most 2 MiB
MAX_DONORS = 8  # probed at once; more only if none of these serves the state
INFLIGHT = 2  # chunk requests in flight per donor
SNAPSHOT_TTL_S = 60.0  # a snapshot nobody asked for this long is dropped
KEEP_SNAPSHOTS = 2  # the current state and the one before (a download in progress across a round)
STRIKES = 2  # failed calls in a row before a donor is dropped: one failure is forgiven
MIN_RATE = 256 << 10  # bytes/s: until a rate is measured, the deadline allows the state's size at this rate
RATE_SLACK = 4.0  # once measured, the deadline allows this multiple of the time the rest needs at that rate
_HASH = 32  # sha256
_HEADER_PER_TENSOR = 256  # safetensors' JSON header: about 80 bytes per flat tensor, padded to 8


class StateSyncError(RpcError):
    """A download could not assemble a state that verifies."""


class BadChunk(StateSyncError):
    """A donor sent a chunk other than the one asked for, or one that does not match its manifest."""


def chunk_hashes(data: bytes, chunk: int) -> bytes:
    view = memoryview(data)
    return b"".join(hashlib.sha256(view[i : i + chunk]).digest() for i in range(0, len(data), chunk))


def check_chunk_size(chunk: Any) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not MIN_CHUNK <= chunk <= MAX_CHUNK:
        raise Rejected(f"chunk size {chunk!r} is not within {MIN_CHUNK}..{MAX_CHUNK}")
    if chunk & (chunk - 1):
        raise Rejected(f"chunk size {chunk} is not a power of two")
    return chunk


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass
class Snapshot:
    round: int
    digest: str
    data: bytes
    expires: float = 0.0
    manifests: dict[int, asyncio.Future[bytes]] = field(default_factory=dict)

    async def manifest(self, chunk: int) -> bytes:
        """The chunk hashes for ``chunk``-byte chunks, computed once (in a thread: the bytes never change)."""
        if chunk not in self.manifests:
            self.manifests[chunk] = asyncio.ensure_future(asyncio.to_thread(chunk_hashes, self.data, chunk))
        return await asyncio.shield(self.manifests[chunk])


class SnapshotStore:
    """The serialised states a donor serves, by digest: the newest ``keep``, each dropped after ``ttl`` idle s."""

    def __init__(self, ttl: float = SNAPSHOT_TTL_S, keep: int = KEEP_SNAPSHOTS) -> None:
        self.ttl, self.keep = ttl, keep
        self.snapshots: dict[str, Snapshot] = {}
        self._timer: asyncio.TimerHandle | None = None

    async def answer(
        self, header: dict[str, Any], current: Callable[[], tuple[int, str, dict[str, torch.Tensor]]]
    ) -> tuple[dict[str, Any], bytes]:
        """Answer a probe (no ``index``: the snapshot it ``want``s if held, else one of ``current()``) or a chunk
        request."""
        chunk = check_chunk_size(header.get("chunk"))
        if "index" not in header:
            snapshot = self._held(header.get("want")) or self._take(*current())
            total = len(snapshot.data)
            if -(-total // chunk) > MAX_CHUNKS:
                raise Rejected(f"chunks of {chunk} bytes would be more than {MAX_CHUNKS}")
            manifest = await snapshot.manifest(chunk)
            return {"round": snapshot.round, "digest": snapshot.digest, "total": total}, manifest
        digest, index = header.get("digest"), header.get("index")
        snapshot = self.snapshots.get(digest) if isinstance(digest, str) else None
        if snapshot is None:
            raise Rejected(f"state {str(digest)[:8]} is not held here (any more)", code="gone")
        self._touch(snapshot)
        if not is_count(index) or index * chunk >= len(snapshot.data):
            raise Rejected(f"chunk {index!r} is out of range")
        return {"digest": digest}, snapshot.data[index * chunk : (index + 1) * chunk]

    def _held(self, digest: Any) -> Snapshot | None:
        """The snapshot of ``digest`` if this donor still holds it (it may have moved on since)."""
        snapshot = self.snapshots.get(digest) if isinstance(digest, str) else None
        if snapshot is not None:
            self._touch(snapshot)
        return snapshot

    def _take(self, round_: int, digest: str, tensors: dict[str, torch.Tensor]) -> Snapshot:
        snapshot = self.snapshots.pop(digest, None)
        if snapshot is not None:
            self.snapshots[digest] = snapshot  # the newest again
        else:
            # Serialised right here, with no await since the caller read the tensors: one consistent state.
            data = save_safetensors({k: v.contiguous() for k, v in tensors.items()})
            snapshot = self.snapshots[digest] = Snapshot(round_, digest, data)
            for stale in list(self.snapshots)[: -self.keep]:
                del self.snapshots[stale]
        snapshot.round = max(snapshot.round, round_)
        self._touch(snapshot)
        return snapshot

    def _touch(self, snapshot: Snapshot) -> None:
        snapshot.expires = time.monotonic() + self.ttl
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.ttl, self._expire)

    def _expire(self) -> None:
        now = time.monotonic()
        self.snapshots = {d: s for d, s in self.snapshots.items() if s.expires > now}
        self._timer = None
        if self.snapshots:
            wait = min(s.expires for s in self.snapshots.values()) - now
            self._timer = asyncio.get_running_loop().call_later(max(wait, 0.1), self._expire)


@dataclass(frozen=True)
class Offer:
    """What a donor's probe promised: the state at ``round`` with ``digest``, ``total`` bytes, chunk hashes."""

    peer: str
    round: int
    digest: str
    total: int
    manifest: bytes


class Deadline:
    """The one deadline of a download of a state of at most ``size`` bytes. At first it allows that size at
    ``MIN_RATE`` plus ``floor_s``; as chunks arrive it follows the measured rate (``RATE_SLACK`` times the time
    the rest needs at that rate, plus ``floor_s``), never later than the first bound. A stalled download ends."""

    def __init__(self, floor_s: float, size: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.floor_s, self.clock = floor_s, clock
        self.start = clock()
        self.cap = self.at = self.start + floor_s + size / MIN_RATE
        self._done = 0

    def progress(self, received: int, remaining: int) -> None:
        """``received`` more bytes arrived and ``remaining`` are still to come: follow the measured rate."""
        self._done += received
        now = self.clock()
        rate = self._done / max(now - self.start, 1e-6)
        self.at = min(self.cap, now + self.floor_s + RATE_SLACK * remaining / rate)

    def left(self) -> float:
        return self.at - self.clock()


def state_size_bounds(expected: dict[str, torch.Tensor]) -> tuple[int, int]:
    """The byte sizes a safetensors file of tensors shaped like ``expected`` can have."""
    data = sum(t.numel() * t.element_size() for t in expected.values())
    return data + 8, data + 8 + _HEADER_PER_TENSOR * len(expected)


async def probe(
    transport: Transport,
    header: dict[str, Any],
    peer: str,
    chunk: int,
    bounds: tuple[int, int],
    timeout: float,
    want: str | None = None,
) -> Offer:
    request = {**header, "chunk": chunk} if want is None else {**header, "chunk": chunk, "want": want}
    largest = -(-bounds[1] // chunk) * _HASH  # the manifest of the largest state we can accept
    answer, manifest = await transport.call(peer, "state", request, timeout=timeout, max_reply=largest)
    round_, digest, total = answer.get("round"), answer.get("digest"), answer.get("total")
    if not is_count(round_) or not isinstance(digest, str) or not 0 < len(digest) <= 64:
        raise StateSyncError(f"{peer[-8:]} offered round {round_!r}, digest {digest!r}")
    if not is_count(total) or not bounds[0] <= total <= bounds[1]:
        raise StateSyncError(f"{peer[-8:]} offered {total!r} bytes, not {bounds[0]}..{bounds[1]}")
    if len(manifest) != -(-total // chunk) * _HASH:
        raise StateSyncError(f"{peer[-8:]} sent a manifest of {len(manifest)} bytes for {total} bytes")
    return Offer(peer, round_, digest, total, manifest)


def plan(offers: list[Offer], want_digest: str | None, max_round: int | None) -> list[list[Offer]]:
    """Donor groups to try in turn: offers of one state (round, digest, bytes), the most donors first."""
    groups: dict[tuple[int, str, int, bytes], list[Offer]] = {}
    for o in offers:
        if (max_round is None or o.round <= max_round) and want_digest in (None, o.digest):
            groups.setdefault((o.round, o.digest, o.total, o.manifest), []).append(o)
    return sorted(groups.values(), key=len, reverse=True)  # stable: ties keep the order of the peers given


async def fetch_chunks(
    transport: Transport, header: dict[str, Any], offers: list[Offer], chunk: int, deadline: Deadline
) -> tuple[bytes, Counter[str]]:
    """The bytes of the state all ``offers`` promised, each chunk checked against the manifest on arrival;
    also how many chunks each donor served. Raises ``StateSyncError`` if a chunk is still missing when every
    donor is dropped or the deadline passes."""
    first = offers[0]
    total, count = first.total, len(first.manifest) // _HASH
    data = bytearray(total)
    queue: deque[int] = deque(range(count))  # chunks not fetched yet; a failed one goes back to the front
    strikes: Counter[str] = Counter()  # failed calls in a row, per donor
    served: Counter[str] = Counter()
    in_flight, remaining = 0, total
    changed = asyncio.Event()

    async def get(peer: str, index: int, timeout: float) -> int:
        request = {**header, "chunk": chunk, "digest": first.digest, "index": index}
        answer, body = await transport.call(peer, "state", request, timeout=timeout, max_reply=chunk)
        start = index * chunk
        if answer.get("digest") != first.digest or len(body) != min(chunk, total - start):
            raise BadChunk(f"chunk {index} from {peer[-8:]} is not the one asked for")
        if hashlib.sha256(body).digest() != first.manifest[index * _HASH : (index + 1) * _HASH]:
            raise BadChunk(f"chunk {index} from {peer[-8:]} does not match the manifest")
        data[start : start + len(body)] = body
        return len(body)

    async def worker(peer: str) -> None:
        nonlocal in_flight, remaining
        while strikes[peer] < STRIKES and (left := deadline.left()) > 0:
            if not queue:
                if in_flight == 0:
                    return
                changed.clear()
                await changed.wait()
                continue
            index = queue.popleft()
            in_flight += 1
            try:
                received = await get(peer, index, left)
            except RpcError as exc:
                queue.appendleft(index)
                # Bad bytes, or a state the donor no longer holds, will not get better: drop it at once.
                fatal = isinstance(exc, BadChunk) or getattr(exc, "code", None) == "gone"
                strikes[peer] = STRIKES if fatal else strikes[peer] + 1
                verdict = "dropped" if strikes[peer] >= STRIKES else "one more chance"
                log.info(
                    "state chunk %d from %s failed (%s); %s, another donor takes it", index, peer[-8:], exc, verdict
                )
            else:
                strikes[peer] = 0
                served[peer] += 1
                remaining -= received
                deadline.progress(received, remaining)
            finally:
                in_flight -= 1
                changed.set()

    await asyncio.gather(*(worker(o.peer) for o in offers for _ in range(INFLIGHT)))
    if queue:
        why = "the download's deadline passed" if deadline.left() <= 0 else "every donor failed"
        raise StateSyncError(f"{len(queue)} of {count} chunks could not be fetched: {why}")
    return bytes(data), served


def parse_state(data: bytes, expected: dict[str, torch.Tensor], digest: str) -> dict[str, torch.Tensor]:
    """The tensors in ``data``, if they are named, shaped and typed like ``expected`` and hash to ``digest``."""
    try:
        tensors = load_safetensors(data)
    except Exception as exc:  # safetensors raises assorted errors on malformed input
        raise StateSyncError(f"the state is not a valid safetensors file: {exc!r}") from None
    if set(tensors) != set(expected) or any(
        tensors[k].shape != v.shape or tensors[k].dtype != v.dtype for k, v in expected.items()
    ):
        raise StateSyncError("the state holds other tensors than ours (names, shapes or dtypes)")
    if outer_digest(*(tensors[k] for k in expected)) != digest:
        raise StateSyncError(f"the state does not hash to its digest {digest[:8]}")
    return tensors


async def download_state(
    transport: Transport,
    header: dict[str, Any],
    peers: list[str],
    expected: dict[str, torch.Tensor],
    want_digest: str | None,
    max_round: int | None,
    chunk: int = CHUNK_BYTES,
    timeout: float = 60.0,
) -> tuple[int, str, dict[str, torch.Tensor]] | None:
    """Round, digest and tensors of a state that ``peers`` serve and that verifies, or None.

    ``expected``: our own state tensors (names, shapes, dtypes and size to hold the download to); a donor
    claiming a round beyond ``max_round`` is skipped, so one peer cannot drag our round number forward.
    ``timeout`` bounds each probe and is the floor of the whole download's deadline (``Deadline``).
    """
    bounds = state_size_bounds(expected)
    deadline = Deadline(timeout, bounds[1])  # the largest state we would accept
    for start in range(0, len(peers), MAX_DONORS):
        batch = peers[start : start + MAX_DONORS]
        if (left := deadline.left()) <= 0:
            log.warning("state download: the deadline passed before %d more donors were probed", len(peers) - start)
            return None
        answers = await asyncio.gather(
            *(probe(transport, header, p, chunk, bounds, min(timeout, left), want_digest) for p in batch),
            return_exceptions=True,
        )
        offers = []
        for peer, answer in zip(batch, answers, strict=True):
            if isinstance(answer, RpcError):
                log.info("state from %s: %s", peer[-8:], answer)
            elif isinstance(answer, BaseException):
                raise answer
            else:
                offers.append(answer)
        groups = plan(offers, want_digest, max_round)
        for group in groups:
            donors = [o.peer[-8:] for o in group]
            try:
                data, served = await fetch_chunks(transport, header, group, chunk, deadline)
                tensors = parse_state(data, expected, group[0].digest)
            except StateSyncError as exc:
                log.warning("state %s from %s failed: %s", group[0].digest[:8], donors, exc)
                continue
            log.info(
                "downloaded state %s (round %d, %d bytes) from %s",
                group[0].digest[:8], group[0].round, group[0].total, {p[-8:]: n for p, n in served.items()},
            )  # fmt: skip
            return group[0].round, group[0].digest, tensors
        if offers and not groups:  # they moved on, or were never at that state
            offered = {o.peer[-8:]: f"{o.digest[:8]} (round {o.round})" for o in offers}
            wanted = (want_digest or "any")[:8] + ("" if max_round is None else f" (round {max_round} at most)")
            log.info("state download: no donor offers state %s; they offer %s", wanted, offered)
    return None
