"""Why a node is or is not contributing: one named state with a reason, the same in every view.

The node sets its state at its transitions (``NodeStatus.set``); the state and its reason go into the node's DHT
record (``swarmtrain status``), every round line of ``metrics.jsonl``, ``/status`` and ``/metrics``. The state a
finished round leaves the node in follows from the round's outcome and what the matchmaker heard while it looked
for its group (``round_state``): a decision from data, not from flags scattered over the node.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class NodeState(StrEnum):
    STARTING = "starting"
    """Waiting for the daemon, the DHT or node.min_peers."""
    TRAINING = "training"
    """Running its inner steps."""
    AVERAGING = "averaging"
    """In the outer step with its group."""
    CATCHING_UP = "catching_up"
    """Downloading theta_g from a peer that is ahead (reason: from whom, how far)."""
    OBSERVING = "observing"
    """Sitting in on the round it caught up into, with weight 0."""
    LATE = "late"
    """Came to the gather after its group had formed; its update joins a later round."""
    LEFT_OUT = "left_out"
    """Peers are live but no group took it in; it catches up before the next round."""
    BANNED = "banned"
    """A leader refused it for an invalid payload it sent (reason: who, until which round, why)."""
    UNREACHABLE = "unreachable"
    """None of the peers it should average with could be reached."""
    CONFIG_MISMATCH = "config_mismatch"
    """Its settings differ from the swarm's (reason: which key, what the swarm uses); it does not train."""
    LEAVING = "leaving"
    """Finishing its round, then leaving (Ctrl+C)."""
    DONE = "done"
    """Finished its rounds; serving its final state to peers that are behind."""


CONTRIBUTING = frozenset({NodeState.TRAINING, NodeState.AVERAGING})
HISTORY_KEYS = (  # per round in /status
    "round",
    "loss",
    "bpb",
    "tokens",
    "bytes_sent",
    "elapsed_s",
    "inner_s",
    "wall_s",
    "idle_s",
    "utilisation",
    "state",
)


@dataclass(frozen=True, slots=True)
class Miss:
    """A leader the matchmaker could not join in a round: who, and how it failed."""

    peer: str
    kind: str  # "late" (the group had formed or the round was over), "banned", "unreachable", "refused", or "held"
    message: str


def round_state(outcome: str, group_size: int, observing: bool, misses: list[Miss]) -> tuple[NodeState, str]:
    """The state a round leaves the node in, with its reason, from the round's outcome and the matchmaker's misses."""
    if group_size > 1:
        if observing:
            return NodeState.OBSERVING, f"sat in with weight 0 in a group of {group_size} after catching up"
        return NodeState.AVERAGING, f"{outcome} in a group of {group_size}"
    banned = [m for m in misses if m.kind == "banned"]
    if banned:  # its own update applied alone or not: the swarm has turned it away
        return NodeState.BANNED, banned[0].message  # who refused it, until which round, why
    if outcome != "diverged":
        return NodeState.TRAINING, "alone in the swarm: applied its own update"
    late = [m for m in misses if m.kind == "late"]
    if late:
        return NodeState.LATE, f"late for the gather: {late[0].message}"
    if misses and all(m.kind == "unreachable" for m in misses):
        peers = ", ".join(dict.fromkeys(m.peer[-8:] for m in misses))
        return NodeState.UNREACHABLE, f"could not reach {peers} to average: {misses[0].message}"
    heard = f" ({misses[0].message})" if misses else ""
    return NodeState.LEFT_OUT, f"left out by the group: peers are live but no group took it in{heard}"


class NodeStatus:
    """The node's state and recent history; read from the HTTP server's thread, so every access holds a lock."""

    def __init__(self, peer_id: str = "", history: int = 500, events: int = 200) -> None:
        self._lock = threading.Lock()
        self.peer_id = peer_id
        self.state, self.reason, self.since = NodeState.STARTING, "starting the daemon", time.time()
        self.round = 0
        self.group: list[str] = []
        self.bans: dict[str, dict[str, Any]] = {}  # peers this node bans now: the end of each id -> until, reason
        self.peers_source: Callable[[], dict[str, dict[str, Any]]] = dict  # the swarm as this node sees it
        self.rounds: deque[dict[str, Any]] = deque(maxlen=history)
        self.events: deque[dict[str, Any]] = deque(maxlen=events)
        self.listeners: list[Any] = []  # callables (state, reason) run on every change (the DHT record, metrics)
        self.round_listeners: list[Callable[[dict[str, Any]], None]] = []  # run with each round's line (panel)

    def set(self, state: NodeState, reason: str = "") -> None:
        with self._lock:
            if (state, reason) == (self.state, self.reason):
                return
            self.state, self.reason, self.since = state, reason, time.time()
            self.events.append({"time": self.since, "round": self.round, "state": str(state), "reason": reason})
        for listener in self.listeners:
            listener(state, reason)

    def event(self, kind: str, reason: str) -> None:
        """Something a person should see that is not a change of state (e.g. ``unreachable`` at start)."""
        with self._lock:
            self.events.append({"time": time.time(), "round": self.round, "state": kind, "reason": reason})

    def set_bans(self, bans: dict[str, dict[str, Any]]) -> None:
        """The peers this node bans now (its record's ``bans``); a new ban is also an event."""
        with self._lock:
            for peer, ban in bans.items():
                if self.bans.get(peer) != ban:
                    reason = f"banned {peer} until round {ban['until']}: {ban['reason']}"
                    self.events.append({"time": time.time(), "round": self.round, "state": "ban", "reason": reason})
            self.bans = dict(bans)

    def add_round(self, line: dict[str, Any]) -> None:
        with self._lock:
            self.round = int(line["round"]) + 1
            self.group = list(line.get("group", []))
            self.rounds.append(line)
        for listener in self.round_listeners:
            listener(line)

    def snapshot(self) -> dict[str, Any]:
        """What ``/status`` returns: JSON-ready, a copy."""
        peers = self.peers_source()
        with self._lock:
            rounds = list(self.rounds)
            return {
                "peer_id": self.peer_id,
                "round": self.round,
                "state": str(self.state),
                "reason": self.reason,
                "since": self.since,
                "contributing": self.state in CONTRIBUTING,
                "group": list(self.group),
                "bans": dict(self.bans),
                "peers": peers,
                "last_outcomes": [{"round": r["round"], "outcome": r["outcome"]} for r in rounds[-10:]],
                "bytes_sent": sum(r.get("bytes_sent", 0) for r in rounds),
                "bytes_received": sum(r.get("bytes_received", 0) for r in rounds),
                "tokens_per_s": rounds[-1].get("tokens_per_s", 0.0) if rounds else 0.0,
                "history": [{k: r.get(k) for k in HISTORY_KEYS} for r in rounds],
                "contributed": _contributed(rounds),
                "events": list(self.events),
            }


def _contributed(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """What each peer contributed to the rounds this node took part in: the groups' weights (tokens; with
    averaging.weighting = equal, one per round)."""
    totals: dict[str, float] = {}
    for line in rounds:
        for peer, weight in zip(line.get("group", []), line.get("weights", []), strict=False):
            totals[peer] = totals.get(peer, 0.0) + weight
    return totals
