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
4. digest (after the outer step, driven by the averager): members exchange and relay a digest of their new
   state the same way; a member in the minority of that merged view marks itself diverged and resyncs.

Dead peers are noticed by stream errors and by pings while waiting on them, not only by the deadline.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from swarmtrain.averaging.group import Group
from swarmtrain.compression import Codec, CodecError, CodecState
from swarmtrain.net import PeerUnreachable, Rejected, RemoteError, RpcError, RpcTimeout, Transport

log = logging.getLogger(__name__)

PING_INTERVAL = 0.5
# A pseudo-gradient coordinate beyond this is not an update but an attack or a blow-up: reject it, so one
# peer cannot push every replica's theta_g to inf through the outer optimizer.
MAX_ABS_VALUE = 1e4
PING_TIMEOUT = 1.5
PING_FAILURES = 2  # failed pings in a row that declare a peer gone for the round
SMALL_ATTEMPTS = 3  # tries of a report or digest over streams that break (a live peer waits for it otherwise)
RETRY_PAUSE = 0.2
GONE_SEND_S = 3.0  # how long a report or digest to a member counted as gone may take (it is not waited on)


class Liveness:
    """Which group members are known dead this round; pings a peer while someone waits on it."""

    def __init__(self, transport: Transport, header: dict[str, Any]) -> None:
        self.transport = transport
        self.header = header
        self.dead: set[str] = set()
        self._events: dict[str, asyncio.Event] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}

    def event(self, peer: str) -> asyncio.Event:
        return self._events.setdefault(peer, asyncio.Event())

    def mark_dead(self, peer: str, reason: str) -> None:
        if peer not in self.dead and peer != self.transport.peer_id:
            log.info("peer %s is gone this round: %s", peer[-8:], reason)
            self.dead.add(peer)
            self.event(peer).set()

    def watch(self, peer: str) -> asyncio.Event:
        """Start pinging ``peer`` (once) and return the event that fires if it is found dead."""
        if peer != self.transport.peer_id and peer not in self._watchers:
            self._watchers[peer] = asyncio.create_task(self._ping_loop(peer))
        return self.event(peer)

    async def _ping_loop(self, peer: str) -> None:
        # Two failures in a row, of either kind: under load a live peer's stream can break once (an
        # IncompleteReadError), and a peer wrongly declared dead costs the whole group a fallback shard.
        failures = 0
        while peer not in self.dead:
            try:
                await self.transport.call(peer, "ping", self.header, timeout=PING_TIMEOUT)
                failures = 0
            except (PeerUnreachable, RpcTimeout) as exc:
                failures += 1
                if failures >= PING_FAILURES:
                    self.mark_dead(peer, f"ping failed: {exc}")
            except RpcError:
                failures = 0
            await asyncio.sleep(PING_INTERVAL)

    def close(self) -> None:
        for task in self._watchers.values():
            task.cancel()
        self._watchers.clear()  # a later phase (the digest exchange) may watch again


async def wait_or_dead(done: asyncio.Event, dead: asyncio.Event, deadline: float) -> bool:
    """Wait until ``done`` (True) or ``dead`` fires or the loop time reaches ``deadline`` (False)."""
    if done.is_set():
        return True
    timeout = deadline - asyncio.get_running_loop().time()
    if timeout <= 0:
        return False
    waiters = [asyncio.ensure_future(done.wait()), asyncio.ensure_future(dead.wait())]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
    return done.is_set()


def tensor_hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()[:24]


@dataclass
class _Inbox:
    """Parts of one shard arriving from one peer."""

    buffer: torch.Tensor
    parts: set[int] = field(default_factory=set)
    complete: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class AllReduceResult:
    average: torch.Tensor
    applied: list[bool]
    excluded: list[str]
    phases: dict[str, float] = field(default_factory=dict)  # seconds spent in transfer and report

    @property
    def complete(self) -> bool:
        return all(self.applied) and not self.excluded


class GroupExchange(ABC):
    """What every way of averaging a group's updates shares: membership checks, liveness, the report
    exchange that decides which contributions every member applies, and the digest exchange.

    Subclasses move the payloads (``on_parts``/``on_results`` receive streams) and implement ``run``.
    """

    def __init__(
        self,
        group: Group,
        me: str,
        transport: Transport,
        *,
        header: dict[str, Any],
        deadline: float,
        on_part_sent: Callable[[int], None] | None = None,
        tag: str = "",
    ) -> None:
        self.group, self.me, self.transport = group, me, transport
        self.index = group.index(me)
        self.route = group.group_id + tag
        self.header = {**header, "group": self.route}
        self.deadline = deadline
        self._start_clock()
        self.liveness = Liveness(transport, self.header)
        self.closed = False  # after the transfer, late payloads must not be stored
        self.bad_senders: set[str] = set()
        # Reports and digests: what each member sent me itself, and what each relayed of all it held.
        self.reports: dict[str, list[str | None]] = {}
        self.reports_in = {p: asyncio.Event() for p in group.members}
        self.report_relays: dict[str, dict[str, list[str | None]]] = {}
        self.report_relays_in = {p: asyncio.Event() for p in group.members}
        self.view: dict[str, list[str | None]] = {}  # the merged reports the decision is made from
        self.digests: dict[str, str] = {}
        self.digests_in = {p: asyncio.Event() for p in group.members}
        self.digest_relays: dict[str, dict[str, str]] = {}
        self.digest_relays_in = {p: asyncio.Event() for p in group.members}
        self.on_part_sent = on_part_sent
        self.parts_sent = 0
        self._background: set[asyncio.Future[None]] = set()  # sends to members counted as gone

    def _start_clock(self) -> None:
        """Phase deadlines as shares of the time from now to the deadline. ``run`` sets them again when it starts:
        an exchange may be created (and take messages) before, while the round's state exchange still runs."""
        loop_now = asyncio.get_running_loop().time()
        span = max(self.deadline - loop_now, 0.0)
        self.scatter_deadline = loop_now + 0.5 * span
        self.transfer_deadline = loop_now + 0.75 * span
        self.report_deadline = loop_now + 0.82 * span
        self.relay_deadline = loop_now + 0.88 * span

    def _check_member(self, sender: str) -> int:
        if sender not in self.group.members:
            raise Rejected(f"{sender[-8:]} is not a member of group {self.group.group_id}")
        return self.group.index(sender)

    def _part_sent(self) -> None:
        self.parts_sent += 1
        if self.on_part_sent is not None:
            self.on_part_sent(self.parts_sent)

    async def on_parts(self, sender: str, header: dict[str, Any], frames: AsyncIterator[bytes]) -> None:
        raise Rejected("this round takes no parts")

    async def on_results(self, sender: str, header: dict[str, Any], frames: AsyncIterator[bytes]) -> None:
        raise Rejected("this round takes no results")

    @abstractmethod
    async def run(self) -> AllReduceResult:
        """Move the payloads, agree on what is applied, and return the average."""

    def _check_report(self, hashes: Any) -> list[str | None]:
        if not isinstance(hashes, list) or len(hashes) != self.group.size:
            raise Rejected("report must list one hash per member")
        if not all(h is None or (isinstance(h, str) and len(h) <= 64) for h in hashes):
            raise Rejected("report hashes must be short strings or nil")
        return hashes

    @staticmethod
    def _check_digest(digest: Any) -> str:
        if not isinstance(digest, str) or len(digest) > 64:
            raise Rejected("digest must be a short string")
        return digest

    def _check_relay(self, relay: Any, check: Callable[[Any], Any]) -> dict[str, Any]:
        """A relay lists the distinct values once and maps each member to its value's index (``_pack_relay``):
        the reports of a large group are mostly identical, and one header holds at most 64 kB."""
        values, owners = (relay.get("values"), relay.get("from")) if isinstance(relay, dict) else (None, None)
        if not isinstance(values, list) or not isinstance(owners, dict):
            raise Rejected("a relay lists values and maps members to them")
        if not all(p in self.group.members and isinstance(i, int) and 0 <= i < len(values) for p, i in owners.items()):
            raise Rejected("a relay maps members of this group to the values it lists")
        checked = [check(v) for v in values]
        return {peer: checked[i] for peer, i in owners.items()}

    @staticmethod
    def _pack_relay(view: dict[str, Any]) -> dict[str, Any]:
        values: list[Any] = []
        owners = {}
        for peer, value in view.items():
            if value not in values:
                values.append(value)
            owners[peer] = values.index(value)
        return {"values": values, "from": owners}

    def on_report(self, sender: str, header: dict[str, Any]) -> None:
        self._check_member(sender)
        if "relay" in header:
            self.report_relays[sender] = self._check_relay(header["relay"], self._check_report)
            self.report_relays_in[sender].set()
            return
        self.reports[sender] = self._check_report(header.get("hashes"))
        self.reports_in[sender].set()

    def on_digest(self, sender: str, header: dict[str, Any]) -> None:
        self._check_member(sender)
        if "relay" in header:
            self.digest_relays[sender] = self._check_relay(header["relay"], self._check_digest)
            self.digest_relays_in[sender].set()
            return
        self.digests[sender] = self._check_digest(header.get("digest"))
        self.digests_in[sender].set()

    async def _relayed(
        self,
        method: str,
        key: str,
        mine: Any,
        held: dict[str, Any],
        held_in: dict[str, asyncio.Event],
        relays: dict[str, dict[str, Any]],
        relays_in: dict[str, asyncio.Event],
        deadlines: tuple[float, float],
    ) -> dict[str, Any]:
        """Two steps of exchange; returns the merged view every decision of this phase is made from.

        Step 1: send ``mine`` to every member and wait for theirs. Step 2: relay everything I hold (mine and
        what arrived) to every member and wait for their relays. The view is what I relayed plus every relay
        that came in: a value that reached some survivors before its sender died reaches the others through
        them, so every survivor decides from the same view unless a second member dies within the relay step.
        What arrives directly after I relayed is not in my view (it would be in no one else's).
        """
        held[self.me] = mine
        await self._exchange(method, {key: mine}, held_in, deadlines[0])
        view = dict(held)
        await self._exchange(method, {"relay": self._pack_relay(view)}, relays_in, deadlines[1])
        for relay in list(relays.values()):
            for peer, value in relay.items():
                view.setdefault(peer, value)
        return view

    async def _agree(self, hashes: list[str | None]) -> list[bool]:
        """Exchange and relay reports of what I hold (one hash or None per member's slot) and return, per slot,
        whether every report in the merged view holds it with the same hash: only those slots are applied.

        Two members' reports are needed: with mine alone I cannot know what anyone else holds or applies.
        """
        self.view = await self._relayed(
            "report", "hashes", hashes, self.reports, self.reports_in, self.report_relays, self.report_relays_in,
            (self.report_deadline, self.relay_deadline),
        )  # fmt: skip
        reports = list(self.view.values())
        return [
            len(reports) >= 2 and reports[0][j] is not None and all(rep[j] == reports[0][j] for rep in reports)
            for j in range(self.group.size)
        ]

    async def _stream(
        self, peer: str, method: str, header: dict[str, Any], frames: AsyncIterator[bytes], count: int, deadline: float
    ) -> bool:
        """Stream ``count`` frames to ``peer`` on one stream; False if it broke or ran out of time.

        A stream that breaks is not proof of death (under load its answer can be cut after every frame went
        through): the peer is pinged from then on and counted gone only if the pings fail too.
        """
        timeout = deadline - asyncio.get_running_loop().time()
        try:
            await self.transport.call_stream(peer, method, header, frames, count=count, timeout=max(timeout, 0.01))
            return True
        except PeerUnreachable as exc:
            log.info("%s; pinging %s", exc, peer[-8:])
            self.liveness.watch(peer)
        except RpcTimeout as exc:
            self.liveness.mark_dead(peer, str(exc))
        except RemoteError as exc:
            self._refused(peer, exc)
        return False

    async def _exchange(
        self, method: str, payload: dict[str, Any], inbox: dict[str, asyncio.Event], deadline: float
    ) -> None:
        """Send my report or digest to every member and wait for theirs from the members still live.

        Members I count as gone get mine too, without waiting on them: one I gave up on wrongly (a broken
        stream under load) would otherwise wait for it until the deadline, and hold the round's reports in a
        different view than everyone else.
        """
        header = {**self.header, **payload}
        others = [p for p in self.group.members if p != self.me]
        loop = asyncio.get_running_loop()
        sends = {}
        for peer in others:
            gone = peer in self.liveness.dead
            until = min(deadline, loop.time() + GONE_SEND_S) if gone else deadline
            sends[peer] = asyncio.ensure_future(self._send_small(peer, method, header, until))
        for peer in others:
            if peer not in self.liveness.dead:
                await wait_or_dead(inbox[peer], self.liveness.watch(peer), deadline)
        for peer, task in sends.items():  # what I send to members gone by now finishes in the background
            if peer in self.liveness.dead:
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        await asyncio.gather(*(t for t in sends.values() if t not in self._background))

    async def _send_small(self, peer: str, method: str, header: dict[str, Any], deadline: float) -> None:
        """Send a report or digest; a broken stream is retried (the peer would otherwise wait for it until the
        deadline), a peer that still cannot be reached is marked dead."""
        loop = asyncio.get_running_loop()
        for attempt in range(SMALL_ATTEMPTS):
            try:
                await self.transport.call(peer, method, header, timeout=max(deadline - loop.time(), 0.01))
                return
            except PeerUnreachable as exc:
                if attempt + 1 == SMALL_ATTEMPTS or deadline - loop.time() < 2 * RETRY_PAUSE:
                    self.liveness.mark_dead(peer, str(exc))
                    return
                await asyncio.sleep(RETRY_PAUSE)
            except RpcTimeout as exc:
                self.liveness.mark_dead(peer, str(exc))
                return
            except RemoteError as exc:
                self._refused(peer, exc)
                return

    def _refused(self, peer: str, exc: RemoteError) -> None:
        log.warning("%s", exc)
        if exc.code == "no-group":  # it never heard of this group (it gave up joining): do not wait for it
            self.liveness.mark_dead(peer, "not in this group")

    async def exchange_digests(self, digest: str, floor_s: float) -> dict[str, str]:
        """Send and relay my state digest; return the merged view of the group's digests (member -> digest).

        It runs until the exchange's deadline, or ``floor_s`` from now if that is later: a member that reaches it
        late (a long outer step) still has time to be heard instead of marking everyone dead at once.
        """
        loop = asyncio.get_running_loop()
        self.deadline = max(self.deadline, loop.time() + floor_s)
        half = loop.time() + 0.5 * (self.deadline - loop.time())
        try:
            return await self._relayed(
                "digest", "digest", digest, self.digests, self.digests_in, self.digest_relays, self.digest_relays_in,
                (half, self.deadline),
            )  # fmt: skip
        finally:
            self.liveness.close()


def digest_vote(view: dict[str, str]) -> str:
    """The digest most members in ``view`` hold (ties: the smallest)."""
    counts = Counter(view.values())
    best = max(counts.values())
    return min(d for d, c in counts.items() if c == best)


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
    ) -> None:
        super().__init__(group, me, transport, header=header, deadline=deadline, on_part_sent=on_part_sent, tag=tag)
        self.delta = delta
        self.bounds = group.shard_bounds(delta.numel())
        self.codec_up, self.codec_down = codec_up, codec_down
        self.part_numel = max(1, part_numel)
        # Big buffers come from the averager's scratch pool when it has one: fresh multi-MB allocations
        # page-fault on every round, which cost more than the arithmetic on them.
        alloc = scratch or (lambda name, numel: torch.zeros(numel))
        start, end = self.bounds[self.index]
        self.inbox = {p: _Inbox(alloc(f"{tag}inbox{i}", end - start)) for i, p in enumerate(group.members)}
        self.reduced_parts: set[int] = set()
        self.average = alloc(f"{tag}average", delta.numel())  # results land in place: no concatenation
        self.results = [_Inbox(self.average[s:e]) for s, e in self.bounds]
        self.residual = residual  # sender-side error feedback, the full length of ``delta``; kept by the caller
        # What my payloads carry once decoded (the update plus the residual, less what the codec dropped): given
        # back to the residual for every shard the group did not apply, so nothing I contributed is lost.
        self.sent = alloc(f"{tag}sent", delta.numel()) if residual is not None else None
        self.encoded: list[tuple[int, int]] = []  # the ranges of ``sent`` written this round

    # ---- helpers ----------------------------------------------------------------------------------------

    def _parts(self, length: int) -> list[tuple[int, int]]:
        return [(s, min(s + self.part_numel, length)) for s in range(0, max(length, 1), self.part_numel)]

    def _decode(self, codec: Codec, body: bytes, numel: int, what: str) -> torch.Tensor:
        try:
            values = codec.decode(body, numel)
        except CodecError as exc:
            raise Rejected(f"bad {what} payload: {exc}") from None
        if values.numel() != numel:
            raise Rejected(f"bad {what} payload: {values.numel()} values, expected {numel}")
        low, high = torch.aminmax(values) if numel else (torch.tensor(0.0), torch.tensor(0.0))
        if not max(-low.item(), high.item()) <= MAX_ABS_VALUE:  # NaN propagates: one pass checks both
            raise Rejected(f"bad {what} payload: non-finite values or values beyond +-{MAX_ABS_VALUE:g}")
        return values

    def _store(self, box: _Inbox, header: dict[str, Any], body: bytes, codec: Codec, what: str) -> None:
        parts = self._parts(box.buffer.numel())
        part = header.get("part")
        if not isinstance(part, int) or not 0 <= part < len(parts):
            raise Rejected(f"bad {what} index {part!r}")
        if header.get("codec") != codec.name:
            raise Rejected(f"{what} codec {header.get('codec')!r} is not this round's {codec.name!r}")
        start, end = parts[part]
        box.buffer[start:end] = self._decode(codec, body, end - start, what)
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
            self._store(box, header, body, self.codec_up, "part")
        except Rejected as exc:
            # Left out of this round entirely: nobody waits for its parts, results or report any more.
            self.bad_senders.add(sender)
            self.liveness.mark_dead(sender, f"sent a bad payload ({exc})")
            raise

    def on_result(self, sender: str, header: dict[str, Any], body: bytes) -> None:
        j = self._check_member(sender)
        if sender in self.bad_senders or self.closed:
            raise Rejected("this round already excluded you or is over")
        if header.get("shard") != j:
            raise Rejected(f"{sender[-8:]} reduces shard {j}, not {header.get('shard')!r}")
        if header.get("part") in self.results[j].parts:
            raise Rejected("duplicate result part")
        try:
            self._store(self.results[j], header, body, self.codec_down, "result")
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
        if self.group.weights[self.index] == 0:
            return  # an observer (weight 0) receives the average but contributes nothing
        start, end = self.bounds[j]
        parts = self._parts(end - start)
        header = {**self.header, "shard": j, "codec": self.codec_up.name}
        if j == self.index:
            for p, (s, e) in enumerate(parts):
                self._deliver_locally("parts", header, p, self._encode_up(start + s, start + e))
            return

        async def frames() -> AsyncIterator[bytes]:
            for p, (s, e) in enumerate(parts):
                if p:
                    self._part_sent()  # the transport asks for frame p once frame p - 1 is written and drained
                yield self._encode_up(start + s, start + e)
            self._part_sent()

        await self._stream(self.group.members[j], "parts", header, frames(), len(parts), self.scatter_deadline)

    def _encode_up(self, start: int, end: int) -> bytes:
        """Encode ``delta[start:end]`` for its reducer; with error feedback, what a lossy codec drops now is
        added to the same coordinates next round instead of being lost."""
        if self.residual is None:
            return self.codec_up.encode(self.delta[start:end])
        state = CodecState(residual=self.residual[start:end])  # encode rebinds it, never writes into it
        payload = self.codec_up.encode(self.delta[start:end], state)
        assert state.residual is not None and self.sent is not None
        # The codec split delta + residual into what it sends and the new residual.
        torch.sub(self.delta[start:end] + self.residual[start:end], state.residual, out=self.sent[start:end])
        self.residual[start:end] = state.residual
        self.encoded.append((start, end))
        return payload

    async def _reduce_and_broadcast(self) -> None:
        """Reduce my shard part by part, streaming each averaged part as soon as its contributions are in.

        Part p averages the senders whose part p arrived (weighted by tokens); a sender that dies or misbehaves
        mid-shard is left out of the parts not yet reduced. Whatever the mix, every member receives the same
        bytes for part p, so replicas stay identical.
        """
        members, weights = self.group.members, self.group.weights
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
                total = sum(weights[i] for i in included)
                average = torch.zeros(e - s)
                for i in included:
                    average.add_(self.inbox[members[i]].buffer[s:e], alpha=weights[i] / total)
                ready[p] = self.codec_down.encode(average)
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
            hashes = [tensor_hash(r.buffer) if r.complete.is_set() else None for r in self.results]
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

    def _give_back(self, applied: list[bool]) -> None:
        """Return to the residual, once, what I contributed to shards the group did not apply, and the parts of my
        update that were never encoded (a stream that broke first): the next round sends them again.

        Not covered: a part that was sent but left out by a reducer whose shard still applied (it arrived after
        the reduction); the reducer does not report whom it included.
        """
        if self.residual is None or self.sent is None or self.group.weights[self.index] <= 0:
            return
        encoded = torch.zeros(self.delta.numel(), dtype=torch.bool)
        for start, end in self.encoded:
            encoded[start:end] = True
        unsent = ~encoded
        self.residual[unsent] += self.delta[unsent]
        for (start, end), ok in zip(self.bounds, applied, strict=True):
            if not ok:
                mask = encoded[start:end]
                self.residual[start:end][mask] += self.sent[start:end][mask]

    async def _gather(self) -> None:
        for j, peer in enumerate(self.group.members):
            await wait_or_dead(self.results[j].complete, self.liveness.watch(peer), self.transfer_deadline)
