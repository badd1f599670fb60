"""Averaging sparse and low-rank payloads (top-k, DCT top-k, PowerSGD): every contributor sends its whole payload to
every member, and every member decodes the same payloads in the same order.

Two peers' top-k payloads keep different indices and two PowerSGD payloads span different subspaces, so they cannot
be summed elementwise in a reduce-scatter; a reducer that decoded, averaged and re-compressed them would drop
most of the average on the way back, with no one to carry the loss to the next round. Here nothing is
re-compressed: each sender's error feedback is the only loss, and it is delivered in later rounds (SparseLoCo's
scheme). A node sends ``n - 1`` copies of a payload that is 100x smaller than fp32, against about ``2 (n - 1) / n``
dense payloads in the butterfly.

Phases, all bounded by the round's deadline:

1. exchange: every contributor (weight > 0) encodes its update once, segment by segment (``plan_segments``), and
   streams the same frames to every other member. A receiver checks each frame's header and exact length against
   the segment as it arrives; a sender with a malformed frame is left out.
2. report: members tell each other which contributions they hold (a hash of each) and relay the reports they hold
   (see ``allreduce``). A contribution is applied only if every report in that merged view holds it with the same
   hash, and the view holds more than the contributor's own report.
   A sender whose payload was not applied adds it back to its error-feedback residual: nothing is lost.
3. reduce: every member decodes the agreed contributions in member order, scales each by its token weight, sums and
   divides by the total weight. The same bytes and the same elementwise operations give bit-identical averages.
   A robust aggregator (``averaging.aggregator``, see ``robust``) instead decodes every agreed contribution whole
   (memory: one copy of the update per contributor) and combines them segment by segment, the norm clip measured
   per segment.
   A contribution whose payload decodes to non-finite or huge values is dropped by everyone alike.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import blake3
import torch

from swarmtrain.averaging.exchange import MAX_ABS_VALUE, AllReduceResult, GroupExchange, Unsettled
from swarmtrain.averaging.group import Group
from swarmtrain.averaging.robust import Aggregator
from swarmtrain.averaging.signing import RoundSigner
from swarmtrain.compression import BaseCodec, CodecError, CodecState, get_codec, peek_header
from swarmtrain.net import Rejected, Transport

OBSERVER = "observer"  # the report entry of a member that contributes nothing (weight 0): nothing to agree on


@dataclass(frozen=True)
class Segment:
    """A slice ``[start, end)`` of the flat update and the codec its payload uses."""

    start: int
    end: int
    codec: BaseCodec

    @property
    def numel(self) -> int:
        return self.end - self.start


def plan_segments(
    codec: BaseCodec, numel: int, shapes: Sequence[tuple[int, ...]] | None, part_numel: int
) -> list[Segment]:
    """How a flat update of ``numel`` elements is cut into payloads; every member computes the same plan.

    PowerSGD with the model's parameter ``shapes`` (in flat order) gets one payload per weight matrix, viewed as
    ``shape[0] x prod(shape[1:])`` so that the low-rank structure is the layer's own; the vectors between matrices
    (biases, norms) are too small to factor and go together as one fp16 payload. Every other case is cut into
    chunks of ``part_numel`` elements.
    """
    if shapes is not None and codec.name == "powersgd":
        if sum(math.prod(s) for s in shapes) != numel:
            raise ValueError(f"parameter shapes hold {sum(math.prod(s) for s in shapes)} elements, not {numel}")
        segments: list[Segment] = []
        start, vectors = 0, None  # ``vectors``: where the current run of non-matrix tensors began
        for shape in shapes:
            size = math.prod(shape)
            rows = shape[0] if shape else 1
            if len(shape) >= 2 and min(rows, size // rows) > 1:
                if vectors is not None:
                    segments.append(Segment(vectors, start, get_codec("fp16")))
                    vectors = None
                matrix = get_codec(f"{codec.spec},shape={rows}x{size // rows}")
                segments.append(Segment(start, start + size, matrix))
            elif vectors is None:
                vectors = start
            start += size
        if vectors is not None:
            segments.append(Segment(vectors, start, get_codec("fp16")))
        return segments
    step = max(1, part_numel)
    return [Segment(s, min(s + step, numel), codec) for s in range(0, max(numel, 1), step)]


class AllGather(GroupExchange):
    def __init__(
        self,
        group: Group,
        me: str,
        delta: torch.Tensor,
        transport: Transport,
        *,
        header: dict[str, Any],
        segments: list[Segment],
        deadline: float,
        states: list[CodecState] | None = None,
        residual: torch.Tensor | None = None,
        on_part_sent: Callable[[int], None] | None = None,
        tag: str = "",
        scratch: Callable[[str, int], torch.Tensor] | None = None,
        aggregator: Aggregator | None = None,
        signer: RoundSigner | None = None,
        equivocate: bool = False,
    ) -> None:
        super().__init__(
            group, me, transport, header=header, deadline=deadline, on_part_sent=on_part_sent, tag=tag, signer=signer,
            equivocate=equivocate,
        )  # fmt: skip
        self.delta = delta
        self.segments = segments
        self.states = states  # one per segment, kept by the caller across rounds (residual views, warm Q)
        self.residual = residual  # the full-length residual the states' residuals are views of
        alloc = scratch or (lambda name, n: torch.zeros(n))
        self.average = alloc(f"{tag}average", delta.numel())
        self.decoded = alloc(f"{tag}decoded", delta.numel())
        self.payloads: dict[str, list[bytes]] = {p: [] for p in group.members}
        self.complete = {p: asyncio.Event() for p in group.members}
        self.aggregator = aggregator or Aggregator()  # how the agreed contributions combine (``robust``)

    def _contributes(self, peer: str) -> bool:
        return self.group.weights[self.group.index(peer)] > 0

    # ---- receiving ----------------------------------------------------------------------------------------

    async def on_results(self, sender: str, header: dict[str, Any], frames: AsyncIterator[bytes]) -> None:
        """A contributor streams its payload: frame s is segment s."""
        self._check_member(sender)
        if not self._contributes(sender):
            raise Rejected("an observer (weight 0) has nothing to contribute")
        received = self.payloads[sender]
        if received or self.closed or sender in self.bad_senders:
            raise Rejected("late, duplicate or already excluded contribution")
        try:
            async for frame in frames:
                if self.closed:
                    raise Rejected("the exchange is over")
                try:
                    self._check_frame(len(received), frame)
                except Rejected as exc:
                    self.invalid.setdefault(sender, str(exc))
                    raise
                received.append(frame)
        except Rejected as exc:
            received.clear()
            self.bad_senders.add(sender)
            self.liveness.mark_dead(sender, f"sent a bad payload ({exc})")
            raise
        if len(received) == len(self.segments):
            self.complete[sender].set()

    def _check_frame(self, index: int, frame: bytes) -> None:
        """Header and exact length of frame ``index`` against its segment, before keeping any of it."""
        if index >= len(self.segments):
            raise Rejected(f"more than the {len(self.segments)} segments of this round's schema")
        segment = self.segments[index]
        try:
            header = peek_header(frame)
        except CodecError as exc:
            raise Rejected(f"segment {index}: {exc}") from None
        expected = segment.codec.payload_size(segment.numel)
        if header.codec_id != segment.codec.codec_id or header.numel != segment.numel or len(frame) != expected:
            raise Rejected(
                f"segment {index} is {header.codec} of {header.numel} elements in {len(frame)} bytes; this round "
                f"expects {segment.codec.name} of {segment.numel} elements in {expected} bytes"
            )

    # ---- sending ------------------------------------------------------------------------------------------

    def _encode_mine(self) -> list[bytes]:
        """My payload, one frame per segment; with error feedback the residuals carry what the codecs dropped."""
        frames = []
        for i, seg in enumerate(self.segments):
            piece = self.delta[seg.start : seg.end]
            if self.states is None or self.residual is None:
                frames.append(seg.codec.encode(piece))
                continue
            state = self.states[i]
            state.residual = self.residual[seg.start : seg.end]
            frames.append(seg.codec.encode(piece, state))  # rebinds state.residual to the new residual
            self.residual[seg.start : seg.end] = state.residual
            state.residual = self.residual[seg.start : seg.end]
        return frames

    def unsettled(self, round_: int) -> Unsettled | None:
        if not self._contributes(self.me) or self.residual is None or not self.payloads[self.me]:
            return None
        sent = torch.zeros_like(self.decoded)
        if not self._decode_into(sent, self.payloads[self.me]):
            return None

        def returned(ledger: Any) -> torch.Tensor | None:
            applied = self._check_applied(ledger)
            return None if applied is None else torch.full_like(sent, not applied[self.index], dtype=torch.bool)

        given_back = torch.full_like(sent, not self.applied[self.index], dtype=torch.bool)
        return Unsettled(round_, self.group, sent, given_back, returned)

    async def _send_to(self, peer: str, frames: list[bytes]) -> None:
        async def stream() -> AsyncIterator[bytes]:
            for i, frame in enumerate(frames):
                if i:
                    self._part_sent()  # frame i is asked for once frame i - 1 is written
                yield frame
            self._part_sent()

        await self._stream(peer, "results", self.header, stream(), len(frames), self.transfer_deadline)

    # ---- the protocol -------------------------------------------------------------------------------------

    async def run(self) -> AllReduceResult:
        loop = asyncio.get_running_loop()
        started = loop.time()
        self._start_clock()
        members = self.group.members
        try:
            sends = []
            if self._contributes(self.me):
                mine = self._encode_mine()
                self.payloads[self.me] = mine
                self.complete[self.me].set()
                sends = [self._send_to(p, mine) for p in members if p != self.me]
            waits = [
                self.wait_on(self.complete[p], p, self.transfer_deadline)
                for p in members
                if p != self.me and self._contributes(p)
            ]
            await asyncio.gather(*sends, *waits)
            self.closed = True
            transferred = loop.time()
            hashes = [self._hash(p) for p in members]
            applied = await self._agree(hashes)
            self._reduce(applied)
            if self._contributes(self.me) and not applied[self.index] and self.residual is not None:
                # My payload was left out: keep what it carried for the next round instead of losing it.
                if self._decode_into(self.decoded, self.payloads[self.me]):
                    self.residual.add_(self.decoded)
            excluded = sorted(self.liveness.dead | self.bad_senders)
            phases = {"transfer_s": transferred - started, "report_s": loop.time() - transferred}
            return AllReduceResult(self.average, applied, excluded, phases)
        finally:
            self.closed = True
            self.liveness.close()

    def _hash(self, peer: str) -> str | None:
        if not self._contributes(peer):
            return OBSERVER
        if not self.complete[peer].is_set() or peer in self.bad_senders:
            return None
        digest = blake3.blake3()
        for frame in self.payloads[peer]:
            digest.update(frame)
        return digest.hexdigest()[:24]

    def _reduce(self, applied: list[bool]) -> None:
        """The combination of the agreed contributions, in member order; ``applied`` is updated for contributions
        that fail to decode (every member fails them alike)."""
        weights = self.aggregator.cap_weights(self.group.weights)
        if not self.aggregator.plain:
            self._reduce_robust(applied, weights)
            return
        self.average.zero_()
        total = 0.0
        for j, peer in enumerate(self.group.members):
            weight = weights[j]
            if not applied[j] or weight <= 0:
                continue
            if not self._decode_into(self.decoded, self.payloads[peer]):
                self._refuse(j, peer, applied)
                continue
            # Scale then add (no fused multiply-add), so every CPU rounds the same way.
            self.average.add_(self.decoded.mul_(weight))
            total += weight
        if total > 0:
            self.average.div_(total)

    def _reduce_robust(self, applied: list[bool], weights: list[float]) -> None:
        rows: list[torch.Tensor] = []
        used: list[float] = []
        for j, peer in enumerate(self.group.members):
            if not applied[j] or weights[j] <= 0:
                continue
            row = torch.empty(self.delta.numel())
            if not self._decode_into(row, self.payloads[peer]):
                self._refuse(j, peer, applied)
                continue
            rows.append(row)
            used.append(weights[j])
        if not rows:
            self.average.zero_()
            return
        for seg in self.segments:
            self.aggregator.reduce([r[seg.start : seg.end] for r in rows], used, self.average[seg.start : seg.end])

    def _refuse(self, j: int, peer: str, applied: list[bool]) -> None:
        applied[j] = False  # every member fails the same bytes alike
        self.invalid.setdefault(peer, "a payload that decodes to non-finite or out-of-bound values")

    def _decode_into(self, out: torch.Tensor, frames: list[bytes]) -> bool:
        for seg, frame in zip(self.segments, frames, strict=True):
            try:
                values = seg.codec.decode(frame, seg.numel)
            except CodecError:
                return False
            if seg.numel:
                low, high = torch.aminmax(values)
                if not max(-low.item(), high.item()) <= MAX_ABS_VALUE:
                    return False
            out[seg.start : seg.end] = values
        return True
