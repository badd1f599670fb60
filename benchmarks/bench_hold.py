"""A hostile leader that holds joins, with and without the ban on it: how long the others spend in each round.

    PYTHONPATH=. python benchmarks/bench_hold.py                       # seeds 0-39, 6 rounds (about a minute)
    PYTHONPATH=. python benchmarks/bench_hold.py --seeds 200 --rounds 8

The fault simulator's seeds (``swarmtrain.averaging.sim``: 2-8 members on a virtual clock with drawn faults and
join timeouts of 20, 40 or 60 s, one of them hostile) with ``--attack hold`` (it never answers a join) and
``--attack ask-again`` (it tells every joiner to ask it again). "no ban" switches ``Bans.held`` off, as before the
ban. A seed's hostile member holds anyone only where it is the lowest peer id, which every member takes for its
leader. Per round: in how many seeds an honest member spent more than ``HELD_S`` in it (a round's bound there is
at most 14 s) and the longest it spent, and in how many seeds the honest members ended in more than one group.
"""

from __future__ import annotations

import argparse
import logging
from collections import defaultdict
from typing import Any

from swarmtrain.averaging import Averager, RoundOutcome
from swarmtrain.averaging.bans import Bans
from swarmtrain.averaging.sim import Modes, run_seed

HELD_S = 20.0  # the shortest join timeout the simulator draws: no round that was not held lasts as long


def run(seeds: int, rounds: int, attack: str) -> tuple[dict[int, list[float]], dict[int, int]]:
    """Per round index: the longest time an honest member spent in it, per seed that had one past ``HELD_S``;
    and the number of seeds whose honest members ended it in more than one group."""
    seen: dict[tuple[int, int], list[tuple[float, tuple[str, ...]]]] = defaultdict(list)
    play = Averager.run_round

    async def recorded(self: Averager, *args: Any, **kwargs: Any) -> RoundOutcome:
        outcome = await play(self, *args, **kwargs)
        if self.attack is None:
            seen[(current, outcome.round)].append((outcome.duration_s, outcome.group.members))
        return outcome

    Averager.run_round = recorded  # type: ignore[method-assign]
    try:
        for current in range(seeds):
            run_seed(current, rounds, Modes(hostile=True, attack=attack))
    finally:
        Averager.run_round = play  # type: ignore[method-assign]
    held: dict[int, list[float]] = defaultdict(list)
    split: dict[int, int] = defaultdict(int)
    for (_, round_), members in seen.items():
        longest = max(duration for duration, _ in members)
        if longest > HELD_S:
            held[round_].append(longest)
        split[round_] += len({group for _, group in members}) > 1
    return held, split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=40, help="seeds 0 to this, less one")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    logging.basicConfig(level=logging.CRITICAL)
    header = " | ".join(f"round {r}" for r in range(args.rounds))
    print(f"seeds 0-{args.seeds - 1}: seeds with a member held past {HELD_S:g} s (the longest), seeds split\n")
    print(f"| attack | ban | {header} |\n|---|---|{'---|' * args.rounds}")
    held_by = Bans.held
    for attack in ("hold", "ask-again"):
        for ban in (False, True):
            Bans.held = held_by if ban else lambda self, peers, round_: None  # type: ignore[method-assign]
            try:
                held, split = run(args.seeds, args.rounds, attack)
            finally:
                Bans.held = held_by  # type: ignore[method-assign]
            cells = [
                f"{len(held[r])} ({max(held[r]):.0f} s), {split[r]} split" if held[r] else f"0, {split[r]} split"
                for r in range(args.rounds)
            ]  # fmt: skip
            print(f"| {attack} | {'yes' if ban else 'no'} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
