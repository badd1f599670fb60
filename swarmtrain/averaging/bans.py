"""Bans: a peer caught sending an invalid payload is left out of this node's groups for a number of rounds.

What counts: a payload the exchange refused on its merits (wrong codec, shape or length, non-finite values or
values out of bounds, a frame that does not match the round's schema), never a peer that was merely slow, dead
or late. Every member of a group receives the same payloads from a sender (each reducer its own part, every
member the whole all-gathered payload), so the honest members of a group ban the same peer in the same round.

A ban acts in group formation: this node does not join a banned peer as its leader, does not expect it, and
refuses its joins (code ``banned``, with the reason) while leading. It is this node's own decision, logged with
its reason and shown in its record (``swarmtrain status``); it ends by itself after ``averaging.ban_rounds``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

MAX_BANS = 1024  # a node keeps at most this many bans (the newest): identities are cheap, memory is not


@dataclass(frozen=True)
class Ban:
    until: int  # the first round the peer is welcome again
    reason: str


class Bans:
    def __init__(self, me: str, rounds: int) -> None:
        self.me = me
        self.rounds = rounds  # 0: no bans
        self.bans: dict[str, Ban] = {}

    def record(self, offenders: dict[str, str], round_: int) -> None:
        """Ban each of ``offenders`` (peer -> reason) from round ``round_ + 1`` for ``rounds`` rounds."""
        if self.rounds <= 0:
            return
        for peer, reason in offenders.items():
            if peer == self.me:
                continue
            ban = Ban(round_ + 1 + self.rounds, reason[:200])
            if self.bans.get(peer) == ban:
                continue  # the same offence, recorded again after a later phase of the same round
            self.bans[peer] = ban
            log.warning("banned peer %s until round %d: %s", peer[-8:], round_ + 1 + self.rounds, reason[:200])
        while len(self.bans) > MAX_BANS:
            del self.bans[next(iter(self.bans))]

    def reason(self, peer: str, round_: int) -> str | None:
        """Why ``peer`` is banned in ``round_``, or None if it is not."""
        ban = self.bans.get(peer)
        if ban is None or round_ >= ban.until:
            return None
        return f"banned until round {ban.until}: {ban.reason}"

    def active(self, round_: int) -> dict[str, Ban]:
        self.bans = {p: b for p, b in self.bans.items() if round_ < b.until}
        return dict(self.bans)
