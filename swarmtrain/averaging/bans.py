"""Bans: a peer caught sending an invalid payload is left out of this node's groups for a number of rounds.

What counts: a payload the exchange refused on its merits (wrong codec, shape or length, non-finite values or
values out of bounds, a frame that does not match the round's schema), never a peer that was merely slow, dead
or late (but see below). Every member of a group receives the same payloads from a sender (each reducer its own
part, every member the whole all-gathered payload), so the honest members of a group ban the same peer in the
same round.

Three offences are banned in steps (``strike``, ``withholder``, ``held``), because an honest peer commits them too
when it is slow once, and each costs the whole group shards of a round or the round's time:

- a reducer that leaves this node's check of its shard unanswered (``averaging.verify``: it sent its results, then
  did not show what it averaged in time). Each such check withholds its shard from the whole group, so a reducer
  that never answered would hold a share of the model still for as long as it stayed;
- a member whose report alone withheld the shards of two or more other reducers (``exchange.withholders``:
  most of the group's reports held each of them with one hash). A shard applies only where every report holds it,
  so such a member unbanned would make its group fall back on all those shards every round. One hostile reducer
  can make an honest member's check of its own shard fail, never of another reducer's: an honest member is struck
  only when its own checks or its own downlink failed for two reducers at once;
- a leader that held this node's join to its join timeout without forming a group (answering pings meanwhile), or
  kept telling it to ask again until its retry window closed (``Matchmaker.form_group``). A peer taken for its
  group's leader (the lowest peer id, which a made-up key can aim for) that did so held every member of its group
  that long every round. Only a call that timed out, or the leader's own "not ready" answer, counts: a broken
  stream, a full group or another refusal does not. An honest leader does the same to a joiner whose join timeout
  (``max(30 s, 3 inner phases)``) ends before it forms its group: one much slower than the joiner, or one that
  waits for a much slower member. That joiner was left out of its group either way; banned, the leader is no
  longer its candidate, and it meets the others or leads, where the others may still follow that leader.

Such a ban lasts ``MUTE_BAN`` rounds (a live peer may have been slow once), and ``averaging.ban_rounds`` where it
is the ``MUTE_STRIKES``-th of its kind within ``MUTE_ROUNDS`` rounds.

A ban acts in group formation: this node does not join a banned peer as its first choice of leader (it still follows
another peer's redirect to it), does not expect it, and refuses its joins (code ``banned``, with the reason) while
leading. It is this node's own decision, logged with its reason and shown in its record (``swarmtrain status``); it
ends by itself after ``averaging.ban_rounds``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

MAX_BANS = 1024  # a node keeps at most this many bans (the newest): identities are cheap, memory is not
MUTE_BAN = 2  # rounds a reducer is banned for a check of its shard it left unanswered
MUTE_STRIKES = 2  # such rounds within MUTE_ROUNDS that ban it for averaging.ban_rounds
MUTE_ROUNDS = 10


@dataclass(frozen=True)
class Ban:
    until: int  # the first round the peer is welcome again
    reason: str


class Bans:
    def __init__(self, me: str, rounds: int) -> None:
        self.me = me
        self.rounds = rounds  # 0: no bans
        self.bans: dict[str, Ban] = {}
        self.strikes: dict[str, list[int]] = {}  # peer -> the recent rounds in which it left a check unanswered
        self.withheld: dict[str, list[int]] = {}  # peer -> the recent rounds in which its report alone withheld shards
        self.disputed: dict[str, int] = {}  # reducer -> the last round some member's report withheld its shard
        self.accused: dict[str, tuple[int, str]] = {}  # member -> the round and reducer it last disputed
        self.holds: dict[str, list[int]] = {}  # peer -> the recent rounds in which it held my join to its end

    def record(self, offenders: dict[str, str], round_: int, rounds: int | None = None) -> None:
        """Ban each of ``offenders`` (peer -> reason) from round ``round_ + 1`` for ``rounds`` rounds (by default
        ``self.rounds``)."""
        if self.rounds <= 0:
            return
        until = round_ + 1 + (self.rounds if rounds is None else rounds)
        for peer, reason in offenders.items():
            if peer == self.me:
                continue
            ban = Ban(until, reason[:200])
            if self.bans.get(peer) == ban:
                continue  # the same offence, recorded again after a later phase of the same round
            self.bans[peer] = ban
            log.warning("banned peer %s until round %d: %s", peer[-8:], until, reason[:200])
        while len(self.bans) > MAX_BANS:
            del self.bans[next(iter(self.bans))]

    def strike(self, peers: set[str], round_: int) -> None:
        """Each of ``peers`` left a check of its shard unanswered in ``round_``: ban it for ``MUTE_BAN`` rounds,
        or for ``self.rounds`` where that is its ``MUTE_STRIKES``-th such round of the last ``MUTE_ROUNDS``."""
        once, again = "left a check of its shard unanswered", "left checks of its shard unanswered"
        self._in_steps(self.strikes, peers, round_, once, again)

    def withholder(self, peers: set[str], round_: int) -> None:
        """Each of ``peers`` alone withheld, in its report for ``round_``, the shards of two or more other reducers
        that most of the group held (``exchange.withholders``): banned in steps, as ``strike``."""
        what = "alone withheld other reducers' shards that most of its group held"
        self._in_steps(self.withheld, peers, round_, f"{what} in its report", f"{what} in its reports")

    def held(self, peers: set[str], round_: int) -> None:
        """Each of ``peers``, asked to lead me in ``round_``, held my join to my join timeout, or kept telling me
        to ask it again until my retry window closed, without forming a group (``Matchmaker.form_group``):
        banned in steps, as ``strike``."""
        what = "held my join to its timeout without forming a group"
        self._in_steps(self.holds, peers, round_, what, what)

    def _in_steps(self, record: dict[str, list[int]], peers: set[str], round_: int, once: str, again: str) -> None:
        for peer in peers - {self.me}:
            rounds = [r for r in record.pop(peer, []) if round_ - MUTE_ROUNDS < r < round_] + [round_]
            if len(rounds) < MUTE_STRIKES:
                record[peer] = rounds
                reason, length = f"{once} in round {round_}", min(MUTE_BAN, self.rounds)
            else:
                reason, length = f"{again} in rounds {', '.join(map(str, rounds))}", None
            self.record({peer: reason}, round_, length)
        while len(record) > MAX_BANS:
            del record[next(iter(record))]

    def dispute(self, withheld: dict[str, set[str]], round_: int) -> None:
        """In ``round_`` the report of each member in ``withheld[reducer]`` withheld that reducer's shard while others
        held it (its check failed, or the shard did not reach it). No ban (a hostile member may withhold anyone's
        shard), but I check the reducer's shard myself from now on: a reducer mute to checks is banned by every
        member that checks it, the leader included, instead of after the rounds in which each happened to pick it.

        A member's withholdings make one reducer at a time a suspect: one whose report disputed another reducer in
        the last ``MUTE_ROUNDS`` rounds disputes no new one. Withholding one other honest reducer's shard a round,
        in turn, one member once made every reducer a suspect, and every member checked every shard every round."""
        for reducer, members in withheld.items():
            accusers = [m for m in members if self._may_accuse(m, reducer, round_)]
            if reducer == self.me or not accusers:
                continue
            for member in accusers:
                self.accused.pop(member, None)
                self.accused[member] = (round_, reducer)
            self.disputed.pop(reducer, None)
            self.disputed[reducer] = round_
        for record in (self.disputed, self.accused):
            while len(record) > MAX_BANS:
                del record[next(iter(record))]

    def _may_accuse(self, member: str, reducer: str, round_: int) -> bool:
        last = self.accused.get(member)
        return last is None or last[1] == reducer or last[0] <= round_ - MUTE_ROUNDS

    def suspects(self, round_: int) -> set[str]:
        """The peers that left a check of mine unanswered, or whose shard a member withheld (``dispute``), within the
        last ``MUTE_ROUNDS`` rounds before ``round_``: this node checks their shards in every round they are in
        (``AllReduce._verify``)."""
        recent = {peer for peer, last in self.disputed.items() if last > round_ - MUTE_ROUNDS}
        return recent | {peer for peer, rounds in self.strikes.items() if rounds[-1] > round_ - MUTE_ROUNDS}

    def reason(self, peer: str, round_: int) -> str | None:
        """Why ``peer`` is banned in ``round_``, or None if it is not."""
        ban = self.bans.get(peer)
        if ban is None or round_ >= ban.until:
            return None
        return f"banned until round {ban.until}: {ban.reason}"

    def active(self, round_: int) -> dict[str, Ban]:
        self.bans = {p: b for p, b in self.bans.items() if round_ < b.until}
        return dict(self.bans)
