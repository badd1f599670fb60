"""What every way of averaging a group's updates shares: who is alive this round, and the report and digest
exchanges, relayed once, from whose merged view every member makes the same decisions (see ``allreduce`` for the
dense butterfly and ``allgather`` for sparse payloads)."""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from swarmtrain.averaging.group import Group
from swarmtrain.averaging.signing import MAX_KEY_BYTES, MAX_SIG_BYTES, RoundSigner
from swarmtrain.net import PeerUnreachable, Rejected, RemoteError, RpcError, RpcTimeout, Transport

log = logging.getLogger(__name__)

PING_INTERVAL = 0.5
# A pseudo-gradient coordinate beyond this is not an update but an attack or a blow-up: reject it, so one
# peer cannot push every replica's theta_g to inf through the outer optimizer.
MAX_ABS_VALUE = 1e4
PING_TIMEOUT = 1.5
PING_FAILURES = 2  # failed pings in a row that declare a peer gone for the round
SMALL_ATTEMPTS = 3  # tries of a report, digest or reducer check over streams that break (``call_retrying``)
RETRY_PAUSE = 0.2
GONE_SEND_S = 3.0  # how long a report or digest to a member counted as gone may take (it is not waited on)


async def call_retrying(
    transport: Transport, peer: str, method: str, header: dict[str, Any], deadline: float, **kwargs: Any
) -> tuple[dict[str, Any], bytes]:
    """``transport.call`` with a stream that broke (``PeerUnreachable``) asked again while time is left before
    ``deadline`` (loop time), ``SMALL_ATTEMPTS`` tries at most, sooner as the deadline nears: under load a live
    peer's stream can break once (an IncompleteReadError). The last failure, or any other, is raised."""
    loop = asyncio.get_running_loop()
    tries = 1
    while True:
        try:
            return await transport.call(peer, method, header, timeout=max(deadline - loop.time(), 0.01), **kwargs)
        except PeerUnreachable:
            left = deadline - loop.time()
            if tries == SMALL_ATTEMPTS or left <= 0.01:
                raise
            tries += 1
            await asyncio.sleep(min(RETRY_PAUSE, left / SMALL_ATTEMPTS))


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
        # The first ping waits an interval: most waits end sooner (a report, a digest, the next part), and each
        # ping is a stream opened and served at both ends, which on a loaded CPU delays the round it checks.
        failures = 0
        await asyncio.sleep(PING_INTERVAL)
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
    if timeout <= 0 or dead.is_set():
        return False
    waiters = [asyncio.ensure_future(done.wait()), asyncio.ensure_future(dead.wait())]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
    return done.is_set()


@dataclass
class Unsettled:
    """What a member that could not confirm its round sent, and what of it went back into its residual on its own
    view of the round's decision, until the decision of the members that did confirm it is known (``reconcile``)."""

    round: int
    group: Group
    sent: torch.Tensor  # what my payloads carried (zeros where nothing was sent)
    given_back: torch.Tensor  # bool: where ``sent`` went back into my residual
    returned: Callable[[Any], torch.Tensor | None]  # the same mask under a ledger (None: malformed)


@dataclass
class Values:
    """One kind of value the members exchange and relay (reports or digests): what each member sent me itself, with
    its signature when the group signs, and what each member relayed of all it held."""

    held: dict[str, Any]
    held_in: dict[str, asyncio.Event]
    proofs: dict[str, Any]
    relays: dict[str, dict[str, Any]]
    relays_in: dict[str, asyncio.Event]
    # Whether another member's relay, by the relay deadline, held my own value: it reached someone else in time
    # (``_relayed``).
    echoed: bool = False

    @classmethod
    def of(cls, members: tuple[str, ...]) -> Values:
        return cls({}, {p: asyncio.Event() for p in members}, {}, {}, {p: asyncio.Event() for p in members})


@dataclass
class AllReduceResult:
    average: torch.Tensor
    applied: list[bool]
    excluded: list[str]
    phases: dict[str, float] = field(default_factory=dict)  # seconds spent in transfer and report

    @property
    def complete(self) -> bool:
        return all(self.applied) and not self.excluded


def withholders(view: Mapping[str, list[str | None]], members: Sequence[str]) -> dict[str, list[int]]:
    """The members whose report, in a round's merged view of reports (``GroupExchange.view``), alone withheld the
    shards of two or more other reducers: per member, the slots it held no hash for (or another) where more than
    half of the view's reports (two at least) hold one hash. Every member that decided from this view finds the same
    ones (``Bans.withholder``).

    One member's report that withheld every other shard made its group fall back on all of them, every round, and no
    one could tell a false withholding from a check that really failed. One hostile reducer makes honest members'
    checks fail, or sends them other bytes, for its own shard alone; two shards withheld by one member that most of
    the group held are that member's doing (or its own link's), and it is left out for a while. All-gathered
    (``AllGather``), a slot is a member's payload rather than a reducer's shard; the rule is the same."""
    reports = list(view.values())
    most: list[str | None] = []  # per slot, the hash more than half of the reports hold, if any
    for j in range(len(members)):
        top = Counter(report[j] for report in reports if report[j] is not None).most_common(1)
        most.append(top[0][0] if top and 2 * top[0][1] > len(reports) else None)
    found = {}
    for member, held in view.items():
        slots = [j for j, h in enumerate(most) if h not in (None, held[j]) and members[j] != member]
        if len(slots) >= 2:
            found[member] = slots
    return found


def disputes(
    view: Mapping[str, list[str | None]], members: Sequence[str], lone: Collection[str]
) -> dict[str, set[str]]:
    """Per reducer whose shard some reports in ``view`` held no hash for while others held it: the members whose
    reports withheld it (``Bans.dispute``). A withholder's report (``lone``: ``withholders``) disputes nothing: it is
    banned instead, and would have every shard checked every round."""
    reports = {peer: report for peer, report in view.items() if peer not in lone}
    withheld = {m: {peer for peer, report in reports.items() if report[j] is None} for j, m in enumerate(members)}
    return {m: peers for m, peers in withheld.items() if 0 < len(peers) < len(reports)}


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
        signer: RoundSigner | None = None,
        equivocate: bool = False,
    ) -> None:
        self.group, self.me, self.transport = group, me, transport
        self.index = group.index(me)
        self.route = group.group_id + tag
        self.header = {**header, "group": self.route}
        self.deadline = deadline
        # When the phases start, the same instant for every member (``_start_clock``): when the group's exchange
        # began (a member that learned of its group late counts from when the others began), and a mixed round's
        # update at the state exchange's deadline (``Averager._open_exchange``). None: from now.
        self.opens: float | None = None
        self._start_clock()
        self.liveness = Liveness(transport, self.header)
        self.closed = False  # after the transfer, late payloads must not be stored
        self.bad_senders: set[str] = set()
        self.invalid: dict[str, str] = {}  # senders of messages refused on their merits, and why (``bans``)
        # Reports and digests, signed by their members when ``signer`` is set (``signing``); a member caught
        # signing two values of one kind is left out of the view and banned (``equivocators``: who, and why).
        self.signer = signer
        self.equivocate = equivocate  # tests only (attack.kind = equivocate): tell half the group other values
        self.withhold = False  # tests only (attack.kind = withhold): report no other reducer's shard as held
        self.values = {kind: Values.of(group.members) for kind in ("report", "digest")}
        self.equivocators: dict[str, str] = {}
        self.checked: list[tuple[int, int, str]] = []  # replicated reduction: (shard, part, ok | wrong | unanswered)
        # Bytes I sent again because a member asked again after its stream broke (a reducer's evidence): the round
        # cost them, but not as its protocol does (``bytes_resent`` in metrics.jsonl).
        self.resent = 0
        self.view: dict[str, list[str | None]] = {}  # the merged reports the decision is made from
        self.applied = [False] * group.size  # the decision, per slot, once ``_agree`` made it
        self.on_part_sent = on_part_sent
        self.parts_sent = 0
        self._background: set[asyncio.Future[None]] = set()  # sends to members counted as gone

    def _start_clock(self) -> None:
        """Phase deadlines as shares of the time from ``opens`` (or now, if unset) to the deadline. ``run`` sets them
        again when it starts: an exchange may be created (and take messages) before, while the round's state
        exchange still runs. Members leave that exchange at different times (one that waited on a member that
        stalled, at its deadline), and one may learn of its group late: shares of the time from when each started
        would give them different report deadlines, and one would decide before another's report was due."""
        loop_now = asyncio.get_running_loop().time() if self.opens is None else self.opens
        span = max(self.deadline - loop_now, 0.0)
        self.scatter_deadline = loop_now + 0.5 * span
        self.transfer_deadline = loop_now + 0.75 * span
        self.report_deadline = loop_now + 0.82 * span
        self.relay_deadline = loop_now + 0.88 * span
        self.proof_deadline = loop_now + 0.91 * span  # signed groups: relayed values that differ, proven

    async def wait_on(self, done: asyncio.Event, peer: str, deadline: float) -> bool:
        """Wait until ``done``, ``peer`` is found gone or the deadline; ``peer`` is pinged only while I wait on it
        (a member whose message is already here costs no pings)."""
        if done.is_set():
            return True
        return await wait_or_dead(done, self.liveness.watch(peer), deadline)

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

    def on_evidence(self, sender: str, header: dict[str, Any]) -> bytes:
        raise Rejected("this round has no reducers to check")

    def ledger(self) -> dict[str, Any]:
        """The round's decision as this member applied it: served to members that could not confirm the round,
        so that what they contributed goes back into their residuals exactly once (``Unsettled``)."""
        return {"applied": list(self.applied)}

    def unsettled(self, round_: int) -> Unsettled | None:
        """What this member would have to set right once the group's decision is known; None if nothing."""
        return None

    def _check_applied(self, ledger: Any) -> list[bool] | None:
        applied = ledger.get("applied") if isinstance(ledger, dict) else None
        if not isinstance(applied, list) or len(applied) != self.group.size:
            return None
        return applied if all(isinstance(a, bool) for a in applied) else None

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
        the reports of a large group are mostly identical, and one header holds at most 64 kB. It carries no
        signatures: a member asks the relayer for them only where the relay differs from what it holds
        (``_merge``), so an honest round costs one signature per message, not one per member per relay."""
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
        self._on_value("report", "hashes", self._check_report, sender, header)

    def on_digest(self, sender: str, header: dict[str, Any]) -> None:
        self._on_value("digest", "digest", self._check_digest, sender, header)

    def on_proofs(self, sender: str, header: dict[str, Any]) -> bytes:
        """The values I hold directly from the members asked for, with their signatures (a msgpack body: a large
        group's would not fit a header): a member whose relay from me differs from what it holds asks me to prove
        it (``_merge``)."""
        self._check_member(sender)
        kind, members = header.get("kind"), header.get("members")
        if kind not in self.values or not isinstance(members, list) or len(members) > self.group.size:
            raise Rejected("a proof request names a kind and at most the group's members")
        values = self.values[kind]
        held = {p: [values.held[p], values.proofs[p]] for p in members if isinstance(p, str) and p in values.held}
        return msgpack.packb(held, use_bin_type=True)

    def _proofs_bound(self, members: int) -> int:
        """The most bytes a proof answer for ``members`` can legitimately take: a report (a hash per member) and a
        signature with its key per member."""
        return members * (self.group.size * 70 + MAX_SIG_BYTES + MAX_KEY_BYTES + 64) + 64

    def _on_value(self, kind: str, key: str, check: Callable[[Any], Any], sender: str, header: dict[str, Any]) -> None:
        """A member's own value, or its relay of all it held. A member's first value stands: a second, different
        one it signed is proof that it equivocated (it is banned), but only what every survivor sees through the
        relays may change the view."""
        self._check_member(sender)
        values = self.values[kind]
        try:
            if "relay" in header:
                values.relays[sender] = self._check_relay(header["relay"], check)
                values.relays_in[sender].set()
                return
            value, proof = check(header.get(key)), header.get("proof")
            if self.signer is not None and not self.signer.check(sender, self.route, kind, value, proof):
                raise Rejected(f"a {kind} without a valid signature of its sender")
        except Rejected as exc:
            self.invalid.setdefault(sender, str(exc))
            raise
        if sender in values.held:
            if values.held[sender] != value and self.signer is not None:
                self.equivocators.setdefault(sender, f"signed two different {kind}s in one round")
            return
        values.held[sender], values.proofs[sender] = value, proof
        values.held_in[sender].set()

    def _sign(self, kind: str, key: str, value: Any) -> dict[str, Any]:
        if self.signer is None:
            return {key: value}
        proof: dict[str, Any] = self.signer.sign(self.route, kind, value)
        if kind == "digest" and isinstance(value, str):  # the state I hold, a certificate for others (``signing``)
            proof["held"] = self.signer.sign_held(self.group.round, value)
        return {key: value, "proof": proof}

    def certificate(self, digest: str) -> dict[str, Any] | None:
        """Another member's signed statement that it held ``digest`` at the end of this round, from the digests it
        sent me itself (None if none did, or the group is unsigned): what makes my state count in a later mix."""
        values = self.values.get("digest")
        if values is None or self.signer is None:
            return None
        for peer, held in values.held.items():
            proof = values.proofs.get(peer)
            if peer == self.me or held != digest or not isinstance(proof, dict):
                continue
            cert = {"round": self.group.round, "key": proof.get("key"), "sig": proof.get("held")}
            if self.signer.check_held(self.me, digest, self.group.round + 1, cert) is None:
                return cert
        return None

    @staticmethod
    def _twist(value: Any) -> Any:
        """Another value of the same shape (attack.kind = equivocate): each hash or digest turned into zeros."""
        if isinstance(value, list):
            return [h if h is None else GroupExchange._twist(h) for h in value]
        return "0" * len(value) if value != "0" * len(value) else "1" * len(value)

    async def _relayed(self, kind: str, key: str, mine: Any, deadlines: tuple[float, float, float]) -> dict[str, Any]:
        """Two steps of exchange; returns the merged view every decision of this phase is made from.

        Step 1: send ``mine`` to every member and wait for theirs. Step 2: relay everything I hold (mine and
        what arrived) to every member and wait for their relays. The view is what I relayed plus every relay
        that came in: a value that reached some survivors before its sender died reaches the others through
        them, so every survivor decides from the same view unless a second member dies within the relay step.
        What arrives directly after I relayed is not in my view (it would be in no one else's). Nor is a member's
        value that only its own relay carries: a member that stalled through step 1 (its value reached no one in
        time) may wake up and relay it to some survivors before they decide and not to others; a value that
        reached anyone else in step 1 comes to every survivor in that one's relay. In a signed group, step 3 (until
        the third deadline) asks relayers to prove values that differ from mine (``_merge``).
        """
        values = self.values[kind]
        payload = self._sign(kind, key, mine)
        values.held[self.me], values.proofs[self.me] = mine, payload.get("proof")
        twisted = self._sign(kind, key, self._twist(mine)) if self.equivocate else None
        await self._exchange(kind, payload, values.held_in, deadlines[0], twisted)
        view = dict(values.held)
        await self._exchange(kind, {"relay": self._pack_relay(view)}, values.relays_in, deadlines[1])
        relays = {sender: dict(relay) for sender, relay in values.relays.items()}  # what came by the deadline
        values.echoed = any(self.me in relay for sender, relay in relays.items() if sender != self.me)
        if self.signer is None:
            for sender, relay in relays.items():
                for peer, value in relay.items():
                    if peer != sender:
                        view.setdefault(peer, value)
            return view
        return await self._merge(kind, view, relays, deadlines[2])

    async def _merge(
        self, kind: str, view: dict[str, Any], relays: dict[str, dict[str, Any]], deadline: float
    ) -> dict[str, Any]:
        """The signed view: what I hold directly (each value checked against its sender's signature), and what
        the relays add, proven. A relayed value that differs from mine, or that I hold nothing for, is asked of
        its relayer with its member's signature: a relayer that cannot prove what it relayed is refused and
        banned (it put words in another member's mouth); a member with two different proven values equivocated
        and is left out (every survivor holds the same relays, and asks and gets the same proofs). A value that
        stays unproven (its relayer died before it answered) counts only if no proven one does and the unproven
        ones agree."""
        asked: dict[str, set[str]] = {}
        for sender, relay in relays.items():
            for peer, value in relay.items():
                if peer not in (sender, self.me) and (peer not in view or view[peer] != value):
                    asked.setdefault(sender, set()).add(peer)
        proofs = await asyncio.gather(*(self._prove(kind, s, sorted(p), deadline) for s, p in asked.items()))
        answers = dict(zip(asked, proofs, strict=True))
        proven: dict[str, list[Any]] = {peer: [value] for peer, value in view.items()}
        unproven: dict[str, list[Any]] = {}
        for sender, relay in relays.items():
            for peer, value in relay.items():
                if peer in (sender, self.me) or (peer in view and view[peer] == value):
                    continue
                answer = answers.get(sender)
                if answer is None:
                    unproven.setdefault(peer, []).append(value)
                elif answer.get(peer, (None,))[0] == value and value not in proven.setdefault(peer, []):
                    proven[peer].append(value)
                elif answer.get(peer, (None,))[0] != value:
                    self.invalid.setdefault(sender, f"relayed a {kind} of {peer[-8:]} it could not prove")
        merged = {}
        for peer in {*proven, *unproven}:
            held = proven.get(peer, [])
            if len(held) > 1:
                self.equivocators.setdefault(peer, f"signed {len(held)} different {kind}s in one round")
                log.warning("member %s signed %d different %ss this round: left out", peer[-8:], len(held), kind)
            elif held:
                merged[peer] = held[0]
            elif len({repr(v) for v in unproven[peer]}) == 1:
                merged[peer] = unproven[peer][0]
        return {peer: merged[peer] for peer in self.group.members if peer in merged}

    async def _prove(self, kind: str, relayer: str, members: list[str], deadline: float) -> dict[str, Any] | None:
        """Ask ``relayer`` for the signed values it holds of ``members``; the proven ones, or None if it did not
        answer in time. A stream that breaks is asked again, as a report is: a live relayer's proof lost to one
        broken stream would leave its value unproven here and proven on the members whose request went through,
        and so the views apart (one counts a member's value the others found it equivocated with)."""
        assert self.signer is not None
        if deadline <= asyncio.get_running_loop().time():
            return None
        header = {**self.header, "kind": kind, "members": members}
        try:
            _, body = await call_retrying(
                self.transport, relayer, "proofs", header, deadline, max_reply=self._proofs_bound(len(members))
            )
            held = msgpack.unpackb(body, raw=False, strict_map_key=True)
        except (PeerUnreachable, RpcTimeout, RemoteError):
            return None
        except (ValueError, msgpack.UnpackException, TypeError):
            held = None  # an answer that is no proof: what it relayed stays unproven, and it is banned below
        proven: dict[str, Any] = {}
        for peer, entry in (held if isinstance(held, dict) else {}).items():
            if isinstance(entry, list) and len(entry) == 2 and peer in members:
                if self.signer.check(peer, self.route, kind, entry[0], entry[1]):
                    proven[peer] = (entry[0],)
        return proven

    async def _agree(self, hashes: list[str | None]) -> list[bool]:
        """Exchange and relay reports of what I hold (one hash or None per member's slot) and return, per slot,
        whether every report in the merged view holds it with the same hash: only those slots are applied.

        Two members' reports are needed: with mine alone I cannot know what anyone else holds or applies.
        """
        if self.withhold:
            hashes = [h if j == self.index else None for j, h in enumerate(hashes)]
        deadlines = (self.report_deadline, self.relay_deadline, self.proof_deadline)
        self.view = await self._relayed("report", "hashes", hashes, deadlines)
        reports = list(self.view.values())
        self.applied = [
            len(reports) >= 2 and reports[0][j] is not None and all(rep[j] == reports[0][j] for rep in reports)
            for j in range(self.group.size)
        ]
        return self.applied

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
        except (PeerUnreachable, RpcTimeout, RemoteError) as exc:
            self._not_sent(peer, exc)
        return False

    async def _exchange(
        self, method: str, payload: dict[str, Any], inbox: dict[str, asyncio.Event], deadline: float,
        twisted: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        """Send my report or digest to every member and wait for theirs from the members still live.

        Members I count as gone get mine too, without waiting on them: one I gave up on wrongly (a broken
        stream under load) would otherwise wait for it until the deadline, and hold the round's reports in a
        different view than everyone else. ``twisted``: what every other member gets instead (tests only).
        """
        header = {**self.header, **payload}
        other = {**self.header, **twisted} if twisted is not None else header
        others = [p for p in self.group.members if p != self.me]
        loop = asyncio.get_running_loop()
        sends = {}
        for i, peer in enumerate(others):
            gone = peer in self.liveness.dead
            until = min(deadline, loop.time() + GONE_SEND_S) if gone else deadline
            sent = other if i % 2 else header
            sends[peer] = asyncio.ensure_future(self._send_small(peer, method, sent, until))
        for peer in others:
            if peer not in self.liveness.dead:
                await self.wait_on(inbox[peer], peer, deadline)
        for peer, task in sends.items():  # what I send to members gone by now finishes in the background
            if peer in self.liveness.dead:
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        await asyncio.gather(*(t for t in sends.values() if t not in self._background))

    async def _send_small(self, peer: str, method: str, header: dict[str, Any], deadline: float) -> None:
        """Send a report or digest; a broken stream is retried while time is left, sooner as the deadline nears (a
        relay lost to one reset just before the deadline leaves the receiver's view short of what the others
        hold). A peer that still cannot be reached is pinged, not counted gone: a broken link from me is no
        proof that its own report or relay will not reach me, and a survivor I stopped waiting for would leave
        its relay out of my view and in everyone else's."""
        try:
            await call_retrying(self.transport, peer, method, header, deadline)
        except (PeerUnreachable, RpcTimeout, RemoteError) as exc:
            self._not_sent(peer, exc)

    def _not_sent(self, peer: str, exc: PeerUnreachable | RpcTimeout | RemoteError) -> None:
        """A send to ``peer`` that did not go through: a broken stream has it pinged (counted gone only if the
        pings fail too), a timeout counts it gone, a refusal is logged (``_refused``)."""
        if isinstance(exc, RpcTimeout):
            self.liveness.mark_dead(peer, str(exc))
        elif isinstance(exc, RemoteError):
            self._refused(peer, exc)
        else:
            log.info("%s; pinging %s", exc, peer[-8:])
            self.liveness.watch(peer)

    def _refused(self, peer: str, exc: RemoteError) -> None:
        log.warning("%s", exc)
        if exc.code == "no-group":  # it never heard of this group (it gave up joining): do not wait for it
            self.liveness.mark_dead(peer, "not in this group")

    async def exchange_digests(self, digest: str, floor_s: float) -> dict[str, str]:
        """Send and relay my state digest; return the merged view of the group's digests (member -> digest).

        The direct step runs until the exchange's deadline, the same instant for every member: a member may leave
        the reports as late as their last deadline (it waited on one that stalled) and its digest must still reach
        the members that left early, before they relay (a digest that comes after is in no one's view, and both
        would count themselves unconfirmed). The relay step then gets ``floor_s``. A member that reaches this later
        still (a long outer step) gets half of ``floor_s`` for each step, to be heard by the members still here.
        """
        loop = asyncio.get_running_loop()
        now = loop.time()
        half = max(self.deadline, now + 0.5 * floor_s)
        self.deadline = max(self.deadline, now) + floor_s
        # A signed group keeps the last eighth for proofs of relayed digests that differ (``_merge``).
        relayed = self.deadline if self.signer is None else half + 0.75 * (self.deadline - half)
        try:
            return await self._relayed("digest", "digest", digest, (half, relayed, self.deadline))
        finally:
            self.liveness.close()


def digest_vote(view: dict[str, str]) -> str:
    """The digest most members in ``view`` hold (ties: the smallest)."""
    counts = Counter(view.values())
    best = max(counts.values())
    return min(d for d, c in counts.items() if c == best)
