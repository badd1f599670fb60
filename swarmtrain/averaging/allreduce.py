"""One member's side of a group's butterfly all-reduce, with failure handling that keeps replicas identical.

Phases, all bounded by the round's deadline:

1. reduce-scatter: the flat update is cut into one contiguous shard per member; every member streams shard j
   (in parts) to member j, the shard's reducer. A reducer averages the contributions of the senders whose
   every part arrived, weighted by tokens. A sender that dies, stalls or sends a bad payload (wrong size,
   codec, non-finite values) is left out of that shard.
2. all-gather: each reducer encodes its averaged shard once and sends the same bytes to every member, so all
   members that receive shard j hold the identical shard.
3. report: members tell each other which shards they hold (a hash of each), then relay every report they hold
   to every member (``_relayed``), so a report that reached only some survivors before its sender died reaches
   them all. A shard is applied only if every report in that merged view holds it with the same hash; otherwise
   every member applies the same fallback for it (a zero update: theta_g keeps its value there). A dead
   reducer's shard, or one whose reducer had no contribution to average, is thus dropped by all survivors.
   With ``verify`` (``averaging.verify``), a member first checks random parts of other reducers' shards against
   the signed contributions they averaged (``_verify``: replicated reduction) and withholds, in its report, a
   shard that does not add up: every member then falls back on it alike.
4. digest (after the outer step, driven by the averager): members exchange and relay a digest of their new
   state the same way; a member in the minority of that merged view marks itself diverged and resyncs.

Dead peers are noticed by stream errors and by pings while waiting on them, not only by the deadline.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import blake3
import msgpack
import torch

from swarmtrain.averaging.exchange import (
    MAX_ABS_VALUE,
    AllReduceResult,
    GroupExchange,
    Unsettled,
    call_retrying,
    wait_or_dead,
)
from swarmtrain.averaging.group import Group
from swarmtrain.averaging.outer import CHUNK_HASH, chunk_root
from swarmtrain.averaging.robust import Aggregator
from swarmtrain.averaging.signing import MAX_KEY_BYTES, MAX_SIG_BYTES, RoundSigner
from swarmtrain.compression import Codec, CodecError
from swarmtrain.net import PeerUnreachable, Rejected, RemoteError, RpcTimeout, Transport

log = logging.getLogger(__name__)


def _digest(payload: bytes | memoryview) -> bytes:
    return blake3.blake3(payload).digest()


def _gaps(ranges: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """What of ``0:length`` the sorted, disjoint ``ranges`` leave out."""
    gaps, at = [], 0
    for start, end in ranges:
        if start > at:
            gaps.append((at, start))
        at = max(at, end)
    return gaps + ([(at, length)] if at < length else [])


def _overlaps(ranges: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """The parts of ``start:end`` inside the sorted, disjoint ``ranges``."""
    return [(max(s, start), min(e, end)) for s, e in ranges if s < end and e > start]


@dataclass
class _Inbox:
    """Parts of one shard arriving from one peer."""

    buffer: torch.Tensor
    parts: set[int] = field(default_factory=set)
    masks: dict[int, bytes] = field(default_factory=dict)  # results only: per part, the members the reducer included
    # Results only: BLAKE3 over the first ``hashed`` parts' payloads, folded in as they arrive (``_result_hash``),
    # and the payloads of parts that came before a part still missing.
    hasher: Any = field(default_factory=blake3.blake3)
    hashed: int = 0
    unhashed: dict[int, memoryview] = field(default_factory=dict)
    complete: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


class AllReduce(GroupExchange):
    """Dense payloads (fp32 ... 2-bit): a butterfly reduce-scatter and all-gather of shards."""

    def __init__(
        self,
        group: Group,
        me: str,
        delta: torch.Tensor,
        transport: Transport,
        *,
        header: dict[str, Any],
        codec_up: Codec,
        codec_down: Codec,
        part_numel: int,
        deadline: float,
        on_part_sent: Callable[[int], None] | None = None,
        tag: str = "",
        scratch: Callable[[str, int], torch.Tensor] | None = None,
        residual: torch.Tensor | None = None,
        aggregator: Aggregator | None = None,
        signer: RoundSigner | None = None,
        equivocate: bool = False,
        verify: float = 0.0,
        rng: random.Random | None = None,
        alter: Callable[[torch.Tensor], None] | None = None,
        suspects: Collection[str] = (),
        weights: tuple[float, ...] | None = None,
        chunk: int = 0,
        digests: Mapping[str, str] | None = None,
        hashes: bytes = b"",
        moved: torch.Tensor | None = None,
    ) -> None:
        super().__init__(
            group, me, transport, header=header, deadline=deadline, on_part_sent=on_part_sent, tag=tag, signer=signer,
            equivocate=equivocate,
        )  # fmt: skip
        self.delta = delta
        self.weights = group.weights if weights is None else weights  # a mix's: only the states that count
        # A signed gossip round's state exchange: shards and parts are whole chunks of the state digest (``outer``),
        # and a reducer takes a member's part only if its chunks hash to that member's chunk hashes, and those (sent
        # with its parts; ``hashes``: mine) to the digest it joined the group with (``digests``).
        self.chunk, self.digests, self.hashes = chunk, digests or {}, hashes
        self.chunks_of: dict[str, bytes] = {}  # each sender's chunk hashes, checked against its digest
        # With chunks, how far my last outer step moved each (``OuterOptimizer.moved``): each part I send carries
        # the norm of its chunks' (a claim, signed with the part), and a reducer's robust mix counts states about
        # the median claim apart (``Aggregator.floor``). ``steps``: the claims that came with each sender's parts.
        self.moved = moved if chunk else None
        self.steps: dict[tuple[int, int], float] = {}
        self.bounds = group.shard_bounds(delta.numel(), chunk or 1)
        self.codec_up, self.codec_down = codec_up, codec_down
        self.part_numel = max(1, part_numel) if not chunk else max(chunk, part_numel // chunk * chunk)
        # Big buffers come from the averager's scratch pool when it has one: fresh multi-MB allocations
        # page-fault on every round, which cost more than the arithmetic on them.
        alloc = scratch or (lambda name, numel: torch.zeros(numel))
        start, end = self.bounds[self.index]
        self.inbox = {p: _Inbox(alloc(f"{tag}inbox{i}", end - start)) for i, p in enumerate(group.members)}
        self.reduced_parts: set[int] = set()
        self.reduced = alloc(f"{tag}reduced", min(self.part_numel, end - start))  # each part's average, in turn
        self.average = alloc(f"{tag}average", delta.numel())  # results land in place: no concatenation
        self.results = [_Inbox(self.average[s:e]) for s, e in self.bounds]
        self.residual = residual  # sender-side error feedback, the full length of ``delta``; kept by the caller
        # What my payloads carry once decoded (the update plus the residual, less what the codec dropped): given
        # back to the residual for every shard the group did not apply, so nothing I contributed is lost.
        self.sent = alloc(f"{tag}sent", delta.numel()) if residual is not None else None
        self.encoded: list[tuple[int, int]] = []  # the ranges of ``sent`` written this round
        self.aggregator = aggregator or Aggregator()  # how a reducer combines a part's contributions (``robust``)
        # Replicated reduction (``_verify``): with ``verify`` (it needs a signer), every part carries its sender's
        # signature; a reducer keeps the signed parts it averaged (per member index and part) until its report is
        # out, and a member checks ``verify`` parts of other reducers' shards a round on average, chosen by ``rng``
        # (private and unpredictable in a node: a reducer cannot know which of its parts will be checked).
        self.verify = verify if signer is not None else 0.0
        self.rng = rng or random.SystemRandom()
        self.kept: dict[tuple[int, int], list[bytes | memoryview]] = {}
        self.shown: set[tuple[str, int]] = set()  # (checker, part) I showed evidence to: a repeat is a resend
        self.suspects = suspects  # reducers whose shard was withheld lately (``Bans.suspects``): checked every round
        self.released = False  # my round ended and I let go of ``kept``
        self.alter = alter  # tests only (attack.kind = bad-reducer): changes my shard's average before I send it

    # ---- helpers ----------------------------------------------------------------------------------------

    def _parts(self, length: int) -> list[tuple[int, int]]:
        return [(s, min(s + self.part_numel, length)) for s in range(0, max(length, 1), self.part_numel)]

    def _decode(
        self, codec: Codec, body: bytes | memoryview, numel: int, what: str, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The values in a payload (written into ``out`` if given), finite and within ``MAX_ABS_VALUE``."""
        try:
            values = codec.decode(body, numel, out=out, bound=MAX_ABS_VALUE)
        except CodecError as exc:
            raise Rejected(f"bad {what} payload: {exc}") from None
        if values.numel() != numel:
            raise Rejected(f"bad {what} payload: {values.numel()} values, expected {numel}")
        return values

    @property
    def mask_bytes(self) -> int:
        return (self.group.size + 7) // 8

    def _mask(self, included: list[int]) -> bytes:
        """The members (by index) a reducer included in one part: a bit each, sent ahead of the part's payload."""
        bits = sum(1 << i for i in included)
        return bits.to_bytes(self.mask_bytes, "little")

    @staticmethod
    def _included(mask: bytes) -> list[int]:
        """The member indices a part's mask names (``_mask`` the other way)."""
        bits = int.from_bytes(mask, "little")
        return [i for i in range(bits.bit_length()) if bits >> i & 1]

    def _check_mask(self, mask: bytes) -> bytes:
        if len(mask) != self.mask_bytes or int.from_bytes(mask, "little") >> self.group.size:
            raise Rejected("bad result: its mask of included members does not fit the group")
        return mask

    def _result_hash(self, j: int) -> str:
        """What members compare for shard j: the averaged values, as the payloads its reducer sent (which every
        member decodes alike; fp16 payloads are half the bytes of the values), and whom each part included, so that
        members that apply the shard also agree on whose contribution it holds (see ``_give_back``). For a
        complete shard, the hash of its parts' payloads in order and then its masks, the payloads hashed by
        ``on_result`` as they arrived."""
        box = self.results[j]
        hasher = box.hasher.copy()
        hasher.update(b"".join(box.masks[p] for p in sorted(box.masks)))
        return hasher.hexdigest()[:24]

    @staticmethod
    def _hash_arrived(box: _Inbox, part: int, payload: memoryview) -> None:
        """Fold the payload of result part ``part``, just stored, and those held back for it, in order up to the
        first still missing, into the shard's hash: during the transfer, not after it, when every member would
        wait on the hash."""
        box.unhashed[part] = payload
        while box.hashed in box.unhashed:
            box.hasher.update(box.unhashed.pop(box.hashed))
            box.hashed += 1

    def _step(self, start: int, end: int) -> float:
        """My claim for ``start:end`` of the state, whole chunks: the norm of what my last outer step moved there."""
        assert self.moved is not None
        return float(self.moved[start // self.chunk : -(-end // self.chunk)].sum()) ** 0.5

    @staticmethod
    def _claimed(header: dict[str, Any], part: Any) -> float:
        """The step a sender claims for ``part`` (``_step``; 0 where it claims none), or Rejected."""
        steps = header.get("steps")
        if steps is None:
            return 0.0
        if not (isinstance(steps, list) and isinstance(part, int) and 0 <= part < len(steps)):
            raise Rejected(f"bad part: no claimed step for part {part!r}")
        claim = steps[part]
        if not isinstance(claim, float) or not 0 <= claim < float("inf"):
            raise Rejected(f"bad part: its claimed step {claim!r} is not a norm")
        return claim

    def _seal(self, shard: int, part: int, payload: bytes, step: float) -> bytes:
        """A part as it is sent: where the swarm checks reducers (``verify``, a swarm setting), its sender's signature
        of (round, shard, part, payload hash, claimed step) ahead of the payload, so its reducer can show a member
        that checks it what it averaged (``_verify``), and cannot show anything else in a member's name."""
        if self.verify <= 0:
            return payload
        assert self.signer is not None  # ``verify`` is 0 without one
        proof = self.signer.sign(self.route, "part", [shard, part, _digest(payload), step])
        sig, key = proof["sig"], proof["key"]
        return len(sig).to_bytes(2, "little") + sig + len(key).to_bytes(2, "little") + key + payload

    def _unseal(self, sender: str, part: Any, body: bytes, step: float) -> tuple[bytes | memoryview, bytes, bytes]:
        """(payload, signature, key) of a part sent to me; Rejected unless ``sender`` signed it for my shard (where
        the swarm checks reducers). The payload is a view of ``body``, not a copy."""
        if self.verify <= 0:
            return body, b"", b""
        assert self.signer is not None
        n = int.from_bytes(body[:2], "little")
        m = int.from_bytes(body[2 + n : 4 + n], "little")
        sig, key, payload = body[2 : 2 + n], body[4 + n : 4 + n + m], memoryview(body)[4 + n + m :]
        if len(body) < 4 + n + m or n > MAX_SIG_BYTES or m > MAX_KEY_BYTES:
            raise Rejected("bad part: its signature is malformed")
        proof = {"sig": sig, "key": key}
        if not self.signer.check(sender, self.route, "part", [self.index, part, _digest(payload), step], proof):
            raise Rejected("bad part: not signed by its sender")
        return payload, sig, key

    def _store(self, box: _Inbox, header: dict[str, Any], body: bytes | memoryview, codec: Codec, what: str) -> None:
        parts = self._parts(box.buffer.numel())
        part = header.get("part")
        if not isinstance(part, int) or not 0 <= part < len(parts):
            raise Rejected(f"bad {what} index {part!r}")
        if header.get("codec") != codec.name:
            raise Rejected(f"{what} codec {header.get('codec')!r} is not this round's {codec.name!r}")
        start, end = parts[part]
        self._decode(codec, body, end - start, what, out=box.buffer[start:end])  # no use of the part if it fails
        box.parts.add(part)
        box.arrived.set()
        if len(box.parts) == len(parts):
            box.complete.set()

    # ---- handlers (called by the averager's service) ------------------------------------------------------

    def on_part(self, sender: str, header: dict[str, Any], body: bytes) -> None:
        self._check_member(sender)
        box = self.inbox[sender]
        part = header.get("part")
        if self.closed or sender in self.bad_senders or part in box.parts or part in self.reduced_parts:
            raise Rejected("late, duplicate or already excluded contribution")
        try:
            if header.get("shard") != self.index:
                raise Rejected(f"part for shard {header.get('shard')!r} sent to the reducer of shard {self.index}")
            step = self._claimed(header, part)
            payload, sig, key = self._unseal(sender, part, body, step)
            self._store(box, header, payload, self.codec_up, "part")
            if self.chunk:
                self._check_chunk(sender, header.get("hashes"), self.bounds[self.index][0], part, box.buffer)
            self.steps[self.group.index(sender), part] = step
            if self.verify > 0:  # kept for the members that check me
                self.kept[self.group.index(sender), part] = [payload, sig, key, step]
        except Rejected as exc:
            # Left out of this round entirely: nobody waits for its parts, results or report any more.
            self.invalid.setdefault(sender, str(exc))
            self.bad_senders.add(sender)
            self.liveness.mark_dead(sender, f"sent a bad payload ({exc})")
            raise

    def _check_chunk(self, sender: str, hashes: Any, start: int, part: int, values: torch.Tensor) -> None:
        """Rejected unless part ``part`` of ``values`` (a shard starting at ``start``) holds the chunks of
        ``sender``'s state that its chunk hashes name, and those hash to the digest it joined the group with."""
        if sender not in self.chunks_of:
            if not isinstance(hashes, bytes) or chunk_root(hashes) != self.digests.get(sender):
                raise Rejected("bad part: the chunk hashes sent with it are not of the state its sender joined with")
            self.chunks_of[sender] = hashes
        s, e = self._parts(values.numel())[part]
        data, held, size = values.view(torch.uint8).numpy(), self.chunks_of[sender], values.element_size()
        for at in range(s, e, self.chunk):  # a part is whole chunks (the last one of the state may be short)
            index = (start + at) // self.chunk
            chunk = data[at * size : min(at + self.chunk, e) * size]
            if blake3.blake3(chunk).digest(CHUNK_HASH) != held[index * CHUNK_HASH : (index + 1) * CHUNK_HASH]:
                raise Rejected(f"bad part: chunk {index} is not the state its sender joined with")

    def on_result(self, sender: str, header: dict[str, Any], body: bytes) -> None:
        j = self._check_member(sender)
        if sender in self.bad_senders or self.closed:
            raise Rejected("this round already excluded you or is over")
        if header.get("shard") != j:
            raise Rejected(f"{sender[-8:]} reduces shard {j}, not {header.get('shard')!r}")
        if header.get("part") in self.results[j].parts:
            raise Rejected("duplicate result part")
        try:
            view = memoryview(body)  # slices of it, not copies of a multi-MB payload
            mask = self._check_mask(bytes(view[: self.mask_bytes]))
            payload = view[self.mask_bytes :]
            self._store(self.results[j], header, payload, self.codec_down, "result")
            self.results[j].masks[header["part"]] = mask
            self._hash_arrived(self.results[j], header["part"], payload)
        except Rejected as exc:
            self.liveness.mark_dead(sender, f"sent a bad result ({exc})")
            raise

    async def on_parts(self, sender: str, header: dict[str, Any], frames: AsyncIterator[bytes]) -> None:
        """A member streams its contribution to my shard: frame p is part p."""
        part = 0
        async for body in frames:
            self.on_part(sender, {**header, "part": part}, body)
            part += 1

    async def on_results(self, sender: str, header: dict[str, Any], frames: AsyncIterator[bytes]) -> None:
        """A reducer streams its averaged shard: frame p is part p."""
        part = 0
        async for body in frames:
            self.on_result(sender, {**header, "part": part}, body)
            part += 1

    # ---- the protocol -------------------------------------------------------------------------------------

    def _deliver_locally(self, method: str, header: dict[str, Any], part: int, body: bytes) -> None:
        try:
            (self.on_part if method == "parts" else self.on_result)(self.me, {**header, "part": part}, body)
        except Rejected as exc:
            log.error("own %s rejected: %s", method, exc)

    async def _scatter_to(self, j: int) -> None:
        if self.weights[self.index] == 0:
            return  # an observer (weight 0) receives the average but contributes nothing
        start, end = self.bounds[j]
        parts = self._parts(end - start)
        header = {**self.header, "shard": j, "codec": self.codec_up.name}
        if self.chunk:
            header["hashes"] = self.hashes
        steps = [0.0] * len(parts)
        if self.moved is not None:
            steps = header["steps"] = [self._step(start + s, start + e) for s, e in parts]
        if j == self.index:
            for p, (s, e) in enumerate(parts):
                payload = self._encode_up(start + s, start + e)
                self._deliver_locally("parts", header, p, self._seal(j, p, payload, steps[p]))
            return

        async def frames() -> AsyncIterator[bytes]:
            for p, (s, e) in enumerate(parts):
                if p:
                    self._part_sent()  # the transport asks for frame p once frame p - 1 is written and drained
                yield self._seal(j, p, self._encode_up(start + s, start + e), steps[p])
            self._part_sent()

        await self._stream(self.group.members[j], "parts", header, frames(), len(parts), self.scatter_deadline)

    def _encode_up(self, start: int, end: int) -> bytes:
        """Encode ``delta[start:end]`` for its reducer; with error feedback, what a lossy codec drops now is
        added to the same coordinates next round instead of being lost."""
        if self.residual is None:
            return self.codec_up.encode(self.delta[start:end])
        assert self.sent is not None
        # The codec splits delta + residual into what it sends (into ``sent``) and the new residual, in place.
        payload = self.codec_up.encode_feedback(self.delta[start:end], self.residual[start:end], self.sent[start:end])
        self.encoded.append((start, end))
        return payload

    async def _reduce_and_broadcast(self) -> None:
        """Reduce my shard part by part, streaming each averaged part as soon as its contributions are in.

        Part p combines the senders whose part p arrived with the round's aggregator (by default their token-weighted
        mean; see ``robust`` for the norm clip, measured per part); a sender that dies or misbehaves mid-shard is
        left out of the parts not yet reduced. Whatever the mix, every member receives the same
        bytes for part p, so replicas stay identical.
        """
        members = self.group.members
        weights = self.aggregator.cap_weights(self.weights)  # the group's agreed weights: capped alike
        contributors = [p for p, w in zip(members, weights, strict=True) if w > 0]
        start, end = self.bounds[self.index]
        parts = self._parts(end - start)
        ready: list[bytes | None] = [None] * len(parts)
        produced = [asyncio.Event() for _ in parts]
        header = {**self.header, "shard": self.index, "codec": self.codec_down.name}

        async def frames() -> AsyncIterator[bytes]:
            for p in range(len(parts)):
                await produced[p].wait()
                body = ready[p]
                if body is None:
                    return  # the reduction failed: end the stream short, the member treats the shard as missing
                yield body

        others = [m for m in members if m != self.me]
        streams = [
            asyncio.ensure_future(self._stream(m, "results", header, frames(), len(parts), self.transfer_deadline))
            for m in others
        ]
        try:
            for p, (s, e) in enumerate(parts):
                for peer in contributors:
                    box = self.inbox[peer]
                    while p not in box.parts and peer not in self.liveness.dead:
                        box.arrived.clear()
                        if not await wait_or_dead(box.arrived, self.liveness.watch(peer), self.scatter_deadline):
                            break
                self.reduced_parts.add(p)
                included = [i for i, peer in enumerate(members) if peer in contributors and self._usable(peer, p)]
                if not included:
                    # Nothing to average: the shard is missing for everyone (the agreed fallback), never zeros.
                    log.info("shard %d part %d: no contribution arrived; the shard falls back", self.index, p)
                    break
                average = self.reduced[: e - s]  # encoded into a payload of its own before the next part
                rows = [self.inbox[members[i]].buffer[s:e] for i in included]
                steps = [self.steps[i, p] for i in included]
                self.aggregator.reduce(rows, [weights[i] for i in included], average, steps)
                if self.alter is not None:
                    self.alter(average)  # tests only: a hostile reducer
                ready[p] = self._mask(included) + self.codec_down.encode(average)
                produced[p].set()
                self._deliver_locally("results", header, p, ready[p])
        finally:
            for event in produced:
                event.set()
            await asyncio.gather(*streams)

    def _usable(self, peer: str, part: int) -> bool:
        return part in self.inbox[peer].parts and peer not in self.bad_senders

    async def run(self) -> AllReduceResult:
        loop = asyncio.get_running_loop()
        started = loop.time()
        self._start_clock()
        try:
            scatter = [self._scatter_to(j) for j in range(self.group.size)]
            await asyncio.gather(*scatter, self._reduce_and_broadcast(), self._gather())
            self.closed = True
            transferred = loop.time()
            hashes = [self._result_hash(j) if r.complete.is_set() else None for j, r in enumerate(self.results)]
            for j in await self._verify():
                hashes[j] = None  # withheld: no member applies a shard one member could not confirm
            applied = await self._agree(hashes)
            for result, ok in zip(self.results, applied, strict=True):
                if not ok:
                    result.buffer.zero_()  # the same fallback on every member: no update for this shard
            self._give_back(applied)
            average = self.average
            excluded = sorted(self.liveness.dead | self.bad_senders)
            phases = {"transfer_s": transferred - started, "report_s": loop.time() - transferred}
            return AllReduceResult(average, applied, excluded, phases)
        finally:
            self.closed = True
            self.liveness.close()
            self.kept.clear()  # every member checks before its report, and my report is in: no one asks any more
            self.released = True  # a check from now on is refused, not answered with nothing (``on_evidence``)

    # ---- replicated reduction ------------------------------------------------------------------------------

    def on_evidence(self, sender: str, header: dict[str, Any]) -> bytes:
        """The signed contributions I averaged into one part of my shard, as its result mask names them (a msgpack
        list of [member index, payload, signature, key, claimed step]), for a member that checks it (``_verify``)."""
        self._check_member(sender)
        if self.verify <= 0:
            raise Rejected("this member keeps no contributions to be checked (averaging.verify = 0)")
        if self.released:
            # A checker this late (my round ended without its report) would read evidence without contributions as a
            # wrong reduction, and ban me for it.
            raise Rejected("my round is over and what I averaged is no longer kept")
        part, box = header.get("part"), self.results[self.index]
        if header.get("shard") != self.index or not isinstance(part, int) or part not in box.masks:
            raise Rejected(f"no part {part!r} of shard {header.get('shard')!r} reduced here")
        rows = [[i, *self.kept[i, part]] for i in self._included(box.masks[part]) if (i, part) in self.kept]
        evidence = msgpack.packb(rows, use_bin_type=True)
        if (sender, part) in self.shown:  # the checker's stream broke, maybe after my answer: it asks again
            self.resent += len(evidence)
        self.shown.add((sender, part))
        return evidence

    async def _verify(self) -> list[int]:
        """Replicated reduction of random parts, BTARD-style. I check ``verify`` parts a round on average (2.5: two,
        and a third every second round), each of a different reducer's shard, picked at random among the other
        reducers and then among the parts of its shard. For each, I fetch from its reducer the signed contributions
        its result mask names, recompute the part with the group's aggregator and capped weights, and compare it
        with the result I received: the reducer committed to that result before it could know it would be checked.
        Returns the shards I withhold from my report, so that no member applies them: one whose reducer did not
        show its contributions in time, and one whose contributions do not give its result (the reducer is then
        banned, ``invalid``; one that leaves checks unanswered in a few rounds is banned too, ``Bans.strike``). In a
        group of g with h honest members, a reducer that alters all its parts is caught in a round with probability
        1 - (1 - verify / (g - 1)) ** h; one that alters a share a of them, about a times that."""
        if self.verify <= 0:
            return []
        shards = [j for j, box in enumerate(self.results) if j != self.index and box.complete.is_set() and box.masks]
        count = int(self.verify) + (self.rng.random() < self.verify % 1)
        picked = self.rng.sample(shards, min(count, len(shards)))
        # Besides, the shards of reducers whose shard was withheld lately, by my check or another member's report
        # (``Bans.suspects``): one that never answers is banned the round I first meet it, not when I happen to pick
        # it, and again each time it is back from a short ban, until the long one (``Bans.strike``).
        picked += [j for j in shards if j not in picked and self.group.members[j] in self.suspects]
        outcomes = await asyncio.gather(
            *(self._check(j, self.rng.randrange(len(self.results[j].masks))) for j in picked)
        )
        return [j for j, ok in zip(picked, outcomes, strict=True) if not ok]

    async def _check(self, j: int, p: int) -> bool:
        """Check part ``p`` of shard ``j`` (``_verify``): whether I may apply the shard."""
        reducer = self.group.members[j]
        start, end = self._parts(self.results[j].buffer.numel())[p]
        bound = self.group.size * (self.codec_up.payload_size(end - start) + MAX_SIG_BYTES + MAX_KEY_BYTES + 64) + 64
        # A stream that broke is asked again while time is left, as a report is: under load a live reducer's answer
        # was once cut short on loopback, and the one check withheld an honest shard from the whole group
        # (tests/test_swarm.py's four nodes, with one core busy).
        try:
            _, body = await call_retrying(
                self.transport, reducer, "evidence", {**self.header, "shard": j, "part": p},
                0.5 * (self.transfer_deadline + self.report_deadline), max_reply=bound,
            )  # fmt: skip
        except (PeerUnreachable, RpcTimeout, RemoteError) as exc:
            log.info("could not check part %d of shard %d (%s): I withhold the shard", p, j, exc)
            self.checked.append((j, p, "unanswered"))
            return False
        problem = self._check_evidence(j, p, start, end, body)
        self.checked.append((j, p, "ok" if problem is None else "wrong"))
        if problem is None:
            return True
        self.invalid.setdefault(reducer, f"reduced part {p} of shard {j} wrongly: {problem}")
        log.warning("reducer %s reduced part %d of shard %d wrongly: %s; I withhold it", reducer[-8:], p, j, problem)
        return False

    def _check_evidence(self, j: int, p: int, start: int, end: int, body: bytes) -> str | None:
        """Why the contributions a reducer showed do not give the result of part ``p`` (``start:end`` of shard
        ``j``), or None."""
        assert self.signer is not None
        try:
            rows = msgpack.unpackb(body, raw=False)
        except (ValueError, msgpack.UnpackException, TypeError):
            return "its evidence is not msgpack"
        included = self._included(self.results[j].masks[p])
        payloads: dict[int, bytes] = {}
        steps: dict[int, float] = {}
        for row in rows if isinstance(rows, list) else [None]:
            if not (isinstance(row, list) and len(row) == 5 and isinstance(row[0], int) and row[0] in included):
                return "its evidence names members its result does not include"
            i, payload, sig, key, step = row
            if not isinstance(payload, bytes) or i in payloads or not isinstance(step, float):
                return "its evidence repeats a member or holds no payload or step"
            if not self.signer.check(self.group.members[i], self.route, "part", [j, p, _digest(payload), step],
                                     {"sig": sig, "key": key}):  # fmt: skip
                return f"its evidence holds a contribution {self.group.members[i][-8:]} did not sign"
            payloads[i], steps[i] = payload, step
        if sorted(payloads) != included:
            return f"it showed {len(payloads)} of the {len(included)} contributions its result includes"
        try:
            rows = [self._decode(self.codec_up, payloads[i], end - start, "evidence") for i in included]
            for i, row in zip(included, rows, strict=True):
                if self.chunk and (member := self.group.members[i]) in self.chunks_of:
                    self._check_chunk(member, None, self.bounds[j][0] + start, 0, row)
        except Rejected as exc:
            return f"it averaged a payload it should have refused ({exc})"
        weights = self.aggregator.cap_weights(self.weights)
        expected = torch.zeros(end - start)
        self.aggregator.reduce(rows, [weights[i] for i in included], expected, [steps[i] for i in included])
        sent = self.codec_down.decode(self.codec_down.encode(expected), end - start)
        # Another machine may round the same sums differently: allow twice the codec's own error, and 1e-5 of the
        # part's largest value (an fp32 result then matches to its last few bits).
        tolerance = 2 * float((sent - expected).abs().max()) + 1e-5 * float(expected.abs().max()) + 1e-30
        off = float((self.results[j].buffer[start:end] - sent).abs().max())
        if not off <= tolerance:
            return (
                f"its result is {off:.3g} from the average of the contributions it names (tolerance {tolerance:.3g})"
            )
        return None

    def _encoded(self) -> torch.Tensor:
        encoded = torch.zeros(self.delta.numel(), dtype=torch.bool)
        for start, end in self.encoded:
            encoded[start:end] = True
        return encoded

    def _returned(self, applied: list[bool], masks: list[list[int]]) -> list[tuple[int, int]]:
        """The ranges where what I sent goes back into my residual under a decision (``applied`` per shard, and
        per applied shard the members each part included): shards that fell back, and parts that left me out."""
        back = []
        mine = 1 << self.index
        for j, ((start, end), ok) in enumerate(zip(self.bounds, applied, strict=True)):
            if not ok:
                back.append((start, end))
                continue
            for p, (s, e) in enumerate(self._parts(end - start)):
                if p >= len(masks[j]) or not masks[j][p] & mine:
                    back.append((start + s, start + e))
        return back

    @staticmethod
    def _as_mask(ranges: list[tuple[int, int]], encoded: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros_like(encoded)
        for start, end in ranges:
            mask[start:end] = True
        return mask & encoded

    def _masks(self) -> list[list[int]]:
        return [[int.from_bytes(box.masks[p], "little") for p in sorted(box.masks)] for box in self.results]

    def _give_back(self, applied: list[bool]) -> None:
        """Return to the residual, once, what I contributed and the group did not apply: the parts of my update
        that were never encoded (a stream that broke first), what I sent to shards that fell back, and what I sent
        to a part its reducer left out (it arrived after the reduction) while the shard applied. Each reducer
        sends with every part the members it included (``_mask``), and the members' reports agree on it, so
        every member that confirms the round knows the same. The next round sends it all again.
        """
        if self.residual is None or self.sent is None or self.weights[self.index] <= 0:
            return
        # By ranges, not boolean masks: in the usual round (everything encoded and applied) there is nothing to do,
        # and a mask over the whole update cost a pass of its length and an index scan (~40 ms per 10M elements).
        encoded = sorted(self.encoded)
        for start, end in _gaps(encoded, self.delta.numel()):
            self.residual[start:end] += self.delta[start:end]
        for start, end in self._returned(applied, self._masks()):
            for s, e in _overlaps(encoded, start, end):
                self.residual[s:e] += self.sent[s:e]

    def ledger(self) -> dict[str, Any]:
        masks = [[box.masks[p].hex() for p in sorted(box.masks)] if ok else [] for box, ok in zip(
            self.results, self.applied, strict=True)]  # fmt: skip
        return {"applied": list(self.applied), "masks": masks}

    def unsettled(self, round_: int) -> Unsettled | None:
        if self.residual is None or self.sent is None or self.weights[self.index] <= 0:
            return None
        encoded = self._encoded()
        sent = torch.where(encoded, self.sent, 0.0)  # ``sent`` is a scratch buffer the next round reuses

        def returned(ledger: Any) -> torch.Tensor | None:
            applied = self._check_applied(ledger)
            masks = ledger.get("masks") if applied is not None else None
            if applied is None or not isinstance(masks, list) or len(masks) != self.group.size:
                return None
            parsed = []
            for (start, end), ok, shard in zip(self.bounds, applied, masks, strict=True):
                wanted = len(self._parts(end - start)) if ok else 0
                if not isinstance(shard, list) or len(shard) != wanted:
                    return None
                try:
                    parsed.append([int.from_bytes(self._check_mask(bytes.fromhex(m)), "little") for m in shard])
                except (TypeError, ValueError, Rejected):
                    return None
            return self._as_mask(self._returned(applied, parsed), encoded)

        given_back = self._as_mask(self._returned(self.applied, self._masks()), encoded)
        return Unsettled(round_, self.group, sent, given_back, returned)

    async def _gather(self) -> None:
        for j, peer in enumerate(self.group.members):
            await self.wait_on(self.results[j].complete, peer, self.transfer_deadline)
