"""When each event of a scenario fires and what it does to which node: pure logic, no processes.

The runner asks ``Timeline.due(now_s, rounds_done, states)`` a few times a second. Events fire once their time
(seconds since the start) or round (rounds the swarm completed) has come; repeating events are expanded into
single ones up front; a ``random`` target is drawn (seeded) from the nodes the action applies to (to kill, make
leave or pause: from the nodes that contribute, i.e. whose process has logged a round, and never the last of
them, so the swarm always keeps a node that holds its model); an action that
takes a node away and has ``back_after_*`` schedules the action that brings it back. ``states`` holds each node's
state and is updated here, the one place where node states change on account of the timeline:

    idle --join--> running --pause--> paused --resume--> running
    running|paused --kill--> gone;  running --leave--> leaving (the runner marks it gone once it exited)
    gone --join--> running (a fresh process)

``link``, ``partition`` and ``heal`` change a node's network, not its state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from swarmtrain.scenarios.spec import BACK, LINK_KEYS, Action, Scenario

STATES = ("idle", "running", "paused", "leaving", "gone")
FROM: dict[str, tuple[str, ...]] = {
    "join": ("idle", "gone"),
    "kill": ("running", "paused"),
    "leave": ("running",),
    "pause": ("running",),
    "resume": ("paused",),
    # Network actions act on a node's namespace, whatever its process does; a random one picks a running node.
    "link": STATES,
    "partition": STATES,
    "heal": STATES,
}
RANDOM_FROM = {**FROM, "link": ("running",), "partition": ("running",), "heal": ("running", "paused")}
TO = {"join": "running", "kill": "gone", "leave": "leaving", "pause": "paused", "resume": "running"}
MAX_REPEATS = 10_000  # firings one repeating event expands to when the scenario sets no end for it


@dataclass(frozen=True, slots=True)
class Firing:
    action: Action
    node: str | None
    """The node acted on; None when nothing was done (see ``skipped``)."""
    source: str
    """Where it came from: event[0], repeat[1] #3, or 'back from repeat[1] #3'."""
    skipped: str = ""
    """Why nothing was done, e.g. 'node1 is paused' or 'no node to kill'."""
    link: tuple[float | None, ...] = ()
    """A link firing's new link, by ``LINK_KEYS``: (uplink, downlink) Mbit/s (None: unlimited), then the shares
    of packets dropped each way."""


@dataclass(slots=True)
class _Pending:
    unit: str  # "round" or "s"
    at: float
    action: Action
    nodes: tuple[str, ...]
    source: str
    back_after: float | None = None
    link: tuple[float | None, ...] = ()
    order: int = 0


class Timeline:
    def __init__(self, spec: Scenario) -> None:
        self.rng = random.Random(spec.seed)
        self.pending: list[_Pending] = []
        self._added = 0
        for i, e in enumerate(spec.events):
            unit, at = ("s", e.at_s) if e.at_s is not None else ("round", e.at_round)
            link = tuple(getattr(e, k) for k in LINK_KEYS)
            self._add(_Pending(unit, float(at), e.action, e.nodes, f"event[{i}]", link=link))
        for i, r in enumerate(spec.repeats):
            unit, every = ("round", r.every_rounds) if r.every_rounds is not None else ("s", r.every_s)
            assert every is not None
            end = r.until
            if end is None and unit == "round":
                end = spec.rounds - 1 if spec.rounds else r.start + every * (MAX_REPEATS - 1)
            elif end is None:
                end = spec.wall_time_s or spec.timeout_s
            k, at = 0, float(r.start)
            while at <= end and k < MAX_REPEATS:
                self._add(_Pending(unit, at, r.action, r.nodes, f"repeat[{i}] #{k + 1}", r.back_after))
                k, at = k + 1, r.start + (k + 1) * every

    def _add(self, item: _Pending) -> None:
        self._added += 1
        item.order = self._added  # ties at one moment fire in the order the spec wrote them
        self.pending.append(item)

    def has_pending(self, unit: str) -> bool:
        return any(p.unit == unit for p in self.pending)

    def due(
        self, now_s: float, rounds_done: int, states: dict[str, str], contributing: set[str] | None = None
    ) -> list[Firing]:
        """The firings whose moment has come, in order, with ``states`` updated for each. ``contributing``: the
        nodes whose current process has logged a round (None: every node counts as contributing)."""
        ready = [p for p in self.pending if p.at <= (now_s if p.unit == "s" else rounds_done)]
        # At one moment: rounds before seconds, a node coming back before new events, then the order written.
        ready.sort(key=lambda p: (p.unit == "s", p.at, not p.source.startswith("back"), p.order))
        fired: list[Firing] = []
        for p in ready:
            self.pending.remove(p)
            # A random pick skips the nodes acted on at this moment: a node that just came back is not the next
            # victim before it has even started.
            for node in self._targets(p, states, {f.node for f in fired if f.node is not None}, contributing):
                firing = self._apply(p, node, states)
                fired.append(firing)
                if firing.node is not None and p.back_after is not None:
                    back: Action = BACK[p.action]  # type: ignore[assignment]
                    self._add(_Pending(p.unit, p.at + p.back_after, back, (firing.node,), f"back from {p.source}"))
        return fired

    def _targets(
        self, p: _Pending, states: dict[str, str], busy: set[str], contributing: set[str] | None
    ) -> list[str | None]:
        if p.nodes != ("random",):
            return list(p.nodes)
        candidates = sorted(n for n, s in states.items() if s in RANDOM_FROM[p.action] and n not in busy)
        if p.action in ("kill", "leave", "pause"):
            # A node still starting or catching up is no worker yet: taking it away tests nothing, and taking away
            # every node that holds the model makes the swarm start again from round 0.
            workers = [n for n, s in states.items() if s == "running" and (contributing is None or n in contributing)]
            candidates = [n for n in candidates if n in workers] if len(workers) > 1 else []
        return [self.rng.choice(candidates) if candidates else None]

    def _apply(self, p: _Pending, node: str | None, states: dict[str, str]) -> Firing:
        if node is None:
            return Firing(p.action, None, p.source, f"no node to {p.action}")
        state = states[node]
        if state not in FROM[p.action]:
            return Firing(p.action, None, p.source, f"{node} is {state}, cannot {p.action} it")
        states[node] = TO.get(p.action, state)
        return Firing(p.action, node, p.source, link=p.link)
