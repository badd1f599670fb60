"""The swarm as seen from outside it: ``swarmtrain dashboard --join ADDR`` serves the dashboard page for a whole
swarm without running a node of its own.

    swarmtrain dashboard --join /ip4/203.0.113.5/tcp/31337/p2p/Qm... --port 8080
    swarmtrain dashboard --join ADDR --set node.swarm_key=swarm.key      # a private swarm: its key

It joins the DHT as a client (it trains nothing, stores nothing, and no group waits for it), reads the swarm's
peer records every ``poll_s`` seconds and draws the same page as a node's dashboard from what they say: each
peer's state and reason, round, tokens/s and share of the tokens trained; the swarm's mean training loss and mean
held-out bpb per round and the bytes its peers sent; and the events it sees from one look to the next: a peer
that joins, leaves (announced, or its record gone for ``record_ttl_s``), changes state (catching up, left out,
banned...), or bans another. Records are the peers' own claims, each signed by its identity and checked as
`swarmtrain status` checks them; the page shows them as claims.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from swarmtrain.config import Config
from swarmtrain.dht import PeerRecord, swarm_records
from swarmtrain.dht.membership import Refusals
from swarmtrain.net import load_auth
from swarmtrain.node.observe import peer_row
from swarmtrain.node.state import CONTRIBUTING, NodeState

log = logging.getLogger(__name__)

CONTRIBUTING_STATES = {str(s) for s in CONTRIBUTING}


class SwarmView:
    """What the swarm's records said over time, as ``/status`` of a swarm dashboard (the page reads the same
    fields as a node's). ``update`` is called with each lookup; ``snapshot`` from the HTTP thread."""

    def __init__(self, run_id: str, ttl: float, history: int = 500, events: int = 200) -> None:
        self.run_id = run_id
        self.ttl = ttl  # a peer whose record is missing this long has left (its record expired)
        self.history = history
        self.lock = threading.Lock()
        self.records: dict[str, PeerRecord] = {}
        self.seen: dict[str, float] = {}  # peer -> when its record was last found
        self.points: dict[int, dict[str, PeerRecord]] = {}  # round -> peer -> its record right after that round
        self.events: deque[dict[str, Any]] = deque(maxlen=events)
        self.looks = 0
        self.problem = "no look at the swarm yet"  # why the last look failed, or "" when it worked

    def failed(self, why: str) -> None:
        with self.lock:
            self.problem = why

    def update(self, records: Iterable[PeerRecord], now: float | None = None) -> None:
        """Take one lookup's records (each already checked): note the events since the last, keep each peer's
        claims for the round its record says it finished."""
        now = time.time() if now is None else now
        found = {r.peer_id: r for r in records}
        with self.lock:
            self.looks += 1
            self.problem = "" if found else "the lookup found no peer records (yet)"
            for peer, record in found.items():
                self._compare(peer, self.records.get(peer), record, now)
                self.records[peer], self.seen[peer] = record, now
                if record.round > 0 and record.loss is not None:
                    self.points.setdefault(record.round - 1, {})[peer] = record
            for peer in [p for p in self.records if p not in found and now - self.seen[p] > self.ttl]:
                self._event(now, self.records[peer].round, "leave", f"{_short(peer)}: no record for {self.ttl:.0f} s")
                del self.records[peer], self.seen[peer]
            for stale in sorted(self.points)[: -self.history]:
                del self.points[stale]

    def _compare(self, peer: str, before: PeerRecord | None, after: PeerRecord, now: float) -> None:
        state = after.state or after.phase
        if before is None:
            self._event(now, after.round, "join", f"{_short(peer)} at round {after.round}, {state}: {after.reason}")
        elif after.phase == "leaving" and before.phase != "leaving":
            self._event(now, after.round, "leave", f"{_short(peer)}: {after.reason or 'announced its leave'}")
        elif (before.state, before.reason) != (after.state, after.reason) and after.state not in CONTRIBUTING_STATES:
            # Training and averaging alternate every round: only a state that says why a peer is not
            # contributing is news.
            self._event(now, after.round, after.state, f"{_short(peer)}: {after.reason}")
        for banned, ban in after.bans.items():
            if before is None or before.bans.get(banned) != ban:
                why = f"{_short(peer)} bans {banned} until round {ban.until}: {ban.reason}"
                self._event(now, after.round, "ban", why)

    def _event(self, now: float, round_: int, kind: str, reason: str) -> None:
        self.events.append({"time": now, "round": round_, "state": kind, "reason": reason})

    def snapshot(self) -> dict[str, Any]:
        """``/status`` of the swarm: the fields a node's dashboard reads, for every peer."""
        with self.lock:
            records = dict(self.records)
            points = {r: dict(peers) for r, peers in sorted(self.points.items())}
            events, looks, problem = list(self.events), self.looks, self.problem
        contributing = sum(r.state in CONTRIBUTING_STATES for r in records.values())
        return {
            "swarm": self.run_id,
            "peer_id": "",
            "round": max((r.round for r in records.values()), default=0),
            "state": "watching",  # a dashboard of the swarm is no node: it watches the records
            "reason": problem or f"{contributing} of {len(records)} peers contributing (after {looks} looks)",
            "contributing": contributing > 0,
            "peers": {p: peer_row(r) for p, r in records.items()},
            "contributed": {p: float(r.tokens) for p, r in records.items()},
            "history": [_round_point(round_, peers) for round_, peers in points.items()],
            "events": events,
        }


def _round_point(round_: int, peers: dict[str, PeerRecord]) -> dict[str, Any]:
    """One round of the swarm: the mean of its peers' losses and bpbs, the sum of the bytes they sent."""
    losses = [r.loss for r in peers.values() if r.loss is not None]
    bpbs = [r.bpb for r in peers.values() if r.bpb is not None]
    return {
        "round": round_,
        "loss": sum(losses) / len(losses) if losses else None,
        "bpb": sum(bpbs) / len(bpbs) if bpbs else None,
        "bytes_sent": sum(r.bytes_sent for r in peers.values()),
        "peers": {p: {"loss": r.loss, "bpb": r.bpb, "bytes_sent": r.bytes_sent} for p, r in peers.items()},
        "utilisation": None,
    }


def _short(peer: str) -> str:
    return peer[-8:]


class SwarmMetrics:
    """``/metrics`` of a swarm dashboard: how many peers are in each state, and the highest round."""

    def __init__(self, view: SwarmView) -> None:
        self.registry = r = CollectorRegistry()
        self.peers = Gauge("swarmtrain_swarm_peers", "Peers of the swarm by state.", ["state"], registry=r)
        self.round = Gauge("swarmtrain_swarm_round", "The highest round a peer's record names.", registry=r)
        self.view = view

    def refresh(self) -> None:
        with self.view.lock:
            records = list(self.view.records.values())
        counts = {str(s): 0 for s in NodeState}
        for record in records:
            state = record.state or record.phase
            counts[state] = counts.get(state, 0) + 1
        for state, count in counts.items():
            self.peers.labels(state=state).set(count)
        self.round.set(max((r.round for r in records), default=0))


async def watch(config: Config, view: SwarmView, poll_s: float, looks: int = 0) -> None:
    """Look the swarm up every ``poll_s`` seconds (``looks`` times, or until cancelled when 0) into ``view``."""
    from swarmtrain.node.node import dht_client

    auth = load_auth(config.node.swarm_key, config.node.allow_peers)
    refusals = Refusals()  # a bad record is logged once a minute, not at every look
    async with dht_client(config) as dht:
        done = 0
        while looks == 0 or done < looks:
            try:
                records = await asyncio.wait_for(swarm_records(dht, config.node.run_id, auth, refusals), 30)
            except (TimeoutError, OSError) as exc:
                view.failed(f"the last lookup failed: {exc!r}")
            else:
                view.update(records)
            done += 1
            await asyncio.sleep(poll_s)
