"""The round as a state machine (``swarmtrain.averaging.round``): the node's phase transitions, the order of a
round's steps, and the round's decision as a pure function of the data its members agreed on."""

from __future__ import annotations

import itertools

import pytest

from swarmtrain.averaging.round import (
    TRANSITIONS,
    Event,
    InvalidTransition,
    Lifecycle,
    Phase,
    Round,
    Step,
    alone_applies,
    decide,
    next_phase,
)

SOLO, STEP, BEHIND, OBS = Phase.SOLO, Phase.IN_STEP, Phase.CATCH_UP, Phase.OBSERVE
LEAVING, DONE = Phase.LEAVING, Phase.DONE
E = Event
# Every legal transition, written out: (phase, event, solo before) -> (phase, solo after). ``solo`` is the standing
# a node returns to from CATCH_UP; a round with others clears it, a catch-up that found no donor sets it.
LEGAL = {
    (SOLO, E.APPLIED_ALONE, True): (SOLO, True),
    (SOLO, E.NO_GROUP, True): (BEHIND, True),
    (SOLO, E.CONFIRMED, True): (STEP, False),
    (SOLO, E.RESYNCED, True): (STEP, False),
    (SOLO, E.UNCONFIRMED, True): (BEHIND, False),
    (SOLO, E.FAILED, True): (BEHIND, True),
    (SOLO, E.SYNCED, True): (OBS, True),
    (SOLO, E.FOUND_IN_STEP, True): (SOLO, True),
    (SOLO, E.NO_DONOR, True): (SOLO, True),
    (SOLO, E.OFF_SWARM, True): (BEHIND, True),
    (SOLO, E.LEAVE, True): (LEAVING, True),
    (SOLO, E.FINISH, True): (DONE, True),
    (STEP, E.NO_GROUP, False): (BEHIND, False),
    (STEP, E.CONFIRMED, False): (STEP, False),
    (STEP, E.RESYNCED, False): (STEP, False),
    (STEP, E.UNCONFIRMED, False): (BEHIND, False),
    (STEP, E.FAILED, False): (BEHIND, False),
    (STEP, E.OFF_SWARM, False): (BEHIND, False),
    (STEP, E.LEAVE, False): (LEAVING, False),
    (STEP, E.FINISH, False): (DONE, False),
    (BEHIND, E.SYNCED, False): (OBS, False),
    (BEHIND, E.SYNCED, True): (OBS, True),
    (BEHIND, E.FOUND_IN_STEP, False): (STEP, False),
    (BEHIND, E.FOUND_IN_STEP, True): (SOLO, True),
    (BEHIND, E.NO_DONOR, False): (SOLO, True),
    (BEHIND, E.CONFIRMED, True): (STEP, False),
    (BEHIND, E.RESYNCED, False): (STEP, False),
    (BEHIND, E.APPLIED_ALONE, True): (BEHIND, True),
    (BEHIND, E.NO_GROUP, False): (BEHIND, False),
    (BEHIND, E.UNCONFIRMED, True): (BEHIND, False),
    (BEHIND, E.FAILED, True): (BEHIND, True),
    (BEHIND, E.LEAVE, False): (LEAVING, False),
    (OBS, E.APPLIED_ALONE, True): (SOLO, True),
    (OBS, E.NO_GROUP, False): (BEHIND, False),
    (OBS, E.CONFIRMED, True): (STEP, False),
    (OBS, E.RESYNCED, False): (STEP, False),
    (OBS, E.UNCONFIRMED, True): (BEHIND, False),
    (OBS, E.FAILED, False): (BEHIND, False),
    (OBS, E.LEAVE, True): (LEAVING, True),
    (OBS, E.FINISH, False): (DONE, False),
}


@pytest.mark.parametrize(("phase", "event", "solo"), list(LEGAL))
def test_every_legal_transition_goes_where_the_diagram_says(phase: Phase, event: Event, solo: bool) -> None:
    assert next_phase(phase, event, solo) == LEGAL[phase, event, solo]
    lifecycle = Lifecycle(phase, solo)
    assert lifecycle.advance(event) == LEGAL[phase, event, solo][0]
    assert (lifecycle.phase, lifecycle.solo) == LEGAL[phase, event, solo]


def test_the_table_holds_exactly_the_transitions_written_out_here() -> None:
    assert set(TRANSITIONS) == {(phase, event) for phase, event, _ in LEGAL}


@pytest.mark.parametrize(
    ("phase", "event"),
    [(p, e) for p, e in itertools.product(Phase, Event) if (p, e) not in TRANSITIONS],
)
def test_every_other_transition_raises_and_leaves_the_phase(phase: Phase, event: Event) -> None:
    lifecycle = Lifecycle(phase, solo=False)
    with pytest.raises(InvalidTransition, match=f"{event} is not a transition of {phase}"):
        lifecycle.advance(event)
    assert lifecycle.phase is phase


def test_leaving_and_done_are_terminal_and_in_step_never_applies_alone() -> None:
    for event in Event:
        for phase in (LEAVING, DONE):
            with pytest.raises(InvalidTransition):
                next_phase(phase, event, True)
    with pytest.raises(InvalidTransition):
        next_phase(STEP, E.APPLIED_ALONE, False)
    with pytest.raises(InvalidTransition):
        next_phase(BEHIND, E.FINISH, False)  # a node behind catches up before it finishes


def test_a_joiner_goes_from_solo_through_catch_up_and_observe_to_in_step() -> None:
    lifecycle = Lifecycle()
    steps = [E.NO_GROUP, E.SYNCED, E.CONFIRMED, E.UNCONFIRMED, E.FOUND_IN_STEP, E.LEAVE]
    assert [lifecycle.advance(e) for e in steps] == [BEHIND, OBS, STEP, BEHIND, STEP, LEAVING]


def test_a_round_of_one_applies_only_when_solo_and_nobody_else_was_expected() -> None:
    assert alone_applies(others_expected=False, solo=True)
    assert not alone_applies(others_expected=True, solo=True)
    assert not alone_applies(others_expected=False, solo=False)
    assert not alone_applies(others_expected=True, solo=False)


def test_a_rounds_steps_go_in_order() -> None:
    plain, mixed, one = Round(0, 0.0), Round(1, 0.0), Round(2, 0.0)
    for step in (Step.EXCHANGE, Step.DIGEST, Step.DONE):
        plain.enter(step)
    for step in (Step.MIX, Step.EXCHANGE, Step.DIGEST, Step.RESYNC, Step.DONE):
        mixed.enter(step)
    one.enter(Step.DONE)
    with pytest.raises(InvalidTransition, match="round 3: digest cannot follow gather"):
        Round(3, 0.0).enter(Step.DIGEST)
    with pytest.raises(InvalidTransition):
        plain.enter(Step.EXCHANGE)  # a round is over once DONE


def _decide(digest: str, digests: dict[str, str], **kw: object) -> object:
    args: dict[str, object] = {
        "applied": (True, True, True), "group_size": 3, "gossip": False, "mixes": False, "heard": True, "reports": 3,
    }  # fmt: skip
    args.update(kw)
    return decide("a", digest, digests, **args)  # type: ignore[arg-type]


def test_a_member_in_the_majority_confirms_its_round() -> None:
    verdict = _decide("x", {"a": "x", "b": "x", "c": "y"})
    assert (verdict.outcome, verdict.resync, verdict.agreed, verdict.alone) == ("applied", False, "x", False)
    fallback = _decide("x", {"a": "x", "b": "x", "c": "x"}, applied=(True, False, True))
    assert (fallback.outcome, fallback.resync) == ("fallback", False)


def test_a_member_in_the_minority_resyncs_from_the_holders_of_the_majority_state() -> None:
    verdict = _decide("y", {"a": "y", "b": "x", "c": "x"})
    assert (verdict.resync, verdict.agreed, verdict.holders) == (True, "x", ("b", "c"))


def test_without_a_majority_a_plain_round_is_not_confirmed() -> None:
    # Two survivors that disagree: no state holds a strict majority of two votes.
    verdict = _decide("x", {"a": "x", "b": "y"})
    assert (verdict.outcome, verdict.resync) == ("diverged", False)
    # Only my own digest came back: one vote is no majority.
    assert _decide("x", {"a": "x"}, reports=1).outcome == "diverged"


def test_only_the_voters_confirm_a_state_and_taking_it_needs_a_majority_of_every_digest() -> None:
    # A signed group that did not mix: only the voters came with states that counted (``Group.voters``).
    digests = {"a": "x", "b": "x", "c": "x", "d": "y", "e": "z"}
    assert _decide("x", digests, voters={"a": "x", "b": "x", "c": "x"}).outcome == "applied"
    two_of_five = {"a": "x", "b": "x", "c": "q", "d": "y", "e": "z"}
    assert _decide("x", two_of_five, voters={"a": "x", "b": "x"}).outcome == "applied"
    assert _decide("x", two_of_five).outcome == "diverged"  # every digest voting: no majority
    # My state (a) did not count: I take the voters' state only where most of all the digests hold it.
    taken = _decide("q", {"a": "q", "b": "x", "c": "x", "d": "x", "e": "z"}, voters={"b": "x", "c": "x"})
    assert (taken.resync, taken.agreed, taken.holders) == (True, "x", ("b", "c", "d"))
    left = _decide("q", {"a": "q", "b": "x", "c": "x", "d": "y", "e": "z"}, voters={"b": "x", "c": "x"})
    assert (left.outcome, left.resync) == ("diverged", False)  # x: all the voters, but two of five digests


def test_a_gossip_round_that_did_not_mix_is_confirmed_by_most_of_the_group_without_a_majority() -> None:
    unmixed = {"a": "x", "b": "y", "c": "z"}  # states differ by design
    verdict = _decide("x", unmixed, gossip=True, mixes=False)
    assert (verdict.outcome, verdict.resync, verdict.alone) == ("fallback", False, False)
    # Half the group's digests or fewer: the others may have mixed without my hearing of it.
    assert _decide("x", {"a": "x", "b": "y"}, gossip=True, group_size=4).outcome == "diverged"


def test_a_member_whose_report_no_one_relayed_back_does_not_confirm_a_gossip_round_that_did_not_mix() -> None:
    """Frozen through the reports, its report reached no one: it decided with a report no one else's view holds
    (simulator seed 2002478), and in a round that did not mix the digests cannot show it. A plain round's digest
    vote still confirms it where it holds the majority state."""
    unmixed = {"a": "x", "b": "y", "c": "z"}
    assert _decide("x", unmixed, gossip=True, mixes=False, echoed=False).outcome == "diverged"
    assert _decide("x", unmixed, gossip=True, mixes=False, echoed=True).outcome == "fallback"
    assert _decide("x", {"a": "x", "b": "x", "c": "y"}, echoed=False).outcome == "applied"


def test_a_member_that_decided_alone_counts_itself_diverged() -> None:
    unmixed = {"a": "x", "b": "y", "c": "z"}
    cut_off = _decide("x", unmixed, gossip=True, reports=1)  # heard no one's report
    assert (cut_off.outcome, cut_off.alone) == ("diverged", True)
    unheard = _decide("x", unmixed, gossip=True, heard=False)  # heard no one in the state exchange
    assert (unheard.outcome, unheard.alone) == ("diverged", True)
    # Alone but in a majority it shares with others: its state is the group's, confirmed by their digests.
    shared = _decide("x", {"a": "x", "b": "x", "c": "y"}, reports=1)
    assert (shared.outcome, shared.alone) == ("applied", True)
