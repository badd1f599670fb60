"""Groups of one round: who averages with whom, and which shard each member reduces.

Pure functions of their inputs, so every node that sees the same membership computes the same groups.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Group:
    """The members of one round's all-reduce, in reducer order, with the token weight of each."""

    round: int
    members: tuple[str, ...]
    weights: tuple[float, ...]
    mixed: bool = False  # members start from different theta_g (gossip): average the state too
    deadline_s: float = 0.0  # the leader's all-reduce budget, shared by every member (0: each uses its own)
    # How long the group had formed when I was told of it: about 0 from the leader; seconds when a member told me
    # after the leader froze before answering me (``matchmaking._probe``), and the others' exchange began then.
    age_s: float = field(default=0.0, compare=False)
    # Whose state counts when a gossip round mixes (signed groups; empty: everyone's): a state another peer
    # certified it held (``signing.check_held``) or that most members hold, unless no member's does. The others
    # take the mix of the counted ones, and ``mixed`` says whether those differ.
    counted: tuple[bool, ...] = ()
    digests: tuple[str, ...] = field(default=(), compare=False)  # each member's digest as it joined
    certs: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)  # the certificates counted

    @property
    def group_id(self) -> str:
        text = f"{self.round}|{','.join(self.members)}|{','.join(repr(w) for w in self.weights)}|{self.mixed}"
        if self.counted:
            text += "|" + "".join("1" if c else "0" for c in self.counted)
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    @property
    def mix_weights(self) -> tuple[float, ...]:
        """The weights of the members' states in a mix: a state that does not count weighs nothing."""
        if not self.counted:
            return self.weights
        return tuple(w if c else 0.0 for w, c in zip(self.weights, self.counted, strict=True))

    def voters(self, digests: dict[str, str]) -> dict[str, str]:
        """The digests that vote on the group's state after the round (``round.decide``): every member's, but in a
        group that does not mix, none of a member whose state did not count. Such a member stepped from a state of
        its own, which no other holds, so its digest matches nobody's and would only dilute the majority of those
        that count: two of them in a group of five with three such members could not confirm the round."""
        if self.mixed or not self.counted:
            return digests
        counts = dict(zip(self.members, self.counted, strict=True))
        return {peer: digest for peer, digest in digests.items() if counts.get(peer, False)}

    @property
    def size(self) -> int:
        return len(self.members)

    def index(self, peer: str) -> int:
        return self.members.index(peer)

    def shard_bounds(self, numel: int, align: int = 1) -> list[tuple[int, int]]:
        """The shard each member reduces (by member index): contiguous slices whose sizes differ by at most one
        (in runs of ``align`` elements, where a slice must start at a multiple of it: a gossip round's state chunks).

        The slices rotate by one member per round: a member that never delivers its shard (it stalls, or every
        round sends a payload the others refuse, and is left out) would otherwise keep the same coordinates from
        ever being updated; rotated, each slice misses at most the rounds it lands on such a member.
        """
        base, extra = divmod(-(-numel // align), self.size)
        slices, start = [], 0
        for i in range(self.size):
            end = start + base + (1 if i < extra else 0)
            slices.append((min(start * align, numel), min(end * align, numel)))
            start = end
        shift = self.round % self.size
        return slices[shift:] + slices[:shift]


def gossip_groups(peers: list[str], group_size: int, run_id: str, round_: int) -> list[list[str]]:
    """Split ``peers`` into groups of about ``group_size`` that change every round.

    One group holding everyone while ``len(peers) <= group_size`` (exact DiLoCo); beyond that a shuffle seeded
    by (run id, round) cut into near-equal groups, so that updates mix across the swarm over rounds.
    """
    ordered = sorted(set(peers))
    if len(ordered) <= group_size:
        return [ordered]
    seed = int.from_bytes(hashlib.blake2b(f"{run_id}|{round_}".encode(), digest_size=8).digest(), "big")
    random.Random(seed).shuffle(ordered)
    count = -(-len(ordered) // group_size)
    return [sorted(ordered[i::count]) for i in range(count)]


def leader_candidates(peers: list[str], me: str, group_size: int, run_id: str, round_: int) -> list[str]:
    """The members of my gossip group in the order I try them as the round's leader (lowest peer id first)."""
    for group in gossip_groups([*peers, me], group_size, run_id, round_):
        if me in group:
            return group
    raise AssertionError("unreachable: every peer is in some group")


def counted_states(digests: list[str], certified: list[bool]) -> list[bool]:
    """Whose state counts in a mix (``Group.counted``): a certified one, or one that more than half of the members
    hold (a swarm's first round: the honest members share one init, and hostile ones, fewer than half, cannot make
    a state count by all holding it); every one where none does (members that each start from their own init)."""
    counted = [c or held_by_most(digests, d) for d, c in zip(digests, certified, strict=True)]
    return counted if any(counted) else [True] * len(digests)


def held_by_most(digests: list[str], digest: str) -> bool:
    """Whether more than half of a group's members hold ``digest``: such a state counts without a certificate, and
    a leader sends none for it (a one-group swarm's usual round sends none at all)."""
    return digests.count(digest) * 2 > len(digests)


def whose_state_counts(
    members: Sequence[str], digests: list[str], certs: dict[str, Any], holds: Callable[[str, str, Any], bool]
) -> tuple[dict[str, Any], list[bool], bool]:
    """The rule a leader applies and each member checks: the certificates that count (those of states most members
    do not hold, that ``holds``), whose state counts (``counted_states``) and whether the group mixes."""
    kept = {
        m: certs[m] for m, d in zip(members, digests, strict=True)
        if m in certs and not held_by_most(digests, d) and holds(m, d, certs[m])
    }  # fmt: skip
    counted = counted_states(digests, [m in kept for m in members])
    return kept, counted, mixes(digests, counted)


def mixes(digests: list[str], counted: list[bool]) -> bool:
    """Whether a group mixes its states: the states that count differ."""
    return len({d for d, c in zip(digests, counted, strict=True) if c}) > 1
