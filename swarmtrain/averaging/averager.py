"""The outer step of one node: form a group, all-reduce the pseudo-gradient, apply, confirm, resync.

``Averager`` owns theta_g and the outer optimizer state, serves the round RPCs (join, part, result, report,
digest, ping, state) on a ``Transport``, and runs one round at a time through ``run_round``. Every message
carries the run id and protocol version; a peer from another run or version is refused with the reason.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from swarmtrain.averaging.allgather import AllGather, plan_segments
from swarmtrain.averaging.allreduce import AllReduce
from swarmtrain.averaging.attack import JOINS
from swarmtrain.averaging.bans import Bans
from swarmtrain.averaging.exchange import AllReduceResult, GroupExchange, Unsettled, disputes, withholders
from swarmtrain.averaging.group import Group
from swarmtrain.averaging.matchmaking import MAX_WEIGHT, PROBE_AFTER_S, Matchmaker
from swarmtrain.averaging.outer import OuterOptimizer
from swarmtrain.averaging.robust import Aggregator
from swarmtrain.averaging.round import Event, Lifecycle, Phase, Round, Stale, Step, Verdict, alone_applies, decide
from swarmtrain.averaging.signing import MAX_KEY_BYTES, MAX_SIG_BYTES, RoundSigner
from swarmtrain.averaging.statesync import CHUNK_BYTES, SnapshotStore, download_state
from swarmtrain.compression import BaseCodec, CodecState, all_finite, get_codec
from swarmtrain.net import Handler, Rejected, RpcError, StreamHandler, Transport

log = logging.getLogger(__name__)

# 2: sparse/low-rank all-gathered; 3: state in chunks; 4: relays, records signed by identity; 5: shards rotate
# per round, a group runs one budget, bans; 6: result parts name the members they include, "ledger"; 7: reports
# and digests signed with identity keys, relayed values that differ proven on request ("proofs"); 8: peer records
# carry loss, bpb, tokens and bytes sent (``swarmtrain dashboard --join``); 9: with averaging.verify, parts signed
# by their senders and reducers show what they averaged to members that check them ("evidence"); 10: state digests,
# shard and payload hashes are BLAKE3 (were SHA-256); 11: joins marked "probe", answered from a formed group by any
# of its members (a member whose leader froze before answering it asks a member that holds the group); 12: without
# an outer momentum the state is theta_g alone (its digest, the gossip mix and the state download); 13: a signed
# digest carries a "held" signature, joins carry a certificate of the joiner's state, and a signed group says whose
# state counts in a mix (``Group.counted``); 14: the state digest is the hash of its chunk hashes, and a signed
# gossip round's state parts are checked against them (``AllReduce._check_chunk``); 15: a part carries its sender's
# claimed step (signed with it where reducers are checked), and a robust mix counts states about a step apart.
PROTOCOL_VERSION = 15
STATE_FLOOR = 2.0  # see ``state_aggregator``: twice a step, as the update's norm clip (``clip=2``)
_ROUTE_WAIT = 5.0  # a member may hear of its group a moment after a peer that already sends
_SMALL = 1 << 16
_LEDGERS = 8  # decisions of the last rounds this member confirmed, served to members that could not
LEDGER_TIMEOUT = 5.0
_MAX_ROUTES = 64
_ROUTES_PER_PEER = 4  # groups one peer may announce before we claim them: a stranger cannot crowd out real ones
DIGEST_SHARE = 0.1  # the share of a budget the digest exchange relays for after the exchange (or after it starts late)


def _now() -> float:
    """The loop's clock: virtual in the fault simulator, so seeds replay exactly."""
    return asyncio.get_running_loop().time()


@dataclass
class RoundOutcome:
    round: int
    group: Group
    outcome: str  # applied | fallback | diverged-resynced | diverged
    digest: str
    applied_fraction: float
    excluded: list[str]
    duration_s: float
    spread: float | None = None  # gossip: relative distance of my theta_g to my group's average before mixing
    phases: dict[str, float] = field(default_factory=dict)  # where the round's time went
    decisions: tuple[bool, ...] = ()  # per member's slot (shard or payload): applied (True) or fell back
    mixed: bool = False  # a gossip round: whether the outer state was mixed (the agreed decision)
    alone: bool = False  # decided without anyone else's report (cut off): the decisions are its own, not agreed
    checked: tuple[tuple[int, int, str], ...] = ()  # the parts of other reducers' shards I checked (``verify``)
    resent: int = 0  # bytes sent again to members that asked again after a broken stream (``GroupExchange.resent``)


class Averager:
    def __init__(
        self,
        transport: Transport,
        theta: torch.Tensor,
        *,
        run_id: str,
        group_size: int,
        outer_lr: float,
        outer_momentum: float,
        codec_up: BaseCodec,
        codec_down: BaseCodec,
        part_numel: int,
        min_deadline: float,
        deadline_factor: float,
        fail_at: str = "",
        test_skew_at: int = -1,
        error_feedback: bool = True,
        shapes: list[tuple[int, ...]] | None = None,
        aggregator: Aggregator | None = None,
        attack: Callable[[torch.Tensor, float], tuple[torch.Tensor, float]] | None = None,
        ban_rounds: int = 0,
        signer: RoundSigner | None = None,
        verify: float = 0.0,
        rng: random.Random | None = None,
        max_weight: float = MAX_WEIGHT,
    ) -> None:
        self.transport = transport
        self.aggregator = aggregator or Aggregator()  # combines the round's updates (``robust``)
        # Combines the states of a gossip mix: the same kind, without the norm clip (a state's norm says nothing of
        # how far it is from the others; centered-clip's radius and a median or trim do). A certificate shows only
        # that some key signed a state, and keys are free, so a robust swarm does not let a counted state pull the
        # mix much further than the members' own steps: centered-clip's radius is at least ``STATE_FLOOR`` times
        # the median member's last outer step (``Aggregator.floor``), so honest gossip lines a round or two apart
        # mix as in the mean, and a state far away pulls by about that radius / (group size - 1) a round.
        self.state_aggregator = replace(self.aggregator, clip=0.0, floor=STATE_FLOOR)
        self.attack = attack  # tests only (``attack.kind``): turns my honest update into a hostile one
        kind = getattr(attack, "kind", "")
        self.equivocate = kind == "equivocate"  # tests only: tells members different things
        self.alter = attack.alter if kind == "bad-reducer" else None
        self.mute = kind == "mute-reducer"  # tests only: never shows what it averaged
        self.withhold = kind == "withhold"  # tests only: reports no other shard as held
        own_state = kind in ("own-state", "self-certified")
        self.steer = attack.steer if own_state else None  # tests only: a state of my own
        self.certify = attack.certify if kind == "self-certified" else None
        self.boast = attack.boast if own_state else None  # tests only: claims huge steps in a mix
        # Signs my reports and digests and checks the others' (``signing``): a node always signs, with its identity
        # key; the in-process simulator and most unit tests run unsigned (peer ids there are not keys).
        self.signer = signer
        # How many parts of other reducers' shards I check a round, on average (``AllReduce._verify``; signed
        # groups only), and where I draw which: private, so no reducer can tell which part will be checked.
        self.verify, self.rng = verify, rng or random.SystemRandom()
        self.me = transport.peer_id
        self.run_id = run_id
        self.header = {"run": run_id, "v": PROTOCOL_VERSION}
        self.outer = OuterOptimizer(theta, outer_lr, outer_momentum, nesterov=True)
        self.codec_up, self.codec_down = codec_up, codec_down
        self.part_numel = part_numel
        self.min_deadline, self.deadline_factor = min_deadline, deadline_factor
        # Joins carry the parameter count, so a leader refuses a peer training another model shape.
        self.matchmaker = Matchmaker(
            transport, {**self.header, "numel": theta.numel()}, group_size,
            min_budget_s=deadline_factor * min_deadline, max_weight=max_weight,
            probe_after=min(PROBE_AFTER_S, 0.1 * min_deadline),
        )  # fmt: skip
        self.group_size = group_size
        self.matchmaker.hostile_join = attack.answer_join if kind in JOINS else None  # tests only
        self.matchmaker.bans = Bans(self.me, ban_rounds)  # peers caught sending invalid payloads (``bans``)
        if signer is not None:
            self.matchmaker.check_held = signer.check_held
        # Another member's signed statement that it held my state at the end of a round, and that state's digest:
        # what makes my state count when a signed gossip round mixes (``Group.counted``).
        self.certified: tuple[str, dict[str, Any]] | None = None
        self.round = 0
        # The node's phase between rounds (solo, in step, catching up, observing, ...) and an update that missed its
        # round: ``round.Lifecycle``, moved by the rounds here and by the node's catch-up.
        self.lifecycle = Lifecycle()
        self._buffers: dict[str, torch.Tensor] = {}
        # Error feedback: what the codec dropped, and what this node contributed but the group did not apply (a
        # shard or payload that fell back), re-sent with later rounds. Lossless codecs need it for the latter.
        self.residual = torch.zeros_like(theta) if error_feedback else None
        # Sparse and low-rank codecs are all-gathered whole, segment by segment (``shapes``: the model's
        # parameter shapes in flat order, so PowerSGD factors real weight matrices).
        self.segments = plan_segments(codec_up, theta.numel(), shapes, part_numel) if codec_up.sparse else []
        self.codec_states = [CodecState() for _ in self.segments]  # error feedback and warm starts, per segment
        self._routes: dict[str, asyncio.Future[GroupExchange]] = {}
        self._finished: set[str] = set()  # routes of exchanges that are over, kept a while to refuse late messages
        self._opened_by: dict[str, str] = {}  # unclaimed routes: the peer whose message opened each
        self._durations: list[float] = []
        self.fail_at = tuple(int(kv.split("=")[1]) for kv in fail_at.split(",")) if fail_at else None
        self.test_skew_at = test_skew_at
        fp32 = get_codec("fp32")  # gossip rounds mix theta_g losslessly
        largest = [c.payload_size(part_numel) for c in (codec_up, codec_down, fp32)]
        largest += [seg.codec.payload_size(seg.numel) for seg in self.segments]
        self.max_body = max(largest) + 1024 + MAX_SIG_BYTES + MAX_KEY_BYTES  # a part carries its signature
        # Parts of the largest shard (mixing theta_g and the momentum doubles it), or the segments of an all-gathered
        # payload.
        mixed = theta.numel() * len(self.outer.state_tensors())
        self.max_frames = max(-(-mixed // part_numel), len(self.segments)) + 1
        self.snapshots = SnapshotStore()  # the states this node serves to joiners (statesync)
        self.ledgers: OrderedDict[str, dict[str, Any]] = OrderedDict()  # group id -> the decision I applied
        self.unsettled: Unsettled | None = None  # my part in a round I could not confirm (``reconcile``)
        self.state_chunk = CHUNK_BYTES  # chunk size of our own downloads

    @property
    def numel(self) -> int:
        return self.outer.theta.numel()

    def deadline_s(self) -> float:
        """All-reduce deadline: a floor, or a multiple of the slowest recent complete transfer (adapts to the
        link and the model size)."""
        recent = self._durations[-5:]
        return max(self.min_deadline, self.deadline_factor * max(recent)) if recent else self.min_deadline * 3

    # ---- service ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        for method in ("parts", "results"):
            await self.transport.serve_stream(
                method, self._routed_stream(method), max_body=self.max_body, max_frames=self.max_frames
            )
        await self.transport.serve("report", self._routed(lambda ar, s, h: ar.on_report(s, h)), max_body=_SMALL)
        await self.transport.serve("digest", self._routed(lambda ar, s, h: ar.on_digest(s, h)), max_body=_SMALL)
        await self.transport.serve("proofs", self._on_proofs, max_body=_SMALL)
        await self.transport.serve("evidence", self._on_evidence, max_body=_SMALL)
        await self.transport.serve("join", self._on_join, max_body=_SMALL)
        await self.transport.serve("ping", self._on_ping, max_body=_SMALL)
        await self.transport.serve("ledger", self._on_ledger, max_body=_SMALL)
        await self.transport.serve("state", self._on_state, max_body=_SMALL)

    def check_header(self, header: dict[str, Any]) -> None:
        if header.get("run") != self.run_id:
            raise Rejected(f"run id {header.get('run')!r} is not this swarm's {self.run_id!r}")
        if header.get("v") != PROTOCOL_VERSION:
            raise Rejected(f"protocol version {header.get('v')!r} is not {PROTOCOL_VERSION}")

    def _route(self, group_id: Any, sender: str | None = None) -> asyncio.Future[GroupExchange]:
        """The route of ``group_id``; a message from ``sender`` for a group we have not claimed yet opens one (at
        most ``_ROUTES_PER_PEER`` open per sender)."""
        if not isinstance(group_id, str) or len(group_id) > 32:
            raise Rejected("missing or malformed group id")
        if group_id not in self._routes:
            self._opened_by = {g: p for g, p in self._opened_by.items() if g in self._routes}
            if sender is not None:
                opened = sum(p == sender and not self._routes[g].done() for g, p in self._opened_by.items())
                if opened >= _ROUTES_PER_PEER:
                    raise Rejected(f"{opened} groups announced by {sender[-8:]} are still unclaimed here", code="busy")
                self._opened_by[group_id] = sender
            if len(self._routes) >= _MAX_ROUTES:
                # Evict the oldest route that no exchange of ours needs: one whose exchange is over, or one no
                # group of ours ever claimed (a peer spraying ids). Only live exchanges are never evicted.
                stale = next((g for g, f in self._routes.items() if g in self._finished or not f.done()), None)
                if stale is None:
                    raise Rejected("too many groups in flight")
                del self._routes[stale]
                self._finished.discard(stale)
            self._routes[group_id] = asyncio.get_running_loop().create_future()
        return self._routes[group_id]

    async def _allreduce_for(self, header: dict[str, Any], sender: str) -> GroupExchange:
        self.check_header(header)
        group_id = header.get("group")
        route = self._route(group_id, sender)
        if route.done():  # the common case: my exchange of this group is under way
            return route.result()
        self.matchmaker.heard_from(sender, group_id)
        try:
            return await asyncio.wait_for(asyncio.shield(route), _ROUTE_WAIT)
        except TimeoutError:
            if not route.done() and self._routes.get(group_id) is route:
                del self._routes[group_id]
            raise Rejected(f"no group {group_id} here", code="no-group") from None

    def _routed(self, action: Callable[[GroupExchange, str, dict[str, Any]], None]) -> Handler:
        async def handler(sender: str, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
            action(await self._allreduce_for(header, sender), sender, header)
            return {}, b""

        return handler

    async def _on_proofs(self, sender: str, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        """A group member asks for the signed reports or digests I relayed to it (``exchange._merge``); served
        while the round's route is kept, after my own round is over too."""
        return {}, (await self._allreduce_for(header, sender)).on_proofs(sender, header)

    async def _on_evidence(self, sender: str, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        """A group member checks a part of the shard I reduced (``AllReduce._verify``)."""
        allreduce = await self._allreduce_for(header, sender)
        if self.mute:  # tests only: hold the checker until the round's deadline, then answer nothing
            await asyncio.sleep(max(allreduce.deadline - asyncio.get_running_loop().time(), 0.0))
            raise Rejected("a mute reducer shows nothing")
        return {}, allreduce.on_evidence(sender, header)

    def _routed_stream(self, method: str) -> StreamHandler:
        async def handler(
            sender: str, header: dict[str, Any], frames: AsyncIterator[bytes]
        ) -> tuple[dict[str, Any], bytes]:
            allreduce = await self._allreduce_for(header, sender)
            await (allreduce.on_parts if method == "parts" else allreduce.on_results)(sender, header, frames)
            return {}, b""

        return handler

    async def _on_join(self, sender: str, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        self.check_header(header)
        if header.get("numel") != self.numel:
            raise Rejected(
                f"a model of {header.get('numel')} parameters, but this swarm trains {self.numel}: every node needs "
                "the same model settings (model.*, including model.exits)",
                code="incompatible",
            )
        return await self.matchmaker.on_join(sender, header, lambda: (self.round, self.outer.digest())), b""

    async def _on_ping(self, sender: str, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        self.check_header(header)
        return {"round": self.round}, b""

    async def _on_state(self, sender: str, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        self.check_header(header)
        # A probe serialises the live tensors before its first await: the bytes are one consistent state.
        return await self.snapshots.answer(
            header, lambda: (self.round, self.outer.digest(), self.outer.state_tensors())
        )

    # ---- state transfer -----------------------------------------------------------------------------------

    async def fetch_state(
        self,
        peers: list[str],
        want_digest: str | None,
        max_round: int | None = None,
        timeout: float = 60.0,
        rewind: bool = False,
    ) -> bool:
        """Download theta_g and the outer state in chunks from the peers that serve ``want_digest`` (any if None).

        The state is checked chunk by chunk against its donors' manifest, then whole against our own names,
        shapes and dtypes and against the digest; a peer claiming a round beyond ``max_round`` is skipped, so
        one peer cannot drag our round number forward. See ``statesync``. With ``rewind`` the round becomes the
        donors' even where it is lower than ours: this node was off the swarm's line (``Event.OFF_SWARM``), and
        what it kept of its own rounds goes (the update waiting for a later round, the groups it formed or joined).
        """
        donors = [p for p in dict.fromkeys(peers) if p != self.me]
        found = await download_state(
            self.transport, self.header, donors, self.outer.state_tensors(), want_digest, max_round,
            chunk=self.state_chunk, timeout=timeout,
        )  # fmt: skip
        if found is None:
            return False
        round_, _, tensors = found
        self.outer.load_state_tensors(tensors)
        if rewind and round_ < self.round:
            self.lifecycle.stale = None  # measured from a state the swarm never held
            self.matchmaker.lobbies.clear()  # a lobby of a round I will reach again must not answer as formed
        self.round = round_ if rewind else max(self.round, round_)
        return True

    def _fault_hook(self, round_: int) -> Callable[[int], None] | None:
        """The ``averaging.fail_at`` fault: SIGKILL this process after its P-th part of round R (tests only)."""
        if self.fail_at is None or self.fail_at[0] != round_:
            return None
        part = self.fail_at[1]

        def hook(sent: int) -> None:
            if sent == part:
                log.warning("fault injection: killing this node after part %d of round %d", part, round_)
                os.kill(os.getpid(), signal.SIGKILL)

        return hook

    def _skew(self, round_: int) -> None:
        """The ``averaging.test_skew_at`` fault: after round R's outer step, move theta_g off the group's state, so
        this node's digest is the minority of the vote (tests only)."""
        if round_ == self.test_skew_at:
            log.warning("fault injection: perturbing theta_g after the outer step of round %d", round_)
            self.outer.theta.add_(1e-3)

    # ---- one round ----------------------------------------------------------------------------------------

    async def run_round(
        self, delta: torch.Tensor, weight: float, candidates: list[str], expected: set[str], gather_timeout: float
    ) -> RoundOutcome:
        """Average ``delta`` (theta_g - theta_local) with my group and apply the outer step to theta_g.

        The round's steps (``round.Step``): form the group; a round of one ends there. Otherwise mix theta_g in a
        gossip group, exchange the update and step, vote on the digests, resync when in the minority. The outcome
        is ``round.decide``, and the node's phase moves by one ``round.Event`` at the end.
        """
        r = Round(self.round, _now())
        if self.steer is not None:
            self.steer(self.outer.theta)  # tests only: a state of my own
        delta, weight = self._contribution(delta, weight, r.number)
        group = await self._gather(r, weight, candidates, expected, gather_timeout)
        if group.size == 1:
            return self._round_of_one(r, group, delta, weight, others_expected=bool(expected - {self.me}))
        update = self._open_exchange(r, group, delta)
        spread, mixes, heard = await self._mix(r, group, update) if group.mixed else (None, False, True)
        result = await self._exchange(r, update)
        digest = self.outer.digest()
        digests = await self._digests(r, update, digest)
        self._note_duration(result)
        # len(update.view): the view after the digests, which relay it too
        verdict = decide(
            self.me, digest, digests, result.applied, group.size, group.mixed, mixes, heard, len(update.view),
            voters=group.voters(digests), echoed=update.values["report"].echoed,
        )  # fmt: skip
        outcome, digest = await self._settle(r, verdict, digest)
        self._remember(r.number, update, outcome)
        if (cert := update.certificate(digest)) is not None:
            self.certified = (digest, cert)
        r.enter(Step.DONE)
        phases = {k: round(v, 4) for k, v in r.phases.items()}
        return RoundOutcome(
            r.number, group, outcome, digest, sum(result.applied) / group.size, result.excluded,
            _now() - r.started, spread, phases, decisions=tuple(result.applied),
            mixed=mixes, alone=verdict.alone, checked=tuple(update.checked), resent=update.resent,
        )  # fmt: skip

    def _contribution(self, delta: torch.Tensor, weight: float, round_: int) -> tuple[torch.Tensor, float]:
        """What this member contributes: its update plus a stale one (``_with_stale``), nothing if not finite."""
        if not all_finite(delta):
            log.error("round %d: the local update is not finite (training diverged); contributing nothing", round_)
            delta, weight = torch.zeros_like(delta), 0.0
        elif weight > 0:
            delta = self._with_stale(delta, round_)
        if self.attack is not None and weight > 0:
            delta, weight = self.attack(delta, weight)  # after the finiteness check: a hostile node skips it
        return delta, weight

    async def _gather(
        self, r: Round, weight: float, candidates: list[str], expected: set[str], gather_timeout: float
    ) -> Group:
        own, digest = self.deadline_s(), self.outer.digest()
        cert = self.certified[1] if self.certified is not None and self.certified[0] == digest else None
        if self.certify is not None:
            cert = self.certify(r.number, digest)  # tests only: my state, certified by a second key of mine
        return await self.matchmaker.form_group(
            r.number, weight, digest, candidates, expected, gather_timeout, own, self.deadline_factor * own, cert,
            lead=self.lifecycle.phase is not Phase.OBSERVE,
        )  # fmt: skip

    def _round_of_one(
        self, r: Round, group: Group, delta: torch.Tensor, weight: float, others_expected: bool
    ) -> RoundOutcome:
        """No one averaged with me: apply my update if I am alone in the swarm (``alone_applies``); otherwise keep
        theta_g as it is, keep my update for a later round and catch up from a peer before the next one."""
        self.round += 1
        r.enter(Step.DONE)
        if not alone_applies(others_expected, self.lifecycle.solo):
            self.lifecycle.advance(Event.NO_GROUP)
            if weight > 0:
                self.lifecycle.stale = Stale(delta.clone(), r.number)
            log.warning("round %d: no group formed although peers are live; will catch up from them", r.number)
            return RoundOutcome(r.number, group, "diverged", self.outer.digest(), 0.0, [], _now() - r.started)
        self.outer.step(delta)
        self.lifecycle.advance(Event.APPLIED_ALONE)
        return RoundOutcome(r.number, group, "applied", self.outer.digest(), 1.0, [], _now() - r.started)

    def _open_exchange(self, r: Round, group: Group, delta: torch.Tensor) -> GroupExchange:
        """The update's exchange, taking messages from now on: a member still in the state exchange (up to one
        budget behind) must not turn away peers that already send their updates."""
        r.budget = self.budget_s(group)
        # A group I learned late counts its phase deadlines from when the others began, as theirs do (at most half
        # a budget back: a member cannot claim my whole exchange is over).
        r.exchange_started = max(r.started, _now() - min(group.age_s, r.budget / 2))
        r.phases["group_s"] = r.exchange_started - r.started
        # One bound for the whole exchange (see ``budget_s``): a mixed round's update gets what the state exchange
        # left of two budgets, not a fresh one; its phase deadlines are shares of the second budget, the same on
        # every member whenever each left the state exchange.
        deadline = r.exchange_started + r.budget * (2 if group.mixed else 1)
        update = self._allreduce(group, delta, deadline, fault=self._fault_hook(r.number), residual=self.residual)
        update.opens = r.exchange_started + (r.budget if group.mixed else 0.0)
        return update

    async def _mix(self, r: Round, group: Group, update: GroupExchange) -> tuple[float | None, bool, bool]:
        """Gossip: members come from different groups of the last round, so their theta_g differ. Average theta_g
        and the momentum (where there is one) first, lossless fp32, then the update as usual. Returns the spread
        before mixing (None when not mixed), whether the group mixed, and whether I heard anyone."""
        r.enter(Step.MIX)
        state = torch.cat(list(self.outer.state_tensors().values()))
        moved = self.outer.moved if self.boast is None else self.boast(self.outer.moved)
        # Signed, each member's parts are checked against the digest it joined with (``AllReduce._check_chunk``).
        mixing = self._allreduce(
            group, state, r.exchange_started + r.budget, codec=get_codec("fp32"), tag="/state",
            weights=group.mix_weights, chunk=self.outer.chunk if group.counted else 0,
            digests=dict(zip(group.members, group.digests, strict=True)) if group.counted else None,
            hashes=self.outer.chunk_hashes() if group.counted else b"", moved=moved,
        )  # fmt: skip
        mixing.opens = r.exchange_started
        try:
            mixed = await self._run(mixing)
        except BaseException:
            self._forget(update)
            raise
        finally:
            self._forget(mixing)
        r.phases["mix_s"] = _now() - r.exchange_started
        # A member that sent another state than the one it joined with, or a reducer that averaged one.
        self.matchmaker.bans.record({**mixing.invalid, **mixing.equivocators}, r.number)
        self.matchmaker.bans.withholder(set(withholders(mixing.view, group.members)), r.number)
        numel = self.numel
        # Whether to mix is the reports' agreed decision, the same on every member that decides at all: a member's
        # own view of who died would split the group into mixers and keepers.
        mixes = all(mixed.applied)
        heard = len(mixing.view) >= 2
        spread = None
        if mixes:
            spread = float((self.outer.theta - mixed.average[:numel]).norm() / mixed.average[:numel].norm())
            for i, tensor in enumerate(self.outer.state_tensors().values()):
                tensor.copy_(mixed.average[i * numel : (i + 1) * numel])
        return spread, mixes, heard

    async def _exchange(self, r: Round, update: GroupExchange) -> AllReduceResult:
        """Average the update and apply the outer step with what the group agreed on."""
        r.enter(Step.EXCHANGE)
        result = await self._run(update)
        self.matchmaker.bans.record({**update.invalid, **update.equivocators}, r.number)
        bans, members = self.matchmaker.bans, update.group.members
        bans.strike({members[j] for j, _, how in update.checked if how == "unanswered"}, r.number)
        lone = set(withholders(update.view, members))
        bans.withholder(lone, r.number)
        bans.dispute(disputes(update.view, members, lone), r.number)
        r.phases.update(result.phases)
        self.outer.step(result.average)
        self._skew(r.number)
        return result

    async def _digests(self, r: Round, update: GroupExchange, digest: str) -> dict[str, str]:
        """Exchange the digest of my state after the step; returns the relayed view of digests."""
        r.enter(Step.DIGEST)
        confirm_started = _now()
        try:
            digests = await update.exchange_digests(digest, DIGEST_SHARE * r.budget)
        finally:
            self._forget(update)
        self.matchmaker.bans.record({**update.invalid, **update.equivocators}, r.number)
        r.phases["confirm_s"] = _now() - confirm_started
        return digests

    def _note_duration(self, result: AllReduceResult) -> None:
        if result.complete:
            # The next deadline follows what moving the payloads took, not time spent waiting on a member that
            # died or stalled: that wait is bounded by this deadline and would make the next one longer still.
            self._durations.append(result.phases.get("transfer_s", 0.0) + result.phases.get("report_s", 0.0))

    async def _settle(self, r: Round, verdict: Verdict, digest: str) -> tuple[str, str]:
        """Act on the verdict: resync when in the minority, move the node's phase. Returns the outcome and the
        digest I hold now."""
        outcome = verdict.outcome
        if verdict.resync:
            # In the minority: download the state the majority confirmed, verified against its digest, within one
            # budget (the round's bound includes it).
            r.enter(Step.RESYNC)
            log.warning("round %d: my state digest is not the group's; resyncing", r.number)
            resync_started = _now()
            try:
                async with asyncio.timeout(r.budget):
                    resynced = await self.fetch_state(
                        list(verdict.holders), verdict.agreed, max_round=r.number + 1, timeout=r.budget
                    )
            except TimeoutError:
                resynced = False
            r.phases["resync_s"] = _now() - resync_started
            outcome = "diverged-resynced" if resynced else "diverged"
            digest = self.outer.digest()
        elif outcome == "diverged":
            # Nobody confirmed my digest (the group left me out, or I lost my links): I do not know the group's
            # state, and a peer still inside the round would serve its state from before the step. Catch up before
            # the next round from peers that announce a later round.
            log.warning("round %d: no member confirmed my state digest; will catch up from the swarm", r.number)
        self.round = max(self.round, r.number + 1)  # a resync may have moved us further
        event = {"diverged-resynced": Event.RESYNCED, "diverged": Event.UNCONFIRMED}.get(outcome, Event.CONFIRMED)
        self.lifecycle.advance(event)
        return outcome, digest

    def _remember(self, round_: int, update: GroupExchange, outcome: str) -> None:
        """Keep the decision of a round I confirmed, to serve to members that could not (``reconcile``); or, for a
        round I could not confirm, what I must set right once I know the decision of those that did."""
        if outcome in ("applied", "fallback"):
            self.ledgers[update.group.group_id] = update.ledger()
            while len(self.ledgers) > _LEDGERS:
                self.ledgers.popitem(last=False)
            self.unsettled = None
        else:
            self.unsettled = update.unsettled(round_)

    async def reconcile(self, timeout: float = LEDGER_TIMEOUT) -> None:
        """Nothing twice, nothing lost, for a member that could not confirm its last round (it heard no reports, or
        its digest was in the minority): it put back into its residual what it sent to the slots it saw fall
        back, but the group may have decided otherwise. Ask the other members for the decision they applied
        (``ledger``); if those that answer agree, move what I sent into or out of my residual to match it.
        Called before the next round (by the node after a catch-up, by the simulator).
        """
        pending, self.unsettled = self.unsettled, None
        if pending is None or self.residual is None:
            return
        group_id = pending.group.group_id

        async def ask(peer: str) -> torch.Tensor | None:
            try:
                answer, _ = await self.transport.call(
                    peer, "ledger", {**self.header, "group": group_id}, timeout=timeout
                )
            except RpcError:
                return None
            return pending.returned(answer.get("ledger"))

        others = [p for p in pending.group.members if p != self.me]
        masks = [m for m in await asyncio.gather(*(ask(p) for p in others)) if m is not None]
        if not masks:
            log.info("round %d: no member told me its decision; my residual keeps my own view", pending.round)
            return
        if any(not torch.equal(m, masks[0]) for m in masks[1:]):
            log.warning("round %d: members told me different decisions; my residual keeps my own view", pending.round)
            return
        change = masks[0].to(self.residual.dtype) - pending.given_back.to(self.residual.dtype)
        if change.any():
            self.residual.add_(pending.sent * change)
            log.info(
                "round %d: the group decided otherwise than I saw; %d values of my update moved %s my residual",
                pending.round, int(change.abs().sum()), "into" if change.sum() > 0 else "out of",
            )  # fmt: skip

    async def _on_ledger(self, sender: str, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        self.check_header(header)
        ledger = self.ledgers.get(header.get("group"))  # type: ignore[arg-type]
        if ledger is None:
            raise Rejected(f"no decision of group {header.get('group')!r} here", code="unknown")
        return {"ledger": ledger}, b""

    def budget_s(self, group: Group) -> float:
        """The budget D of one payload exchange in ``group``: the leader's, so that every member runs the same
        phase deadlines, but never more than ``deadline_factor`` times this member's own deadline (the cap it
        joined with; an honest leader already gave the group the least cap of its members).

        The round's bound after its group formed is ``(2 if mixed else 1) * D + DIGEST_SHARE * D + D``: the
        exchange(s), the digest exchange's relays after the exchange's deadline, and a resync.
        """
        own = self.deadline_s()
        return min(group.deadline_s or own, self.deadline_factor * own)

    def _with_stale(self, delta: torch.Tensor, round_: int) -> torch.Tensor:
        """``delta`` plus the update that missed round ``stale.round``, scaled by 1 / (1 + rounds late).

        The staleness rule for slow or cut-off nodes: a pseudo-gradient computed from an older theta_g still
        points downhill, but less reliably the older it is, so it is damped rather than dropped or applied whole.
        """
        stale = self.lifecycle.stale
        if stale is None:
            return delta
        late = max(1, round_ - stale.round)
        log.info("round %d: adding my update from round %d at weight 1/%d", round_, stale.round, 1 + late)
        self.lifecycle.stale = None
        return delta + stale.update / (1 + late)

    def _allreduce(
        self,
        group: Group,
        vector: torch.Tensor,
        deadline: float,
        codec: BaseCodec | None = None,
        tag: str = "",
        fault: Callable[[int], None] | None = None,
        residual: torch.Tensor | None = None,
        weights: tuple[float, ...] | None = None,
        chunk: int = 0,
        digests: dict[str, str] | None = None,
        hashes: bytes = b"",
        moved: torch.Tensor | None = None,
    ) -> GroupExchange:
        allreduce: GroupExchange
        if codec is None and self.codec_up.sparse:
            allreduce = AllGather(
                group, self.me, vector, self.transport, header=self.header, segments=self.segments,
                deadline=deadline, states=self.codec_states if residual is not None else None, residual=residual,
                on_part_sent=fault, tag=tag, scratch=self._scratch, aggregator=self.aggregator, signer=self.signer,
                equivocate=self.equivocate,
            )  # fmt: skip
        else:
            allreduce = AllReduce(
                group, self.me, vector, self.transport, header=self.header, codec_up=codec or self.codec_up,
                codec_down=codec or self.codec_down, part_numel=self.part_numel, deadline=deadline,
                on_part_sent=fault, tag=tag, scratch=self._scratch, residual=residual,
                aggregator=self.aggregator if codec is None else self.state_aggregator,
                signer=self.signer, equivocate=self.equivocate, verify=self.verify, rng=self.rng,
                alter=self.alter if codec is None else None,
                suspects=self.matchmaker.bans.suspects(group.round) if codec is None else (), weights=weights,
                chunk=chunk, digests=digests, hashes=hashes, moved=moved,
            )  # fmt: skip
        allreduce.withhold = self.withhold
        route = self._route(allreduce.route)
        if not route.done():
            route.set_result(allreduce)
        return allreduce

    def _scratch(self, name: str, numel: int) -> torch.Tensor:
        """A buffer reused from round to round (one round at a time uses it); contents are not cleared."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() != numel:
            buffer = self._buffers[name] = torch.zeros(numel)
        return buffer

    async def _run(self, allreduce: GroupExchange) -> AllReduceResult:
        try:
            return await allreduce.run()
        except BaseException:
            self._forget(allreduce)
            raise

    def _forget(self, allreduce: GroupExchange) -> None:
        """Drop the route after a grace period, so late messages are refused instead of waited on. Until then it
        may be evicted by a new route: a node that runs short rounds must not fill its table with finished ones."""
        self._finished.add(allreduce.route)
        asyncio.get_running_loop().call_later(30, self._drop_route, allreduce.route)

    def _drop_route(self, route: str) -> None:
        self._routes.pop(route, None)
        self._finished.discard(route)
