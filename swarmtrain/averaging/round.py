"""The round as an explicit state machine: the node's phases between rounds, the steps inside one, the decisions.

A node is in one ``Phase`` between its rounds; ``Lifecycle.advance`` is the one place it changes, by the
``TRANSITIONS`` table (an event the table does not list for the phase raises ``InvalidTransition``)::

      start --> SOLO --APPLIED_ALONE, FOUND_IN_STEP, NO_DONOR--> SOLO
                SOLO --CONFIRMED, RESYNCED-----------------------> IN_STEP
                SOLO --NO_GROUP, UNCONFIRMED, FAILED, OFF_SWARM--> CATCH_UP
                SOLO --SYNCED (a joiner's sync on start)---------> OBSERVE
             IN_STEP --CONFIRMED, RESYNCED-----------------------> IN_STEP
             IN_STEP --NO_GROUP, UNCONFIRMED, FAILED, OFF_SWARM--> CATCH_UP
            CATCH_UP --SYNCED--------------------------------------> OBSERVE
            CATCH_UP --FOUND_IN_STEP-------------------------------> SOLO or IN_STEP, whichever it was (``solo``)
            CATCH_UP --NO_DONOR------------------------------------> SOLO
            CATCH_UP --CONFIRMED, RESYNCED-------------------------> IN_STEP   } a round run without catching
            CATCH_UP --APPLIED_ALONE, NO_GROUP, UNCONFIRMED, FAILED-> CATCH_UP  } up first (direct callers only)
             OBSERVE --CONFIRMED, RESYNCED-----------------------> IN_STEP   (the round it sat in on)
             OBSERVE --APPLIED_ALONE-----------------------------> SOLO
             OBSERVE --NO_GROUP, UNCONFIRMED, FAILED-------------> CATCH_UP
      SOLO, IN_STEP, CATCH_UP, OBSERVE --LEAVE--> LEAVING   (terminal: it stops after the round it was in)
      SOLO, IN_STEP, OBSERVE ----------FINISH--> DONE      (terminal: a node in CATCH_UP catches up first)

``Lifecycle.solo`` is the standing CATCH_UP and OBSERVE return to: SOLO until a round with others (whatever its
outcome), and again once a catch-up found no one to download from. A round of one applies its update only when
solo and nobody else was expected (``alone_applies``); otherwise it would fork theta_g. The update such a round
could not contribute waits in ``Lifecycle.stale`` for the next one (the staleness rule).

Inside one round the averager walks the ``Step``s GATHER -> [MIX] -> EXCHANGE -> DIGEST -> [RESYNC] -> DONE (a
round of one: GATHER -> DONE; ``STEP_ORDER``). Each step is an awaitable of ``Averager`` that takes the round's
data and returns what it produced; the outcome is ``decide``, a pure function of the data the members agreed on.
No step touches the trainer: a later overlap of communication with compute can run the next inner phase while
EXCHANGE is in flight, since nothing here assumes the trainer is idle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import torch

from swarmtrain.averaging.exchange import digest_vote


class Phase(StrEnum):
    SOLO = "solo"
    """Has not averaged with others yet (or found no one to catch up from): a round of one applies its update."""
    IN_STEP = "in_step"
    """Averaged with others: a round of one keeps theta_g and catches up instead of forking it."""
    CATCH_UP = "catch_up"
    """Its theta_g may not be the swarm's: it downloads the state before its next round."""
    OBSERVE = "observe"
    """Caught up: sits in with weight 0 on the round it caught up into (joins a group, does not lead one)."""
    LEAVING = "leaving"
    """Asked to leave: stopped after the round it was in (which it finished and contributed to)."""
    DONE = "done"
    """Finished its rounds; serves its final state to peers behind."""


class Event(StrEnum):
    APPLIED_ALONE = "applied_alone"
    """A round of one applied its own update (solo, and nobody else was expected)."""
    NO_GROUP = "no_group"
    """A round of one although peers were live (or it had averaged before): it kept theta_g."""
    CONFIRMED = "confirmed"
    """A round with others ended with its state confirmed (applied or fallback)."""
    RESYNCED = "resynced"
    """A round with others left it in the minority of the digest vote; it downloaded the majority's state."""
    UNCONFIRMED = "unconfirmed"
    """A round with others ended with nobody confirming its state, or its resync failed."""
    FAILED = "failed"
    """The round broke (an error in the node's round): its state is unknown."""
    SYNCED = "synced"
    """Catch-up: downloaded the state most peers ahead hold."""
    FOUND_IN_STEP = "found_in_step"
    """Catch-up: peers hold its round and state (no one is ahead): nothing to download."""
    NO_DONOR = "no_donor"
    """Catch-up: no peer to download from before the deadline: it trains on alone."""
    OFF_SWARM = "off_swarm"
    """Between rounds: its round has been more than one from the swarm's for a while (``membership.off_swarm``):
    it holds another state than the swarm (a split that healed) and takes the swarm's, even from a lower round."""
    LEAVE = "leave"
    """It stops taking rounds because it was asked to leave."""
    FINISH = "finish"
    """It ran its rounds (or its time)."""


_ROUND_ENDS = {
    Event.APPLIED_ALONE: Phase.SOLO,
    Event.NO_GROUP: Phase.CATCH_UP,
    Event.CONFIRMED: Phase.IN_STEP,
    Event.RESYNCED: Phase.IN_STEP,
    Event.UNCONFIRMED: Phase.CATCH_UP,
    Event.FAILED: Phase.CATCH_UP,
}
# None: back to the standing it caught up from (SOLO or IN_STEP, ``Lifecycle.solo``).
TRANSITIONS: dict[tuple[Phase, Event], Phase | None] = {
    **{(Phase.SOLO, e): p for e, p in _ROUND_ENDS.items()},
    (Phase.SOLO, Event.SYNCED): Phase.OBSERVE,  # a joiner's sync on start
    (Phase.SOLO, Event.FOUND_IN_STEP): Phase.SOLO,
    (Phase.SOLO, Event.NO_DONOR): Phase.SOLO,
    (Phase.SOLO, Event.OFF_SWARM): Phase.CATCH_UP,
    (Phase.IN_STEP, Event.OFF_SWARM): Phase.CATCH_UP,
    **{(Phase.IN_STEP, e): p for e, p in _ROUND_ENDS.items() if e is not Event.APPLIED_ALONE},
    **{(Phase.OBSERVE, e): p for e, p in _ROUND_ENDS.items()},
    # A round in CATCH_UP (only a caller that runs rounds without catching up first): one that put it in step
    # with a group ends it; one that did not leaves it behind.
    **{(Phase.CATCH_UP, e): Phase.CATCH_UP for e in _ROUND_ENDS},
    (Phase.CATCH_UP, Event.CONFIRMED): Phase.IN_STEP,
    (Phase.CATCH_UP, Event.RESYNCED): Phase.IN_STEP,
    (Phase.CATCH_UP, Event.SYNCED): Phase.OBSERVE,
    (Phase.CATCH_UP, Event.FOUND_IN_STEP): None,
    (Phase.CATCH_UP, Event.NO_DONOR): Phase.SOLO,
    **{(p, Event.LEAVE): Phase.LEAVING for p in (Phase.SOLO, Phase.IN_STEP, Phase.CATCH_UP, Phase.OBSERVE)},
    **{(p, Event.FINISH): Phase.DONE for p in (Phase.SOLO, Phase.IN_STEP, Phase.OBSERVE)},
}
_GROUP_ROUNDS = frozenset({Event.CONFIRMED, Event.RESYNCED, Event.UNCONFIRMED})  # a round with others


class InvalidTransition(RuntimeError):
    """An event the phase does not allow: a bug in the caller, not a network condition."""


def next_phase(phase: Phase, event: Event, solo: bool) -> tuple[Phase, bool]:
    """The phase after ``event`` in ``phase``, and whether the node is solo after it (``Lifecycle.solo``)."""
    if (phase, event) not in TRANSITIONS:
        raise InvalidTransition(f"{event} is not a transition of {phase}")
    target = TRANSITIONS[phase, event]
    if event in _GROUP_ROUNDS:
        solo = False
    elif event is Event.NO_DONOR:
        solo = True
    if target is None:
        target = Phase.SOLO if solo else Phase.IN_STEP
    return target, solo


@dataclass
class Stale:
    """An update that missed round ``round`` (no group took it in): it joins a later one, damped."""

    update: torch.Tensor
    round: int


@dataclass
class Lifecycle:
    """The node's phase between rounds, whether it is solo, and the update waiting for a later round."""

    phase: Phase = Phase.SOLO
    solo: bool = True
    stale: Stale | None = None

    def advance(self, event: Event) -> Phase:
        self.phase, self.solo = next_phase(self.phase, event, self.solo)
        return self.phase

    @property
    def behind(self) -> bool:
        """Whether it must catch up before its next round."""
        return self.phase is Phase.CATCH_UP


# ---- inside one round -------------------------------------------------------------------------------------------


class Step(StrEnum):
    GATHER = "gather"
    """Form the group (matchmaking); a round of one ends here."""
    MIX = "mix"
    """A gossip group: average theta_g and the outer momentum (lossless) before the update."""
    EXCHANGE = "exchange"
    """Average the update (scatter, transfer, report, relay) and apply the outer step."""
    DIGEST = "digest"
    """Exchange the digests of the state each member holds after the step, and vote."""
    RESYNC = "resync"
    """In the minority of the vote: download the majority's state."""
    DONE = "done"


STEP_ORDER: dict[Step, frozenset[Step]] = {
    Step.GATHER: frozenset({Step.MIX, Step.EXCHANGE, Step.DONE}),
    Step.MIX: frozenset({Step.EXCHANGE}),
    Step.EXCHANGE: frozenset({Step.DIGEST}),
    Step.DIGEST: frozenset({Step.RESYNC, Step.DONE}),
    Step.RESYNC: frozenset({Step.DONE}),
    Step.DONE: frozenset(),
}


@dataclass
class Round:
    """One round's data as its steps produce it: its number, its clock, where its time went."""

    number: int
    started: float  # the loop's clock: virtual in the fault simulator, so seeds replay exactly
    step: Step = Step.GATHER
    phases: dict[str, float] = field(default_factory=dict)  # seconds per part (``RoundOutcome.phases``)
    exchange_started: float = 0.0  # when the group formed
    budget: float = 0.0  # the group's payload budget D (``Averager.budget_s``)

    def enter(self, step: Step) -> None:
        if step not in STEP_ORDER[self.step]:
            raise InvalidTransition(f"round {self.number}: {step} cannot follow {self.step}")
        self.step = step


def alone_applies(others_expected: bool, solo: bool) -> bool:
    """Whether a round of one applies its own update: only a solo node with nobody else expected. Otherwise others
    are live (or were, last round) but no group took it in, and applying alone would silently fork theta_g."""
    return solo and not others_expected


@dataclass(frozen=True)
class Verdict:
    """What a round with others decided for this member (``decide``)."""

    outcome: str  # applied | fallback | diverged; a member in the minority resyncs (``resync``) and then tells
    agreed: str  # the digest the vote chose
    alone: bool  # decided without anyone else's report: its decisions are its own, not agreed
    resync: bool  # in the minority of a majority: download the agreed state from ``holders``
    holders: tuple[str, ...] = ()


def decide(
    me: str,
    digest: str,
    digests: dict[str, str],
    applied: tuple[bool, ...] | list[bool],
    group_size: int,
    gossip: bool,
    mixes: bool,
    heard: bool,
    reports: int,
    voters: dict[str, str] | None = None,
    echoed: bool = True,
) -> Verdict:
    """The outcome of a round with others, from the data its members agreed on.

    ``digest``: my state after the step; ``digests``: the relayed view of digests (those that got through the
    round, mine included); ``applied``: the agreed decision per slot; ``gossip``: a mixed group, ``mixes``: whether
    it mixed (the agreed decision), ``heard``: whether I heard another member in the state exchange (true when not
    mixed); ``reports``: the members in my view of the update exchange's reports; ``voters``: the digests of that
    view that vote on the group's state (``Group.voters``; None: all of them); ``echoed``: whether another
    member's relay of the reports held mine.
    """
    # A gossip group that did not mix keeps the states its members came with: they differ by design, so nobody
    # has to confirm mine. The digests are still exchanged: a member that decided alone (cut off from the
    # reports) finds itself in the minority and resyncs.
    identical = not gossip or mixes
    outcome = "applied" if all(applied) and identical else "fallback"
    # The vote counts the members in the relayed view of digests, not the group's size: two identical survivors
    # of four confirm each other. A state held by a strict majority of the voters, by two members at least, is the
    # group's. Taking it from others needs a strict majority of every digest too: members whose state counted may
    # be few (and a self-certified state counts), and where the members that came with uncounted states are most
    # of the group, they catch up from the swarm rather than take that state.
    voters = digests if voters is None else voters
    agreed = digest_vote(voters) if voters else digest
    votes = sum(1 for d in voters.values() if d == agreed)
    majority = votes >= 2 and votes * 2 > len(voters)
    adopt = majority and sum(1 for d in digests.values() if d == agreed) * 2 > len(digests)
    # A member that heard no one's report decided alone: in a gossip round that did not mix nobody can confirm or
    # refute its state, so it counts itself diverged rather than trust a decision nobody shared. Likewise a member
    # that did not mix and holds the digests of half the group or fewer: the others may have mixed (their common
    # digest would be a majority) without its hearing of it. And a member whose report no one relayed back to it:
    # frozen through the reports, its report may have reached no one, so it decided with a report in its view
    # that is in no other's, and no digest vote can show it (the states differ anyway).
    alone = reports < 2 or not heard
    unmixed = not identical and not majority and not alone and echoed and len(digests) * 2 > group_size
    if adopt and digest != agreed:
        holders = tuple(p for p, d in digests.items() if d == agreed and p != me)
        return Verdict(outcome, agreed, alone, resync=True, holders=holders)
    confirmed = (majority and digest == agreed) or unmixed
    return Verdict(outcome if confirmed else "diverged", agreed, alone, resync=False)
