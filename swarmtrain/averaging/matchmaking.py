"""Group formation: members of a gossip group meet at its leader, who fixes the group once for everyone.

The leader of round r in a gossip group is its lowest live peer id that does not sit in on the round (a member that
just caught up: it joins, refuses joins and never leads). Every other member calls ``join`` on the
leader (a long poll); the leader waits until every expected member has joined or its gather timeout passes,
then answers every waiting joiner with the same member list and weights. A member whose leader is
unreachable tries the next candidate; a member asked to lead while it follows someone else redirects the
asker. A joiner follows one candidate's redirects to peers it has not asked at most ``SENT_ON`` times a round: a
hostile candidate could send it on to made-up peers without end. A leader that held a joiner to its join timeout,
or told it to ask again until its retry window closed, is banned by it in steps (``_held``); a joiner asks no peer
it bans, not even one a candidate sends it on to (it asks that candidate again). Because one peer
decides each group, all its members agree on it, even when views of the swarm differ.

A member that holds the group answers a join from another member with it too. A leader that froze (SIGSTOP) after
answering some of its members leaves the others waiting; they hear of the group first from the exchange messages of
a member that has it (``heard_from``). When their leader keeps them waiting a tenth of a budget after that,
they ask that member for it (a join marked ``probe``, answered at once from a formed group or refused) rather than
lead a group of one, or join the exchange after the others gave up on them.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from swarmtrain.averaging.bans import Bans
from swarmtrain.averaging.group import Group, held_by_most, whose_state_counts
from swarmtrain.errors import IncompatibleSwarm
from swarmtrain.net import PeerUnreachable, Rejected, RemoteError, RpcTimeout, Transport

log = logging.getLogger(__name__)

MAX_WEIGHT = 1e12  # tokens in one round; a peer claiming more would dominate every average
EQUAL_WEIGHT = 1.0  # the weight of a member that trained, where every update counts alike (weighting = equal)
MAX_DEADLINE_S = 3600.0
PROBE_AFTER_S = 1.0  # the longest a member waits on its leader after hearing from a member of its group
PING_EVERY_S, LEADER_PING_S, LEADER_MISSES = 1.0, 1.5, 2  # a joiner pings its leader; two misses: given up on
LEADER_FAILOVER_S = LEADER_MISSES * (PING_EVERY_S + LEADER_PING_S)  # the most a leader that stops answering holds one
PLAUSIBLE_SLACK = 2.0  # a member counts at most twice the tokens its published throughput accounts for
JOIN_SLACK_S = 5.0  # a join call's timeout past the join timeout: a leader's own "not ready" may come first
HELD_WAIT = 3.0  # join timeouts a joiner waits for the others to give up on a leader that held it (``_held``)
SENT_ON = 2  # the most times in a round a member follows one candidate's redirects to peers it has not asked yet


@dataclass
class Lobby:
    round: int
    joined: dict[str, float] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    caps: dict[str, float] = field(default_factory=dict)  # the longest budget each joiner accepts
    certs: dict[str, Any] = field(default_factory=dict)  # the certificate each joiner's state came with, if any
    redirect: str | None = None
    leads: bool = True  # whether I may lead this round's group (``form_group``'s ``lead``)
    redirected: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    result: asyncio.Future[Group] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    formed_at: float = 0.0  # the loop's time when ``result`` was set

    def settle(self, group: Group) -> None:
        """The group of this round as I know it: led by me, or learned from the leader (or a member)."""
        if not self.result.done():
            self.result.set_result(group)
            self.formed_at = asyncio.get_running_loop().time()

    def answer(self) -> dict[str, Any]:
        """The group, as the leader tells it to its members, and how long ago I learned it (``Group.age_s``)."""
        group = self.result.result()
        answer = {
            "members": list(group.members), "weights": list(group.weights), "mixed": group.mixed,
            "deadline_s": group.deadline_s, "age_s": asyncio.get_running_loop().time() - self.formed_at,
        }  # fmt: skip
        if group.counted:
            answer.update(digests=list(group.digests), certs=group.certs)
        return answer


def check_weight(weight: Any, bound: float = MAX_WEIGHT) -> float:
    """A claimed token weight, refused unless finite and in [0, ``bound``] (``EQUAL_WEIGHT`` where every update
    counts alike: a member claiming more there would count as many)."""
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
        raise Rejected(f"weight {weight!r} is not a finite number")
    if not 0 <= weight <= bound:
        alike = " (this swarm weights every update alike: averaging.weighting = equal)"
        raise Rejected(f"weight {weight!r} is out of bounds [0, {bound:g}]{alike if bound == EQUAL_WEIGHT else ''}")
    return float(weight)


def _miss_kind(exc: Exception) -> str:
    """Why a join failed, in one word: "late" (the group had formed or the round was over), "banned" (the leader
    bans me), "unreachable" or "refused"; the node names its state after it."""
    if isinstance(exc, RemoteError) and exc.code == "banned":
        return "banned"
    if isinstance(exc, RemoteError) and (exc.code == "over" or "already formed" in str(exc)):
        return "late"
    if isinstance(exc, PeerUnreachable | RpcTimeout):
        return "unreachable"
    return "refused"


def _unanswered(exc: Exception) -> bool:
    """Whether a join that failed was held unanswered: my call timed out while the leader answered my pings
    (``Matchmaker._join``), or the leader let it wait out its own join timeout. Not a broken stream (the leader
    may have put me in its group), a full group or any other refusal: an honest leader gives those."""
    return isinstance(exc, RpcTimeout) or (isinstance(exc, RemoteError) and exc.code == "not-ready")


class Matchmaker:
    def __init__(
        self,
        transport: Transport,
        header: dict[str, Any],
        group_size: int,
        min_budget_s: float = 0.0,
        max_weight: float = MAX_WEIGHT,
        probe_after: float = PROBE_AFTER_S,
    ) -> None:
        self.transport = transport
        self.me = transport.peer_id
        self.header = header
        self.group_size = group_size
        # A joiner's cap below this is raised to it: one joiner cannot starve the whole group of time.
        self.min_budget_s = min_budget_s
        # The largest weight a member may claim, in joins and in a leader's group: ``EQUAL_WEIGHT`` in a swarm that
        # weights every update alike, where a hostile member would otherwise still claim a million tokens.
        self.max_weight = max_weight
        self.lobbies: dict[int, Lobby] = {}
        self.join_timeout = 60.0
        self.bans = Bans(self.me, 0)  # set by the averager (``averaging.ban_rounds``)
        self.misses: list[tuple[str, str, str]] = []  # this round's leaders I could not join: (peer, kind, why)
        # Peers whose exchange messages reached me for a group I have not heard of (``heard_from``): members of a
        # group my leader formed, should its answer never come. Peer -> the route of their messages, and when.
        self.heard: dict[str, tuple[str, float]] = {}
        # How long a member waits on its leader after hearing from a member of its group: a tenth of the shortest
        # budget a group may run (``Averager``), well before that member's messages to me time out.
        self.probe_after = probe_after
        # The tokens the given peers' published records account for in a round (``Membership.published_tokens``):
        # set by a node whose swarm caps weights (``plausible_weights``); None: no such cap.
        self.published_tokens: Callable[[list[str], int], Awaitable[Mapping[str, float]]] | None = None
        # Set while this node catches up with the swarm: it will not lead a round it is behind on, so joiners are
        # sent on to the next candidate at once instead of waiting on it until their join timeout. A joiner that
        # holds my round and state is told to ask again instead (see ``_while_catching_up``).
        self._catching_up = asyncio.Event()
        # Checks a state's certificate (``RoundSigner.check_held``): set in a signed swarm, where a leader tells its
        # group whose states count in a mix (``Group.counted``) and each member checks it. None: everyone's count.
        self.check_held: Callable[[str, str, int, Any], str | None] | None = None
        # Tests only (attack.kind = redirect, hold, ask-again): a hostile peer's answer to every join, given my id.
        self.hostile_join: Callable[[str], Awaitable[dict[str, Any]]] | None = None

    @property
    def catching_up(self) -> bool:
        return self._catching_up.is_set()

    @catching_up.setter
    def catching_up(self, value: bool) -> None:
        """While set, joins are refused with code ``behind``, those already waiting on me too."""
        if value:
            self._catching_up.set()
        else:
            self._catching_up.clear()

    def _lobby(self, round_: int) -> Lobby:
        if round_ not in self.lobbies:
            self.lobbies[round_] = Lobby(round_)
            for old in [r for r in self.lobbies if r < round_ - 2]:
                del self.lobbies[old]
        return self.lobbies[round_]

    async def on_join(
        self, sender: str, header: dict[str, Any], position: Callable[[], tuple[int, str]]
    ) -> dict[str, Any]:
        """Answer a join: the group once it formed, a redirect, or a refusal. ``position`` gives this node's round
        and theta_g digest now (both may change while the join waits)."""
        if self.hostile_join is not None:  # tests only: a hostile peer answers its own way whatever the round
            return await self.hostile_join(self.me)
        round_ = header.get("round")
        current_round = position()[0]
        if not isinstance(round_, int) or round_ < current_round:
            raise Rejected(f"round {round_!r} is over (this peer is at round {current_round})", code="over")
        if round_ > current_round + 1:
            raise Rejected(f"round {round_} is too far ahead of this peer's round {current_round}")
        banned = self.bans.reason(sender, round_)
        if banned is not None:
            raise Rejected(f"you are {banned}", code="banned")
        weight = check_weight(header.get("weight"), self.max_weight)
        digest = header.get("digest")
        if not isinstance(digest, str) or len(digest) > 64:
            raise Rejected("join must carry the digest of the joiner's theta_g")
        cap = header.get("cap_s", MAX_DEADLINE_S)
        if isinstance(cap, bool) or not isinstance(cap, int | float) or not 0.0 < cap <= MAX_DEADLINE_S:
            raise Rejected(f"budget cap {cap!r} is not in (0, {MAX_DEADLINE_S:g}] seconds")
        lobby = self._lobby(round_)
        if header.get("probe") is True:
            return self._on_probe(lobby, sender)
        if self.catching_up:
            return self._while_catching_up(round_, digest, position)
        if lobby.result.done():
            if sender in lobby.result.result().members:  # asking again: the answer to its first join was lost
                return lobby.answer()
            raise Rejected(f"the group of round {round_} is already formed")
        if lobby.redirect is not None:
            return self._redirect(lobby, sender)
        lobby.joined[sender] = weight
        lobby.digests[sender] = digest
        if "cert" in header:
            lobby.certs[sender] = header["cert"]
        lobby.caps[sender] = max(float(cap), self.min_budget_s)
        lobby.changed.set()
        redirected = asyncio.ensure_future(lobby.redirected.wait())
        behind = asyncio.ensure_future(self._catching_up.wait())
        try:
            await asyncio.wait(
                [lobby.result, redirected, behind], timeout=self.join_timeout, return_when="FIRST_COMPLETED"
            )
        finally:
            redirected.cancel()
            behind.cancel()
        if lobby.result.done():
            group = lobby.result.result()
            if sender not in group.members:
                raise Rejected(f"the group of round {round_} is full")
            return lobby.answer()
        lobby.joined.pop(sender, None)
        if lobby.redirect is not None:
            return self._redirect(lobby, sender)
        if self.catching_up:
            return self._while_catching_up(round_, digest, position)
        raise Rejected(f"the leader of round {round_} was not ready in time", code="not-ready")

    def _on_probe(self, lobby: Lobby, sender: str) -> dict[str, Any]:
        """A member of my group whose leader stopped answering asks me for the group: answered at once, never
        waited on (a probe joins no lobby)."""
        if lobby.result.done() and sender in lobby.result.result().members:
            return lobby.answer()
        raise Rejected(f"no group of round {lobby.round} with you in it here", code="no-group")

    def heard_from(self, peer: str, route: str) -> None:
        """An exchange message from ``peer`` for a group I have not claimed (``route``: its id and a tag)."""
        if peer != self.me and len(self.heard) < self.group_size:
            self.heard.setdefault(peer, (route, asyncio.get_running_loop().time()))

    def _redirect(self, lobby: Lobby, sender: str) -> dict[str, Any]:
        """Send a joiner on to the leader I follow. When that leader is the joiner itself (it asks me while I ask
        it: each took the other for its leader, as two whose views of the swarm differ can), the lower peer id
        leads: told "ask me again" by the lower one and "lead" by the higher one, both agree. Each
        telling the other to lead, both led a group of one and diverged. A member that sits in on the round (it
        leads no group, ``form_group``) refuses instead: the joiner asks its next candidate, as the others do."""
        if not lobby.leads:
            raise Rejected(f"this peer sits in on round {lobby.round} and leads no group", code="sits-in")
        if lobby.redirect == sender and self.me < sender:
            return {"redirect": self.me}
        return {"redirect": lobby.redirect}

    def _while_catching_up(self, round_: int, digest: str, position: Callable[[], tuple[int, str]]) -> dict[str, Any]:
        """A join that reached me while I catch up. A joiner at my round holding my theta_g is in step with me: I
        am not behind it, and my catch-up ends as soon as I see it (a member and I both kept theta_g through a
        round neither could average, as when a peer froze). It is told to ask me again (a redirect to myself):
        sent on, it would lead a group of its own while I, its first candidate, lead another, and both of us
        would diverge. Any other joiner is refused with code ``behind`` and goes on to its next candidate."""
        current_round, current_digest = position()
        if (round_, digest) == (current_round, current_digest):
            return {"redirect": self.me}
        raise Rejected(f"this peer is catching up with the swarm (from round {current_round})", code="behind")

    async def form_group(
        self,
        round_: int,
        weight: float,
        digest: str,
        candidates: list[str],
        expected: set[str],
        gather_timeout: float,
        deadline_s: float = 0.0,
        cap_s: float = MAX_DEADLINE_S,
        cert: dict[str, Any] | None = None,
        lead: bool = True,
    ) -> Group:
        """Meet the others of my gossip group for ``round_``; a group of one if nobody can be reached.

        ``deadline_s`` is the budget I propose if I lead, ``cap_s`` the longest I accept: a leader gives its group
        the least of its proposal and every member's cap, so that every member runs the same phase deadlines (a
        member that capped the leader's budget on its own would decide while a live member's report is still
        due, from a different view than the others). ``cert``: another peer's certificate of my state. ``lead``:
        whether I may lead; a member that just caught up (weight 0, sitting in) does not, even as the first
        candidate: it joins the group the others form, or none. Led by it, a group of such members (the others'
        already formed) would move their theta_g by the outer momentum alone, off the line they just caught up to.
        """
        lobby = self._lobby(round_)
        lobby.leads = lead
        banned = self.bans.active(round_)
        if banned:
            candidates = [c for c in candidates if c not in banned]
            expected = expected - banned.keys()
        # A peer I ban is not asked, not even where a candidate sends me on to it: I ask that candidate again (one
        # that held my join last round held me again through an honest peer that had not banned it yet).
        queue, tried = list(candidates), {*banned, *(() if lead else (self.me,))}
        broken: dict[str, float] = {}  # the candidates whose stream broke, and when I first asked each
        sent_on: Counter[str] = Counter()  # how often each candidate sent me on to a peer I had not asked yet
        loop = asyncio.get_running_loop()
        self.misses = []
        self.heard = {}
        # A peer that redirects to a leader I found dead is failing over itself: it pings that leader a few times
        # (seconds under load) before it leads; ask it again until then rather than lead a group of my own. The
        # same for a leader catching up that holds my state: it redirects me to itself until it is done.
        retry_until = loop.time() + gather_timeout + self.join_timeout
        held: dict[str, float] = {}  # the candidates that held me this round (``_held``), and until when I wait
        while queue:
            candidate = queue.pop(0)
            if candidate in tried:
                continue
            tried.add(candidate)
            if candidate == self.me:
                return await self._lead(
                    lobby, weight, digest, expected, gather_timeout, min(deadline_s, cap_s), cert
                )  # fmt: skip
            lobby.redirect = candidate
            lobby.redirected.set()
            lobby.redirected = asyncio.Event()
            request = {**self.header, "round": round_, "weight": weight, "digest": digest, "cap_s": cap_s}
            if cert is not None:
                request["cert"] = cert
            # Asked again after a broken stream, a candidate gets only the rest of my first ask's join timeout:
            # a peer that holds me is given up on (and banned) one join timeout after I first asked, not two.
            asked = broken.get(candidate, loop.time())
            try:
                answer = await self._join(candidate, request, self.join_timeout - (loop.time() - asked))
            except (PeerUnreachable, RpcTimeout, RemoteError) as exc:
                if isinstance(exc, RemoteError) and exc.code == "incompatible":
                    raise IncompatibleSwarm(
                        f"this node cannot train with the swarm: the peer answered: {exc}"
                    ) from None
                log.info("round %d: could not join %s: %s", round_, candidate[-8:], exc)
                waited = loop.time() - asked
                if waited >= self.join_timeout and _unanswered(exc):  # it answered my pings, formed no group
                    held[candidate] = self._held(candidate, round_, f"held my join {waited:.0f} s")
                else:
                    self.misses.append((candidate, _miss_kind(exc), str(exc)))
                if weight == 0 and isinstance(exc, RemoteError) and exc.code == "over":
                    break  # an observer behind the swarm: nothing to lead with, catch up again at once
                if isinstance(exc, PeerUnreachable) and candidate not in broken:
                    # The stream broke, maybe after the leader put me in its group: ask once more (a leader
                    # answers a repeated join with the group it formed), or the group waits for me in vain.
                    broken[candidate] = asked
                    tried.discard(candidate)
                    queue.insert(0, candidate)
                    await asyncio.sleep(0.2)
                continue
            if "redirect" in answer:
                target = answer["redirect"]
                if not isinstance(target, str) or (sent_on[candidate] >= SENT_ON and target not in tried):
                    # A candidate that keeps sending me on to peers I have not asked (a hostile one, to made-up
                    # ids, a new one each time) would hold me for ever: it is asked no more this round.
                    continue
                if target not in tried:
                    # The candidate follows that leader; if it refuses me, it refuses the candidate too, who then
                    # leads or follows its next one: ask the candidate again rather than skip it (skipped, it led
                    # a group that waited for me while I led one of my own).
                    sent_on[candidate] += 1
                    tried.discard(candidate)
                    queue[:0] = [target, candidate]
                elif loop.time() < max(retry_until, held.get(target, 0.0)):
                    tried.discard(candidate)
                    queue.insert(0, candidate)
                    await asyncio.sleep(0.3)
                elif target == candidate:
                    held[candidate] = self._held(candidate, round_, "told me to ask it again until my window closed")
                continue
            group = self._parse_group(round_, answer, request)
            if group is not None:
                lobby.settle(group)  # kept for members that ask me for it (a repeated join, a probe)
                return group
        lobby.redirect = None
        group = Group(round_, (self.me,), (weight,))
        lobby.settle(group)
        return group

    def _held(self, candidate: str, round_: int, how: str) -> float:
        """``candidate`` held me in ``round_`` without forming a group, ``how``: banned in steps (``Bans.held``).
        A hostile peer taken for its group's leader held every member that long every round; a slow honest one
        does too, and a joiner is better off not waiting on it.

        The others it held give up on it too, each at its own join timeout (which differ with inner phases), and
        the next candidate leads. Until then that one, or a peer that follows it, still sends me to the peer that
        held me: I ask it again until ``HELD_WAIT`` join timeouts of mine from now (the time returned), not only
        until my retry window closes (closed, I led a group of one beside theirs)."""
        why = f"{candidate[-8:]} {how} without forming a group"
        log.info("round %d: %s", round_, why)
        self.misses.append((candidate, "held", why))
        self.bans.held({candidate}, round_)
        return asyncio.get_running_loop().time() + HELD_WAIT * self.join_timeout

    async def _join(self, leader: str, request: dict[str, Any], wait_s: float) -> dict[str, Any]:
        """Long-poll the leader for up to ``wait_s`` (past which it is late, ``JOIN_SLACK_S``), pinging it meanwhile:
        a leader that stops answering pings is given up on at once instead of after the whole wait (its daemon may
        linger after the process died)."""
        timeout = max(wait_s, 0.0) + JOIN_SLACK_S
        call = asyncio.ensure_future(self.transport.call(leader, "join", request, timeout=timeout))
        loop = asyncio.get_running_loop()
        misses, ping_at = 0, loop.time() + PING_EVERY_S
        probed: set[str] = set()
        try:
            while True:
                done, _ = await asyncio.wait([call], timeout=min(self.probe_after, PING_EVERY_S))
                if done:
                    answer, _ = call.result()
                    return answer
                # Members send me their group's messages while my leader has not answered me (it may have frozen
                # after answering them): ask them for that group before their messages to me time out.
                if (answer := await self._probe(leader, request, probed)) is not None:
                    return answer
                if loop.time() < ping_at:
                    continue
                try:
                    await self.transport.call(leader, "ping", self.header, timeout=LEADER_PING_S)
                    misses = 0
                except (RpcTimeout, PeerUnreachable):  # one broken ping under load is not a dead leader
                    misses += 1
                    if misses >= LEADER_MISSES:
                        raise
                ping_at = loop.time() + PING_EVERY_S
        finally:
            call.cancel()

    async def _probe(self, leader: str, request: dict[str, Any], probed: set[str]) -> dict[str, Any] | None:
        """Ask the members I heard from (once each, ``probe_after`` after I did) for the group they exchange in: its
        answer if that is the group of their messages and holds the leader and the member asked."""
        round_ = request["round"]
        asked_by = asyncio.get_running_loop().time() - self.probe_after
        for peer, (route, heard_at) in list(self.heard.items()):
            if peer in probed or peer == leader or heard_at > asked_by:
                continue
            probed.add(peer)
            try:
                answer, _ = await self.transport.call(peer, "join", {**request, "probe": True}, timeout=2.0)
            except (PeerUnreachable, RpcTimeout, RemoteError) as exc:
                log.info("round %d: %s has no group for me: %s", round_, peer[-8:], exc)
                continue
            group = self._parse_group(round_, answer, request)
            if group is not None and {peer, leader} <= set(group.members) and route.startswith(group.group_id):
                log.info("round %d: leader %s stopped answering; %s told me its group", round_, leader[-8:], peer[-8:])
                return answer
        return None

    def _parse_group(self, round_: int, answer: dict[str, Any], request: dict[str, Any]) -> Group | None:
        """The group in a leader's (or member's) ``answer`` to my join ``request``, or None if it is malformed, or
        does not hold me, or (signed swarm) says whose state counts other than its certificates show."""
        members, weights = answer.get("members"), answer.get("weights")
        try:
            if not isinstance(members, list) or not isinstance(weights, list) or len(members) != len(weights):
                raise Rejected("malformed group")
            if not all(isinstance(m, str) for m in members) or len(set(members)) != len(members):
                raise Rejected("malformed member list")
            mixed, deadline_s = answer.get("mixed", False), answer.get("deadline_s", 0.0)
            age_s = answer.get("age_s", 0.0)
            if not isinstance(mixed, bool):
                raise Rejected("malformed mixed flag")
            for name, value in (("deadline", deadline_s), ("age", age_s)):
                if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= MAX_DEADLINE_S:
                    raise Rejected(f"{name} {value!r} out of bounds")
            weights_ = tuple(check_weight(w, self.max_weight) for w in weights)
            group = Group(round_, tuple(members), weights_, mixed, float(deadline_s), float(age_s))
            if self.check_held is not None and self.me in group.members:
                group = self._check_counted(group, answer, request)
        except Rejected as exc:
            log.warning("round %d: leader sent a bad group: %s", round_, exc)
            return None
        return group if self.me in group.members else None

    def _check_counted(self, group: Group, answer: dict[str, Any], request: dict[str, Any]) -> Group:
        """``group`` with whose state counts, from the digests and certificates in the answer by the leader's own
        rule (``whose_state_counts``), checked: whether the group mixes follows from them, my own digest is the
        one I joined with, and my certificate, where it holds and is needed, is among them (a leader that left it
        out could make a state of its own count where mine should)."""
        check = self.check_held
        assert check is not None
        digests, certs = answer.get("digests"), answer.get("certs")
        if not isinstance(digests, list) or len(digests) != group.size or not all(isinstance(d, str) for d in digests):
            raise Rejected("the group does not hold its members' digests")
        if not isinstance(certs, dict) or not set(certs) <= set(group.members):
            raise Rejected("malformed certificates")
        me = group.index(self.me)
        if digests[me] != request["digest"]:
            raise Rejected(f"the group holds digest {digests[me]!r} for me, not the one I joined with")

        def holds(member: str, digest: str, cert: Any) -> bool:
            return check(member, digest, group.round, cert) is None

        kept, counted, mixed = whose_state_counts(group.members, digests, certs, holds)
        if (
            not held_by_most(digests, digests[me])
            and self.me not in kept
            and holds(self.me, digests[me], request.get("cert"))
        ):
            raise Rejected("the group left out my state's certificate")
        if group.mixed != mixed:
            raise Rejected("whether the group mixes is not what its digests and certificates show")
        return replace(group, counted=tuple(counted), digests=tuple(digests), certs=kept)

    async def _drop_unreachable(self, lobby: Lobby, expected: set[str]) -> None:
        """While the leader waits, forget expected members whose daemon is gone (a crash before joining)."""
        while True:
            await asyncio.sleep(0.5)
            for peer in sorted(expected - lobby.joined.keys() - {self.me}):
                try:
                    await self.transport.call(peer, "ping", self.header, timeout=2.0)
                except PeerUnreachable:
                    expected.discard(peer)
                except (RpcTimeout, RemoteError):
                    pass

    def _moved_on(self, round_: int) -> bool:
        """Whether peers have asked me to lead a later round than ``round_``."""
        return any(lobby.joined for r, lobby in self.lobbies.items() if r > round_)

    async def _lead(
        self,
        lobby: Lobby,
        weight: float,
        digest: str,
        expected: set[str],
        gather_timeout: float,
        deadline_s: float,
        cert: dict[str, Any] | None = None,
    ) -> Group:
        lobby.redirect = None
        lobby.joined[self.me] = weight
        lobby.digests[self.me] = digest
        if cert is not None:
            lobby.certs[self.me] = cert
        loop = asyncio.get_running_loop()
        deadline = loop.time() + gather_timeout
        # Alone at the gather timeout while live members are expected (one still finishing the last round under
        # load): a group of one would only diverge, so wait up to one all-reduce deadline more for them, unless
        # peers already meet for a later round (then I am the one behind).
        lonely_deadline = deadline + deadline_s
        expected = set(expected)
        prober = asyncio.create_task(self._drop_unreachable(lobby, expected))
        try:
            while not expected <= lobby.joined.keys() and len(lobby.joined) < self.group_size:
                alone = len(lobby.joined) == 1 and bool(expected - {self.me}) and not self._moved_on(lobby.round)
                remaining = (lonely_deadline if alone else deadline) - loop.time()
                if remaining <= 0:
                    break
                lobby.changed.clear()
                try:
                    await asyncio.wait_for(lobby.changed.wait(), min(remaining, 0.5))
                except TimeoutError:
                    pass
        finally:
            prober.cancel()
        members = sorted(lobby.joined)[: self.group_size]
        if self.me not in members:
            members = sorted([*members[:-1], self.me])
        digests = [lobby.digests[m] for m in members]
        mixed, counted, certs = len(set(digests)) > 1, [], {}
        if (check := self.check_held) is not None:
            # Certificates only where they count for something: the answer is a header, bounded (``MAX_HEADER``).
            certs, counted, mixed = whose_state_counts(
                members, digests, lobby.certs, lambda m, d, cert: check(m, d, lobby.round, cert) is None
            )  # fmt: skip
        if deadline_s > 0:
            deadline_s = min([deadline_s, *(lobby.caps[m] for m in members if m in lobby.caps)])
        weights = [lobby.joined[m] for m in members]
        if self.published_tokens is not None:
            published = await self.published_tokens([m for m in members if m != self.me], lobby.round)
            weights = plausible_weights(lobby.round, members, weights, self.me, published)
        group = Group(
            lobby.round, tuple(members), tuple(weights), mixed, deadline_s, counted=tuple(counted),
            digests=tuple(digests) if counted else (), certs=certs,
        )  # fmt: skip
        lobby.settle(group)
        missing = expected - set(members)
        if missing:
            log.info("round %d: formed a group of %d without %s", lobby.round, group.size, [m[-8:] for m in missing])
        return group


def plausible_weights(
    round_: int, members: list[str], weights: list[float], me: str, published: Mapping[str, float]
) -> list[float]:
    """A leader's cap on its members' token weights, from what their published records make plausible.

    A member counts at most ``PLAUSIBLE_SLACK`` times the tokens its record accounts for (``tokens_per_s`` times
    ``inner_s``). An honest node publishes the round's own before it joins; a leader whose view lags holds the one
    of the round before, and the slack covers a round that ran faster than that one. A member with no such record
    (a newcomer, or one that never publishes) counts at most the group's median weight, the lower one of an even
    count (in a group of two, the leader's). The leader's own weight is its own. These are the group's agreed
    weights, which every member caps again relative to the group's median (``Aggregator.cap``).

    What this does not do: a record is a claim, signed by the peer it describes, so a peer that lies in its record
    as much as in its join is bounded only by the median cap. What it does: a weight is bound to a public claim
    that every peer sees (``swarmtrain status``, the dashboard), so a member counts no more than the throughput it
    shows the swarm, and one that shows none counts as a typical member at most."""
    contributors = sorted(w for w in weights if w > 0)
    typical = contributors[(len(contributors) - 1) // 2] if contributors else 0.0
    capped = []
    for peer, weight in zip(members, weights, strict=True):
        tokens = published.get(peer, 0.0)  # 0: no record, or one of no training, which says nothing
        limit = PLAUSIBLE_SLACK * tokens if tokens > 0 else typical
        if peer == me or weight <= limit:
            capped.append(weight)
            continue
        if tokens > 0:
            log.warning("round %d: counting %s at %g tokens, not %g: its record accounts for %g", round_,
                        peer[-8:], limit, weight, tokens)  # fmt: skip
        else:
            log.info("round %d: counting %s at %g tokens, not %g: no record of its throughput yet", round_,
                     peer[-8:], limit, weight)  # fmt: skip
        capped.append(limit)
    return capped
