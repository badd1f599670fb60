"""Swarm membership on hivemind's Kademlia DHT: signed, expiring peer records refreshed by heartbeats.

Each node stores one record under the key ``<run_id>_peers`` with a subkey holding its peer id and the RSA
public key of its libp2p identity; hivemind's ``RSASignatureValidator`` lets only the owner write it, and
``SchemaValidator`` makes other peers refuse records of the wrong shape. Records expire ``ttl`` seconds after
their last heartbeat, so a crashed node drops out of every view without announcing anything. Reading parses
every record again with our own schema and drops (with a logged reason) anything malformed, from another run or
protocol version, signed by a key that is not the claimed peer id's (``identity``), without the private swarm's
MAC (``swarmtrain.net.auth``), or claiming a round more than one ahead of what the other peers hold.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import Annotated, Any, Optional

import pydantic.v1 as pv1
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from swarmtrain.dht.identity import owner_of, record_subkey
from swarmtrain.net.auth import PUBLIC, SwarmAuth

log = logging.getLogger(__name__)

MAX_INNER_S = 24 * 3600.0  # a claimed inner phase longer than a day is a lie (it would stretch every gather)
MAX_RECORD_BANS = 16  # bans a record shows (those that end last): a hostile record cannot be huge
BAN_PEER_CHARS = 12  # a banned peer is named by the end of its id, as `swarmtrain status` shows peers
BAN_REASON_CHARS = 120
MAX_LOSS = 1e4  # a loss or bits per byte beyond this is a lie or a model gone to ruin
MAX_COUNT = 2**53  # tokens or bytes a record may claim (exact in a float)
RECORD_LOOKUP_S = 1.0  # the longest a leader looks up its members' records before it forms the group
# hivemind's DHT drops a peer from its routing table after one request it did not answer in 3 s, and takes it back
# only when a request from that peer comes in (``Membership.reintroduce``): a peer whose record a lookup found in
# the last REMEMBER_S and the next one missed is asked back, at most once every REINTRODUCE_S and at most
# REINTRODUCE_AT_ONCE peers a lookup.
REMEMBER_S = 120.0
REINTRODUCE_S = 5.0
REINTRODUCE_AT_ONCE = 16


class BanEntry(BaseModel):
    """One peer a node bans: until which round (the first it is welcome again) and why."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    until: int = Field(ge=0)
    reason: str = Field(max_length=BAN_REASON_CHARS)


def ban_table(bans: Mapping[str, Any]) -> dict[str, BanEntry]:
    """What a record shows of a node's bans (peer id -> anything with ``until`` and ``reason``): the
    ``MAX_RECORD_BANS`` that end last, each peer by the end of its id, each reason cut to its bound."""
    shown = sorted(bans.items(), key=lambda item: item[1].until)[-MAX_RECORD_BANS:]
    return {
        peer[-BAN_PEER_CHARS:]: BanEntry(until=ban.until, reason=ban.reason[:BAN_REASON_CHARS]) for peer, ban in shown
    }


class PeerRecord(BaseModel):
    """What a node tells the swarm about itself."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    peer_id: str = Field(min_length=1, max_length=128)
    addrs: list[str] = Field(default_factory=list, max_length=16)
    proto: int
    run_id: str = Field(max_length=128)
    round: int = Field(ge=0)
    phase: str = Field(max_length=16)  # training | averaging | syncing | bootstrap | done | leaving
    tokens_per_s: float = Field(ge=0.0, allow_inf_nan=False)
    batch_size: int = Field(ge=0)
    digest: str = Field("", max_length=64)
    inner_s: float = Field(0.0, ge=0.0, le=MAX_INNER_S, allow_inf_nan=False)  # its last inner phase, s (0: none)
    device: str = Field("", max_length=32)  # where its inner steps run (cpu, cuda:0, mps); "" for a bootstrap peer
    state: str = Field("", max_length=16)  # why it is or is not contributing (swarmtrain.node.state.NodeState)
    reason: str = Field("", max_length=240)  # the state's reason, e.g. whom it catches up from and how far
    ready: bool = False  # a node waiting to start (state "starting") that sees node.min_peers peers
    # What it says of its training, for dashboards (claims, like the rest: shown, never used by the protocol):
    loss: float | None = Field(None, ge=0.0, le=MAX_LOSS, allow_inf_nan=False)  # its last round's training loss
    bpb: float | None = Field(None, ge=0.0, le=MAX_LOSS, allow_inf_nan=False)  # its last held-out bits per byte
    tokens: int = Field(0, ge=0, le=MAX_COUNT)  # tokens it has trained on in all (its checkpoints' included)
    bytes_sent: int = Field(0, ge=0, le=MAX_COUNT)  # bytes it sent in its last round's outer step
    # the peers it bans now (the end of each id -> until which round, why): ``ban_table``
    bans: dict[Annotated[str, Field(max_length=BAN_PEER_CHARS)], BanEntry] = Field(
        default_factory=dict, max_length=MAX_RECORD_BANS
    )


class _BanV1(pv1.BaseModel):
    until: pv1.StrictInt
    reason: pv1.StrictStr


class _RecordV1(pv1.BaseModel):
    peer_id: pv1.StrictStr
    addrs: list[pv1.StrictStr]
    proto: pv1.StrictInt
    run_id: pv1.StrictStr
    round: pv1.StrictInt
    phase: pv1.StrictStr
    tokens_per_s: pv1.StrictFloat
    batch_size: pv1.StrictInt
    digest: pv1.StrictStr
    inner_s: pv1.StrictFloat
    device: pv1.StrictStr
    state: pv1.StrictStr = ""
    reason: pv1.StrictStr = ""
    ready: pv1.StrictBool = False
    loss: Optional[pv1.StrictFloat] = None  # noqa: UP045 (pydantic v1 needs Optional)
    bpb: Optional[pv1.StrictFloat] = None  # noqa: UP045
    tokens: pv1.StrictInt = 0
    bytes_sent: pv1.StrictInt = 0
    bans: dict[pv1.StrictStr, _BanV1] = {}
    mac: pv1.StrictStr  # the private swarm's MAC over subkey and record ("" in a public swarm)


class _PeersSchemaV1(pv1.BaseModel):
    peers: dict[BytesWithPublicKey, Optional[_RecordV1]]  # noqa: UP045 (pydantic v1 needs Optional)


def record_validators(run_id: str, private_key: RSAPrivateKey) -> tuple[RSASignatureValidator, SchemaValidator]:
    """Validators a DHT node of this swarm installs: owner signatures and the record schema."""
    return RSASignatureValidator(private_key), SchemaValidator(_PeersSchemaV1, prefix=run_id)


WARN_EVERY_S = 60.0  # a reader that looks every heartbeat logs the same refusal of a peer's record once a minute


class Refusals:
    """Logs why records are refused, each (what, whose) at most once per ``WARN_EVERY_S``: a peer that keeps
    publishing a bad record must not flood the log of every reader that looks every heartbeat."""

    def __init__(self) -> None:
        self.logged: dict[tuple[str, str], float] = {}

    def __call__(self, what: str, whose: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self.logged.get((what, whose), -WARN_EVERY_S) < WARN_EVERY_S:
            return
        if len(self.logged) >= 1024:  # bounded: identities are cheap
            self.logged.clear()
        self.logged[what, whose] = now
        log.warning(message, *args)


def _always(what: str, whose: str, message: str, *args: Any) -> None:
    log.warning(message, *args)


def read_record(
    subkey: Any, value: Any, auth: SwarmAuth = PUBLIC, warn: Callable[..., None] = _always
) -> PeerRecord | None:
    """A record as found in the DHT, or None (with the reason logged) unless it is well formed, signed by the key
    of the peer id it names and, in a private swarm, sealed with the swarm key. ``warn`` logs each refusal
    (``Refusals``: once a minute)."""
    if not isinstance(value, dict) or not isinstance(subkey, bytes):
        warn("shape", "", "ignoring a peer record that is not a map under a bytes subkey")
        return None
    content = {k: v for k, v in value.items() if k != "mac"}
    try:
        record = PeerRecord.model_validate(content)
    except ValidationError as exc:
        why = exc.errors()[0]["msg"]
        warn("malformed", repr(subkey[:16]), "ignoring a malformed peer record under %r: %s", subkey[:16], why)
        return None
    if not owner_of(subkey, record.peer_id):
        whose = record.peer_id[-8:]
        warn("forged", whose, "ignoring a peer record for %s signed with another identity's key", whose)
        return None
    if not auth.admits_record(subkey, record.peer_id, content, value.get("mac")):
        whose = record.peer_id[-8:]
        warn("unsealed", whose, "ignoring the record of %s: not sealed with this private swarm's key", whose)
        return None
    return record


async def swarm_records(
    dht: DHTNode, run_id: str, auth: SwarmAuth = PUBLIC, warn: Callable[..., None] = _always
) -> list[PeerRecord]:
    """The records of swarm ``run_id`` that the DHT holds and ``read_record`` accepts, sorted by peer id (none when
    the lookup found nothing). Each is its peer's claim: ``plausible`` says which to believe."""
    found = await dht.get(f"{run_id}_peers", latest=True)
    records = []
    if found is not None and isinstance(found.value, dict):
        for subkey, item in found.value.items():
            record = read_record(subkey, item.value, auth, warn)
            if record is not None and record.run_id == run_id:
                records.append(record)
    return sorted(records, key=lambda r: r.peer_id)


# Peers whose round says nothing of what the swarm holds: still waiting for node.min_peers, or downloading the state.
NOT_IN_STEP = frozenset({"starting", "catching_up"})


def plausible(
    records: dict[str, PeerRecord], my_round: int, warn: Callable[..., None] = _always
) -> dict[str, PeerRecord]:
    """The records of other peers whose round is at most one ahead of what this node and the other verified peers
    hold (the higher of ``my_round`` and the median of the others', the record's own left out, the upper one of an
    even count): one peer claiming round 10**15 cannot drag a swarm forward (it is never among the others that
    vouch for it), and peers lagging behind cannot make the honest ones next to me look like liars (with the lower
    median, a node catching up while one peer waited at round 1 and two were at 3 dropped both of those: the only
    peers it could catch up from). Peers still waiting to start or catching up (``NOT_IN_STEP``) never count: their
    round says nothing of what the swarm holds. Half a swarm that waited for node.min_peers at round 0 while the
    other half started must not hide the half that is ahead (they waited for each other for ever); and fresh
    processes that join together must not hide the one node that survived (the churn lab: three joiners dropped
    the survivor at round 4 and started the swarm again from round 0). A record with no peer in step to compare
    with is taken at its word, so a node that is behind (a joiner, a resumed node) can still follow a swarm of one.
    The price: at a swarm's birth, when no peer is in step yet, one peer claiming a round ahead can hand the
    swarm its first model. Two peers that lie alike outvote one that does not."""
    kept = dict(records)
    for peer, record in records.items():
        others = sorted(r.round for p, r in records.items() if p != peer and r.state not in NOT_IN_STEP)
        if not others:
            continue
        held = max(my_round, others[len(others) // 2])
        if record.round > held + 1:
            warn("ahead", peer, "ignoring %s: it claims round %d, the swarm holds %d", peer[-8:], record.round, held)
            del kept[peer]
    return kept


def swarm_round(view: Mapping[str, PeerRecord], me: str, my_round: int, held: Mapping[int, str] | None = None) -> int:
    """The round the swarm holds as this node sees it: the median of the rounds of the peers in step (not
    ``NOT_IN_STEP``) in ``view``, ``my_round`` included, the upper one of an even count, as ``plausible`` takes it.
    A peer whose record shows a state this node held (``held``: round -> digest of the state it began that round
    from) is on this node's line and counts at ``my_round``, however far its record lags: records are looked up
    every heartbeat, and rounds can be shorter than that (a node of the churn tests woke from a freeze with a view
    three rounds old, and took itself for off the swarm's line).

    A node more than one round from it is off the swarm's line (``off_swarm``): two parts of a swarm that were cut
    apart for longer than a catch-up each trained on, and a gap of two rounds or more never closes by itself (a
    leader takes joins for its round and the next only, and the part behind ignores the records of the part
    ahead). The smaller part goes to the larger one's state; of two parts alike in size, the one behind goes to the
    one ahead. One peer cannot move the median alone, except in a swarm of two, where either peer's state was
    already the other's to take (see ``plausible``)."""
    held = held or {}
    rounds = [my_round]
    for peer, record in view.items():
        if peer != me and record.state not in NOT_IN_STEP:
            mine = bool(record.digest) and held.get(record.round) == record.digest
            rounds.append(my_round if mine else record.round)
    return sorted(rounds)[len(rounds) // 2]


def off_swarm(view: Mapping[str, PeerRecord], me: str, my_round: int, held: Mapping[int, str] | None = None) -> bool:
    """Whether ``my_round`` is more than one round from ``swarm_round``: this node holds another state than the
    swarm, and no round with it will bring them together."""
    return abs(my_round - swarm_round(view, me, my_round, held)) > 1


class Membership:
    """Publishes this node's record and keeps a live view of the swarm."""

    def __init__(
        self,
        dht: DHTNode,
        signer: RSASignatureValidator,
        record: PeerRecord,
        ttl: float,
        auth: SwarmAuth = PUBLIC,
        bootstrap: Collection[str] = (),
    ) -> None:
        self.dht = dht
        self.record = record
        self.ttl = ttl
        self.auth = auth
        self.refusals = Refusals()  # why records were ignored, logged once a minute each
        self.key = f"{record.run_id}_peers"
        self.subkey = record_subkey(record.peer_id, signer)
        self.view: dict[str, PeerRecord] = {record.peer_id: record}
        # Monotonic time each peer's record was last found (kept REMEMBER_S, for ``reintroduce``; a peer that
        # announced its leave is dropped at once).
        self.seen_at: dict[str, float] = {}
        self.left: set[str] = set()  # peers that announced a graceful leave
        self.bootstrap = [p for p in bootstrap if p != record.peer_id]  # node.join's peers
        self._asked: dict[str, float] = {}  # peer -> when it was last asked back into the routing table
        self._pings: set[asyncio.Task] = set()

    def update(self, **changes: Any) -> None:
        self.record = self.record.model_copy(update=changes)

    async def published_tokens(self, peers: Collection[str], round_: int) -> dict[str, float]:
        """The tokens each of ``peers`` says it trained on in its last inner phase: its record's ``tokens_per_s``
        times its ``inner_s``, to the nearest whole token as it counted them (a peer with no record in view is left
        out). A node publishes the record of round ``round_``'s inner phase just before it joins that round's group;
        where a record in view is older, the swarm is looked up again first, for at most ``RECORD_LOOKUP_S`` (after
        that, the view as it is)."""
        if not all(self._published(peer, round_) for peer in peers):
            try:
                await asyncio.wait_for(self.refresh(), RECORD_LOOKUP_S)
            except Exception as exc:  # a slow or failed lookup: the records in view are what we have
                log.debug("looking up the records of round %d's group: %r", round_, exc)
        return {p: float(round(r.tokens_per_s * r.inner_s)) for p in peers if (r := self.view.get(p)) is not None}

    def _published(self, peer: str, round_: int) -> bool:
        record = self.view.get(peer)
        return record is not None and (record.round > round_ or (record.round, record.phase) == (round_, "averaging"))

    def _value(self) -> dict[str, Any]:
        value = self.record.model_dump()
        return {**value, "mac": self.auth.seal(self.subkey, value)}

    async def publish(self) -> bool:
        return await self.dht.store(self.key, self._value(), get_dht_time() + self.ttl, subkey=self.subkey)

    async def refresh(self) -> dict[str, PeerRecord]:
        """Look the swarm up again. A peer missing from one lookup stays in the view until ``ttl`` seconds after
        it was last seen (a lookup that failed or reached few DHT peers is not news that peers left); a peer that
        announced its leave goes at once."""
        found = await swarm_records(self.dht, self.record.run_id, self.auth, self.refusals)
        now = time.monotonic()
        view: dict[str, PeerRecord] = {self.record.peer_id: self.record}
        found_records: dict[str, PeerRecord] = {}
        for record in found:
            if record.proto != self.record.proto:
                log.debug("ignoring %s: protocol v%d", record.peer_id[-8:], record.proto)
            elif record.peer_id != self.record.peer_id:
                found_records[record.peer_id] = record
        for record in plausible(found_records, self.record.round, self.refusals).values():
            if record.phase == "leaving":
                self.seen_at.pop(record.peer_id, None)
                self.left.add(record.peer_id)
            else:
                self.left.discard(record.peer_id)  # back with the same identity (--resume)
                view[record.peer_id] = record
                self.seen_at[record.peer_id] = now
        for peer, record in self.view.items():
            if peer not in view and now - self.seen_at.get(peer, -float("inf")) < self.ttl:
                view[peer] = record
        self.seen_at = {peer: t for peer, t in self.seen_at.items() if now - t < REMEMBER_S}
        self.view = view
        self.reintroduce({r.peer_id for r in found}, now)
        return view

    def reintroduce(self, found: Collection[str], now: float) -> None:
        """Ask the peers met lately that this lookup missed (and node.join's, when it found no one) back into the
        DHT's routing table, in the background: a ping that is answered puts each into the other's table.

        hivemind drops a peer from its routing table after one request the peer did not answer in time, and takes
        it back only when a request from it comes in. A node frozen for a while (SIGSTOP) saw the requests it had in
        flight time out as it woke and dropped every peer, as they had dropped it: no lookup of its found anyone
        again, it trained alone for good, and the others ignored its records, thousands of rounds ahead (found by
        tests/test_churn.py's frozen node under load). Heavy load can drop peers the same way.
        """
        lost = [p for p in self.seen_at if p not in found]
        if not set(found) - {self.record.peer_id}:
            lost += [p for p in self.bootstrap if p not in self.seen_at]
        self._asked = {p: t for p, t in self._asked.items() if now - t < REINTRODUCE_S}
        for peer in [p for p in lost if p not in self._asked][:REINTRODUCE_AT_ONCE]:
            self._asked[peer] = now
            task = asyncio.ensure_future(self._ping(peer))
            self._pings.add(task)
            task.add_done_callback(self._pings.discard)

    async def _ping(self, peer: str) -> None:
        try:
            if await self.dht.protocol.call_ping(PeerID.from_base58(peer)) is not None:
                log.debug("%s is back in the DHT's routing table", peer[-8:])
        except Exception as exc:  # a peer id that does not parse, a daemon going down: the next lookup tries again
            log.debug("could not ask %s back into the DHT's routing table: %r", peer[-8:], exc)

    async def run(self, period: float) -> None:
        """Heartbeat: publish and refresh every ``period`` seconds until cancelled."""
        while True:
            started = time.monotonic()
            try:
                await self.publish()
                await self.refresh()
            except Exception as exc:  # a DHT hiccup must never take the node down
                log.warning("membership heartbeat failed: %r", exc)
            await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))

    async def leave(self) -> None:
        """Announce a graceful leave: a short-lived record in phase 'leaving' replaces ours."""
        self.update(phase="leaving")
        await self.dht.store(self.key, self._value(), get_dht_time() + 5.0, subkey=self.subkey)
