"""One swarm node: P2P daemon, DHT, membership, averaging service and the training loop in one event loop.

    swarmtrain node --config run.toml
    swarmtrain node --config run.toml --join /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...
    swarmtrain node --config run.toml --join ... --resume   # continue from the run directory's latest checkpoint

Each round: H inner AdamW steps in a worker thread (torch releases the GIL, so the loop keeps serving RPCs and
heartbeats), then the outer step with the node's group, then one JSON line in ``<run_dir>/metrics.jsonl``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator
from hivemind.p2p import P2P
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from swarmtrain.averaging import (
    PROTOCOL_VERSION,
    Averager,
    Event,
    Phase,
    RoundOutcome,
    RoundSigner,
    leader_candidates,
)  # fmt: skip
from swarmtrain.averaging.attack import FORGED_AHEAD, Attack
from swarmtrain.averaging.matchmaking import EQUAL_WEIGHT, MAX_WEIGHT
from swarmtrain.averaging.robust import parse_aggregator
from swarmtrain.compression import get_codec
from swarmtrain.config import Config, write_resolved
from swarmtrain.data import load_corpus, load_parts
from swarmtrain.dht import Membership, PeerRecord, ban_table, load_identity_key, record_validators
from swarmtrain.dht.membership import MAX_COUNT, MAX_LOSS, NOT_IN_STEP, off_swarm, swarm_round
from swarmtrain.errors import CheckpointError, SwarmtrainError
from swarmtrain.net import P2PTransport, Transport, load_auth, serve_hello, verify_swarm
from swarmtrain.net.reachability import FIX, REACH_WAIT_S, ask_dialback, dialable, is_loopback, reach, serve_dialback
from swarmtrain.node.inner import InnerLoop, build_inner_loop
from swarmtrain.node.observe import NodeMetrics, ObserveServer, dashboard, peer_row
from swarmtrain.node.resume import open_run_dir, outer_state
from swarmtrain.node.settings import ConfigMismatch, check_settings, serve_settings, swarm_settings
from swarmtrain.node.state import Miss, NodeState, NodeStatus, round_state
from swarmtrain.train import Checkpoint, configure_threads, save_checkpoint
from swarmtrain.train.device import resolve_device

log = logging.getLogger(__name__)

P2P_ATTEMPTS = 3  # starts of the p2p daemon when none of the peers in node.join answered
SETTLE_WAIT_S = 3.0  # how long a node catching up holds out for a donor that trains (``_catch_up_until``)
CATCH_UP_NOTE_S = 5.0  # how often a node still catching up logs what it sees (a joiner once waited 30 s unexplained)
HELD_ROUNDS = 1024  # rounds a node remembers the state it held in (a record lags a heartbeat or two behind its peer)


class NodeError(SwarmtrainError):
    """The node cannot start or reach the swarm."""


async def start_p2p(config: Config, identity: Path | None) -> P2P:
    """Start the p2pd daemon; an unreachable --join address becomes a clear error."""
    node = config.node
    kwargs: dict[str, Any] = {"host_maddrs": node.host, "announce_maddrs": node.announce or None}
    if node.use_auto_relay:  # inbound connections through relays (see ``net.reachability``)
        kwargs.update(use_auto_relay=True, trusted_relays=node.relays or None)
    if identity is not None:
        identity.parent.mkdir(parents=True, exist_ok=True)
        kwargs["identity_path"] = str(identity)
    for attempt in range(P2P_ATTEMPTS):
        try:
            return await P2P.create(initial_peers=node.join or None, **kwargs)
        except Exception as exc:
            error = exc
            if not node.join or attempt + 1 == P2P_ATTEMPTS:
                break
            # The daemon gives up on its bootstrap peers within a second or two; a busy peer may answer later.
            log.warning("could not reach the peers in node.join (%s); trying again", exc)
            await asyncio.sleep(2.0 * (attempt + 1))
    raise NodeError(
        f"node error: could not start the p2p daemon or reach the peers in node.join ({error}). Check that "
        "each --join address is the full line a running peer printed and that its port is reachable; "
        "`swarmtrain status --join ADDR` tests one address."
    ) from None


async def start_dht(p2p: P2P, config: Config, private_key: RSAPrivateKey, client: bool = False) -> DHTNode:
    validator = CompositeValidator(record_validators(config.node.run_id, private_key))
    try:
        return await DHTNode.create(
            p2p=p2p, initial_peers=config.node.join or None, client_mode=client, record_validator=validator,
            ensure_bootstrap_success=True,
        )  # fmt: skip
    except Exception as exc:
        raise NodeError(
            f"node error: none of the peers in node.join answered as a DHT peer ({exc}). Check the addresses "
            "and that those peers are running."
        ) from None


@contextlib.asynccontextmanager
async def dht_client(config: Config) -> AsyncIterator[DHTNode]:
    """A DHT client reached through node.join, with a throwaway identity, for reading the swarm's records
    (`swarmtrain status`, the swarm's dashboard): it stores nothing and trains nothing."""
    p2p = await start_p2p(config, None)
    try:
        dht = await start_dht(p2p, config, RSAPrivateKey(), client=True)
        try:
            yield dht
        finally:
            await dht.shutdown()
    finally:
        await p2p.shutdown()


def join_peers(config: Config) -> list[str]:
    """The peer ids in node.join (the peers this node checks the swarm key with)."""
    return list(dict.fromkeys(addr.rsplit("/p2p/", 1)[1].split("/")[0] for addr in config.node.join))


def join_line(maddrs: list[Any]) -> str:
    addrs = [str(m) for m in maddrs]
    public = [a for a in addrs if "/ip4/127." not in a] or addrs
    return " ".join(f"--join {a}" for a in public[:1])


class Node:
    def __init__(self, config: Config, resume: bool = False) -> None:
        self.config = config
        self.resume = resume  # continue from the latest checkpoint in the run directory
        self.run_dir = Path(config.run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.numel = 0
        # Ctrl+C: contribute what this round has, finish it, then leave (the request; the node's phase turns
        # LEAVING when it stops taking rounds, see ``Lifecycle``).
        self.leaving = False
        self.parts: dict[str, Any] = {}  # data.eval_parts: validation bytes of each part and "all" (load_parts)
        self._trainer: InnerLoop | None = None
        self._averager: Averager | None = None
        self._last_group: tuple[str, ...] = ()  # the members of my last round with others
        self._saving: asyncio.Future[None] | None = None  # the checkpoint being written beside the event loop
        self.status = NodeStatus()  # why this node is or is not contributing: DHT record, metrics, /status
        self.metrics = NodeMetrics()
        self.status.listeners.append(self.metrics.on_state)
        self._membership: Membership | None = None
        self._off_since: float | None = None  # when this node last found itself off the swarm's line (``_off_swarm``)
        # The digest of the state I began each recent round from (``swarm_round``: peers whose records lag are on my
        # line), the last HELD_ROUNDS rounds.
        self._held: dict[int, str] = {}

    def request_leave(self) -> float:
        """Leave gracefully: cut the inner steps short, contribute them to the current round, finish that round,
        then leave. Returns the seconds that may take (the caller cancels the node after them)."""
        self.leaving = True
        self.status.set(NodeState.LEAVING, "asked to leave: finishing the current round first")
        if self._trainer is not None:
            self._trainer.interrupt()
        avg = self.config.averaging
        deadline = self._averager.deadline_s() if self._averager is not None else 3 * avg.min_deadline_s
        return avg.min_gather_s + 2 * deadline + 5.0

    async def run(self) -> None:
        config, node, avg = self.config, self.config.node, self.config.averaging
        corpus = load_corpus(config.data)
        corpus.check_context(config.model.context)
        self.parts = load_parts(config.data, config.model.context)  # data.eval_parts, for the final evaluation
        checkpoint = open_run_dir(config, self.resume)  # before anything is written to the run directory
        codec_up, codec_down = get_codec(avg.codec), get_codec(avg.codec_down or avg.codec)
        attack = _hostile(config, node.data_seed or 0)
        if attack is not None:
            codec_up = attack.wrap_codec(codec_up)  # ``nan`` writes NaN payloads
        identity = Path(node.identity) if node.identity else self.run_dir / "identity.key"
        configure_threads(config.train.threads)
        auth = load_auth(node.swarm_key, node.allow_peers)  # a bad key file stops the node before it starts
        if config.train.trainer == "standard":
            resolve_device(config.train.device)  # a device asked for and absent fails before the daemon starts

        http = self._start_http()
        try:
            p2p = await start_p2p(config, identity)
        except BaseException:
            if http is not None:
                http.close()
            raise
        dht = None
        trainer: InnerLoop | None = None
        try:
            private_key = load_identity_key(identity)  # records are signed by the identity they describe
            dht = await start_dht(p2p, config, private_key)
            me = p2p.peer_id.to_base58()
            self.status.peer_id = me
            data_seed = node.data_seed if node.data_seed is not None else zlib.crc32(me.encode())
            trainer = build_inner_loop(config, corpus, data_seed)  # standard or localtrain (train.trainer)
            theta = trainer.vector()
            self.numel = theta.numel()
            link = {"up_delay_s": node.up_delay_ms / 1000, "down_delay_s": node.down_delay_ms / 1000,
                    "up_mbit": node.up_mbit, "down_mbit": node.down_mbit}  # fmt: skip
            transport = P2PTransport(p2p, auth=auth, **link)
            await serve_hello(transport)
            settings = swarm_settings(config)
            await serve_settings(transport, settings)
            await serve_dialback(transport)
            if config.attack.kind != "outsider":  # tests only: an outsider keeps trying where others would stop
                await verify_swarm(transport, join_peers(config))  # a key mismatch is an error, not a solo run
            averager = Averager(
                transport, theta, run_id=node.run_id, group_size=avg.group_size, outer_lr=avg.outer_lr,
                outer_momentum=avg.outer_momentum, codec_up=codec_up, codec_down=codec_down,
                part_numel=avg.part_numel, min_deadline=avg.min_deadline_s, deadline_factor=avg.deadline_factor,
                fail_at=avg.fail_at, test_skew_at=avg.test_skew_at, error_feedback=avg.error_feedback,
                shapes=trainer.shapes,
                aggregator=parse_aggregator(avg.aggregator, private=node.private), attack=attack,
                ban_rounds=avg.ban_rounds, signer=RoundSigner(private_key), verify=config.verify,
                max_weight=EQUAL_WEIGHT if avg.weighting == "equal" else MAX_WEIGHT,
            )  # fmt: skip
            self._trainer, self._averager = trainer, averager
            if checkpoint is not None:
                self._restore(checkpoint, trainer, averager)
            await averager.start()
            maddrs = await p2p.get_visible_maddrs()
            record = PeerRecord(
                peer_id=me, addrs=[str(m) for m in maddrs], proto=PROTOCOL_VERSION, run_id=node.run_id,
                round=averager.round, phase="training", tokens_per_s=0.0, batch_size=config.train.batch_size,
                digest=averager.outer.digest() if checkpoint is not None else "", device=trainer.device,
                state=str(self.status.state), reason=self.status.reason[:240],
            )  # fmt: skip
            signer, _ = record_validators(node.run_id, private_key)
            bootstrap = join_peers(config)  # asked back into the DHT's routing table when a lookup finds no one
            membership = Membership(dht, signer, record, ttl=node.record_ttl_s, auth=auth, bootstrap=bootstrap)
            self._membership = membership
            if avg.weighting == "tokens" and averager.aggregator.cap > 0:  # a swarm that caps weights: by records too
                averager.matchmaker.published_tokens = membership.published_tokens
            self.status.listeners.append(lambda state, why: membership.update(state=str(state), reason=why[:240]))
            self.status.peers_source = lambda: _peer_table(membership)
            write_resolved(config, self.run_dir)
            (self.run_dir / "join.txt").write_text("\n".join(str(m) for m in maddrs) + "\n")
            print(f"peer {me} is up; to join this swarm run: swarmtrain node {join_line(maddrs)}", flush=True)
            await membership.refresh()  # a first look, before this node shows itself to the swarm
            await self._check_settings(transport, membership, settings)
            await membership.publish()
            await membership.refresh()
            heartbeat = asyncio.create_task(membership.run(node.heartbeat_s))
            forger = None
            if config.attack.kind == "forge-records":  # tests only
                forger = asyncio.create_task(_forge_records(membership, node.heartbeat_s))
            reachable = asyncio.create_task(self._check_reachability(transport, membership, maddrs))
            try:
                await self._wait_for_peers(membership, transport, averager.header)
                await self._sync_on_start(averager, membership, trainer)
                await self._train(trainer, averager, membership, transport)
            finally:
                for task in (heartbeat, reachable, forger):
                    if task is not None:
                        task.cancel()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(membership.leave(), 3.0)
                if self._saving is not None:  # stopped while a round's checkpoint was being written: it ends first
                    await asyncio.wait([self._saving])
                await asyncio.to_thread(trainer.stop)  # an interrupted round's steps end before the checkpoint
                self._checkpoint(trainer, averager)
        finally:
            if trainer is not None:  # localtrain: stage processes and shared memory are released here
                await asyncio.to_thread(trainer.close)
            if dht is not None:
                with contextlib.suppress(Exception):
                    await dht.shutdown()
            await p2p.shutdown()
            if http is not None:
                http.close()

    def _start_http(self) -> ObserveServer | None:
        """The /status and /metrics endpoint when observe.http_port is set (before the daemon: a port in use is
        an error at once, not after the node joined)."""
        observe = self.config.observe
        if observe.http_port is None:
            return None
        try:
            server = ObserveServer(
                self.status.snapshot, self.metrics.registry, observe.http_host, observe.http_port, pages=dashboard()
            )
        except OSError as exc:
            raise NodeError(
                f"node error: cannot serve observe.http_port={observe.http_port} on {observe.http_host} "
                f"({exc.strerror}); pick a free port, or 0 for any."
            ) from None
        server.start()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "http.txt").write_text(server.url + "\n")
        print(f"dashboard at {server.url}/ (and {server.url}/status, {server.url}/metrics)", flush=True)
        return server

    async def _check_settings(self, transport: Any, membership: Membership, settings: dict[str, Any]) -> None:
        """Stop before training if the swarm's settings differ from mine (see ``swarmtrain.node.settings``); the
        record that says so is published as a leave, so no peer puts this node in a group."""
        others = [p for p in membership.view if p != membership.record.peer_id]
        try:
            await check_settings(transport, [*join_peers(self.config), *others], settings)
        except ConfigMismatch as exc:
            self.status.set(NodeState.CONFIG_MISMATCH, exc.summary)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(membership.leave(), 3.0)
            raise

    async def _check_reachability(self, transport: Any, membership: Membership, maddrs: list[Any]) -> None:
        """Ask peers to dial this node back on its addresses (``net.reachability``), once one is there; a node no
        peer can dial is told so, with the fix. "auto" skips a node that only has loopback addresses."""
        node = self.config.node
        addrs = dialable(maddrs)
        if node.reachability == "off" or not addrs:
            return
        if node.reachability == "auto" and all(is_loopback(a) for a in addrs):
            return
        me = transport.peer_id
        for _ in range(120):  # up to 10 minutes for a first peer
            peers = [*join_peers(self.config), *(p for p in membership.view if p != me)]
            if peers:
                break
            await asyncio.sleep(5.0)
        else:
            return
        result = await ask_dialback(transport, peers, addrs)
        if result.known and not result.ok:
            log.warning("%s: %s", result.summary(), FIX)
            self.status.event("unreachable", result.summary())
        else:
            log.info("%s", result.summary())

    async def _wait_for_peers(self, membership: Membership, transport: Transport, header: dict[str, Any]) -> None:
        """Wait until node.min_peers peers are in the view, and then until as many of them see as many (their
        records say ``ready``, or they have started): nodes that start together start in the same round. Without
        the second wait, the nodes that saw the swarm first trained in groups without the others, who were still
        waiting for a record or two to reach them. Then, for at most ``REACH_WAIT_S``, until each peer seen
        answers a ping (``reach``): a first round whose members cannot dial each other yet is lost."""
        node = self.config.node
        deadline = time.monotonic() + node.min_peers_timeout_s
        me = membership.record.peer_id

        def ready() -> int:
            return 1 + sum(r.ready or r.state != "starting" for p, r in membership.view.items() if p != me)

        if len(membership.view) < node.min_peers:
            print(f"waiting for {node.min_peers} peers (node.min_peers) ...", flush=True)
            self.status.set(NodeState.STARTING, f"waiting for {node.min_peers} peers (node.min_peers)")
        while len(membership.view) < node.min_peers and time.monotonic() < deadline:
            await asyncio.sleep(min(0.2, node.heartbeat_s))
        membership.update(ready=True)
        if node.min_peers > 1:
            await membership.publish()
            if ready() < node.min_peers:
                self.status.set(NodeState.STARTING, f"sees {len(membership.view)} peers; waiting for "
                                f"{node.min_peers} of them to see as many (node.min_peers)")  # fmt: skip
            while ready() < node.min_peers and time.monotonic() < deadline:
                await asyncio.sleep(min(0.2, node.heartbeat_s))
        if ready() < node.min_peers:
            waited = time.monotonic() - deadline + node.min_peers_timeout_s
            log.warning("only %d of node.min_peers=%d peers ready after %.0f s; training anyway",
                        ready(), node.min_peers, waited)  # fmt: skip
        if node.min_peers > 1:  # a record seen is not a connection made: reach them before the first round
            self.status.set(NodeState.STARTING, f"reaching the {len(membership.view) - 1} peers it sees")
            wait_s = min(REACH_WAIT_S, max(deadline - time.monotonic(), 0.0))
            reached = await reach(transport, header, lambda: list(membership.view), wait_s)  # less me: reach
            missed = [p[-8:] for p in membership.view if p != me and p not in reached]
            if missed:
                log.warning("could not reach %s in %.0f s (they may lead or join groups I cannot reach); training "
                            "anyway", missed, wait_s)  # fmt: skip

    def _hold(self, round_: int, digest: str) -> None:
        """Remember that I began round ``round_`` from the state ``digest`` (and forget the rounds past it: after a
        catch-up that went back, those were another line's)."""
        self._held = {r: d for r, d in self._held.items() if round_ - HELD_ROUNDS < r < round_}
        self._held[round_] = digest

    def _off_swarm(self, membership: Membership, averager: Averager) -> bool:
        """Whether this node, between two rounds in step or solo, has been off the swarm's line (``off_swarm``: more
        than one round from what the peers in step hold) for long enough to go to the swarm's state. Long enough: the
        records of peers that died meanwhile are gone from the view (``node.record_ttl_s`` in the DHT, as long again
        in the view), so the rounds of the dead do not count."""
        if averager.lifecycle.phase not in (Phase.SOLO, Phase.IN_STEP) or not off_swarm(
            membership.view, averager.me, averager.round, self._held
        ):
            self._off_since = None
            return False
        now, node = time.monotonic(), self.config.node
        if self._off_since is None:
            self._off_since = now
        if now - self._off_since < 2 * (node.record_ttl_s + node.heartbeat_s):
            return False
        log.warning(
            "round %d is more than one round from the swarm's (%d): taking the swarm's state",
            averager.round, swarm_round(membership.view, averager.me, averager.round, self._held),
        )  # fmt: skip
        self._off_since = None
        return True

    async def _catch_up(self, averager: Averager, membership: Membership, trainer: InnerLoop, wait_s: float) -> None:
        """Download theta_g from a peer that is at our round or later (a joiner, or a node left out of a round), or
        from the peers around the swarm's round where ours is more than one from it (``off_swarm``), even behind.

        Peers publish the digest of their theta_g with their round; the state is the one most of those peers hold,
        taken from peers whose bytes hash to the digest they serve.
        """
        averager.matchmaker.catching_up = True
        try:
            await self._catch_up_until(averager, membership, trainer, time.monotonic() + wait_s)
        finally:
            averager.matchmaker.catching_up = False

    async def _catch_up_until(
        self, averager: Averager, membership: Membership, trainer: InnerLoop, deadline: float
    ) -> None:
        membership.update(phase="syncing")
        self.status.set(NodeState.CATCHING_UP, f"looking for peers ahead of round {averager.round}")
        # How long to hold out for a donor that trains rather than one that averages (see below): a few heartbeats.
        # Not the whole catch-up: donors whose group waits for me (my record is in their view) average for most of
        # each round, and a node that held out for 30 s missed every round in between (found under load).
        patient_until = min(deadline, time.monotonic() + max(SETTLE_WAIT_S, 4 * self.config.node.heartbeat_s))
        noted = time.monotonic()  # when the log last said what this node sees while it waits for a donor
        # (donor, digest) of the downloads that failed in this catch-up: other donors first. A killed donor's record
        # stays in view for node.record_ttl_s, and while the live peers averaged it was the one donor in its inner
        # phase, tried again every heartbeat until its record went. A donor that has moved on since is fresh again.
        failed: set[tuple[str, str]] = set()
        while True:
            mine = (averager.round, averager.outer.digest())
            # The donors: the peers at my round or later; where my round is more than one from the swarm's (a split
            # that healed: ``off_swarm``), those around the swarm's round instead, before or after mine.
            swarm = swarm_round(membership.view, averager.me, mine[0], self._held)
            off = off_swarm(membership.view, averager.me, mine[0], self._held)
            ahead = [
                r
                for p, r in membership.view.items()
                if p != averager.me and r.digest and r.phase != "syncing"
                and (abs(r.round - swarm) <= 1 if off else r.round >= mine[0])
            ]  # fmt: skip
            if not ahead and any(p != averager.me and (r.round, r.digest) == mine for p, r in membership.view.items()):
                # No one is ahead, and peers that are catching up too hold my state (we were cut off together):
                # there is nothing to fetch; train on with them.
                log.info("no peer is ahead; peers catching up hold my state (round %d): training on", mine[0])
                averager.lifecycle.advance(Event.FOUND_IN_STEP)
                return
            others = [r for p, r in membership.view.items() if p != averager.me]
            behind = all(r.round < mine[0] and r.state in NOT_IN_STEP for r in others)
            if not ahead and others and behind and time.monotonic() > patient_until:
                # Every peer I see is behind me and starting or catching up itself (fresh processes that joined
                # after my group died): no one holds a later state, and they will catch up from me. Waiting out the
                # whole catch-up kept them waiting too (30 s in the churn lab). Peers in step but behind are still
                # finishing the round I was left out of: I wait for its state as before.
                log.info(
                    "no peer is ahead of round %d, %d are behind: training on from my state", mine[0], len(others)
                )
                averager.lifecycle.advance(Event.NO_DONOR)
                return
            if ahead:
                # The round and digest most peers hold, not the highest claim: one peer cannot drag us forward.
                (target, digest), _ = Counter((r.round, r.digest) for r in ahead).most_common(1)[0]
                if (target, digest) == mine:
                    log.info("in step with the swarm at round %d (digest %s)", target, digest[:8])
                    averager.lifecycle.advance(Event.FOUND_IN_STEP)
                    return
                # Peers averaging a round publish its start state, which their group is about to replace: a node
                # that downloads it could not sit in on that round any more. Take the state of peers that train
                # (or are done), at most one round past what most peers hold; the averaging ones' only after a
                # few heartbeats without such a peer.
                settled = [
                    r for r in ahead
                    if r.phase in ("training", "done") and r.round <= target + 1
                    and (r.peer_id, r.digest) not in failed
                ]  # fmt: skip
                if settled:
                    (target, digest), _ = Counter((r.round, r.digest) for r in settled).most_common(1)[0]
                    ahead = settled
                elif time.monotonic() <= patient_until:
                    ahead = []
            if ahead:
                donors = [r.peer_id for r in ahead if (r.round, r.digest) == (target, digest)]
                donors = sorted(donors, key=lambda p: (p, digest) in failed)  # stable: the untried first
                gap = f"{target - mine[0]} rounds behind" if target >= mine[0] else f"{mine[0] - target} rounds ahead"
                self.status.set(
                    NodeState.CATCHING_UP,
                    f"from {donors[0][-8:]}{f' (or {len(donors) - 1} more)' if len(donors) > 1 else ''}: round "
                    f"{mine[0]} -> {target}, {gap}",
                )
                if await averager.fetch_state(donors, digest, max_round=target, rewind=off):
                    if averager.round < mine[0]:
                        log.warning(
                            "went back from round %d to the swarm's round %d: my state was not the swarm's (a split "
                            "that healed); the rounds since are dropped", mine[0], averager.round,
                        )  # fmt: skip
                    log.info("caught up with the swarm at round %d (digest %s)", averager.round, digest[:8])
                    self._load_theta(trainer, averager)
                    averager.lifecycle.advance(Event.SYNCED)  # sits in on the round it caught up into
                    return
                failed.update((p, digest) for p in donors)
            if time.monotonic() > deadline:
                log.warning("could not catch up with the swarm; training on from my own state")
                averager.lifecycle.advance(Event.NO_DONOR)
                return
            if time.monotonic() - noted >= CATCH_UP_NOTE_S:
                noted = time.monotonic()
                seen = [
                    f"{p[-8:]} round {r.round} {r.phase} {r.digest[:8] or 'no digest'}"
                    for p, r in membership.view.items()
                    if p != averager.me
                ]
                log.info(
                    "still no donor for round %d; %d peers in view: %s", averager.round, len(seen),
                    "; ".join(seen[:8]) + (f" (+{len(seen) - 8})" if len(seen) > 8 else ""),
                )  # fmt: skip
            await asyncio.sleep(self.config.node.heartbeat_s)
            await membership.refresh()

    async def _sync_on_start(self, averager: Averager, membership: Membership, trainer: InnerLoop) -> None:
        """A node that joins a swarm already under way (or resumes behind it) downloads theta_g before training;
        a resumed node whose peers hold its round and digest just continues. Only the members of my own group for
        my round count: with gossip groups, another group may finish round 0 while mine still waits for me (a node
        that started with the swarm but saw the last ``ready`` record a few heartbeats after the others did). Taking
        their round for news that I am behind, I caught up instead of joining my group, which then went without
        me (found by tests/test_swarm.py under load)."""
        round_, digest = averager.round, averager.outer.digest()
        group = leader_candidates(list(membership.view), averager.me, averager.group_size, self.config.node.run_id,
                                  round_)  # fmt: skip
        others = [membership.view[p] for p in group if p != averager.me]
        if any(r.round > round_ or (r.round == round_ > 0 and r.digest not in ("", digest)) for r in others):
            await self._catch_up(averager, membership, trainer, wait_s=30.0)

    def _restore(self, checkpoint: Checkpoint, trainer: InnerLoop, averager: Averager) -> None:
        """theta_g, the outer momentum, the round and the inner trainer's state from a checkpoint (``--resume``)."""
        round_, tensors = outer_state(checkpoint, momentum=averager.outer.buf is not None)
        trainer.restore(checkpoint)
        try:
            averager.outer.load_state_tensors(tensors)
        except ValueError as exc:
            raise CheckpointError(
                f"checkpoint error: the outer state in {checkpoint.path} does not fit this model ({exc}). Resume "
                "with the model settings it was written with, or start a new run with a new --run-dir."
            ) from None
        averager.round = round_
        self._load_theta(trainer, averager)
        print(f"resumed from {checkpoint.path.name}: round {round_}, digest {averager.outer.digest()[:8]}", flush=True)

    def _load_theta(self, trainer: InnerLoop, averager: Averager) -> None:
        trainer.load_vector(averager.outer.theta)

    async def _train(self, trainer: InnerLoop, averager: Averager, membership: Membership, transport: Any) -> None:
        config, node, avg = self.config, self.config.node, self.config.averaging
        started = time.perf_counter()
        self._logged_at = 0.0  # seconds after ``started`` of the last round line (``_log_round``)
        last_inner = 0.0
        whole_inner = 0.0  # my last inner phase that Ctrl+C did not cut short: what my peers still train
        # node.overlap: the inner steps of the next round, started beside this round's exchange; a checkpoint that
        # waits for them to end.
        pending: asyncio.Task | None = None
        checkpoint_due = False
        ended: float | None = None  # when my last inner phase ended: the trainer is idle from then to the next

        def timed_steps() -> tuple[float, int, float, float]:  # the loss, tokens, seconds, and when they began
            began = time.perf_counter()
            return *trainer.run(node.inner_steps, node.inner_time_s, node.test_step_delay_s, node.slowdown), began

        def inner_steps() -> Awaitable[tuple[float, int, float, float]]:
            return asyncio.to_thread(timed_steps)

        def time_up() -> bool:
            return config.train.max_time is not None and time.perf_counter() - started > config.train.max_time

        async def drop_pending() -> None:  # a round that did not end in step: its next steps train on as they are
            nonlocal pending, ended
            if pending is not None:
                _, _, inner_s, began = await pending
                pending, ended = None, began + inner_s

        while node.rounds == 0 or averager.round < node.rounds:
            if pending is None and (self.leaving or time_up()):
                break
            if self._off_swarm(membership, averager):
                await drop_pending()  # steps from a state the swarm does not hold
                averager.lifecycle.advance(Event.OFF_SWARM)
            if averager.lifecycle.phase is Phase.CATCH_UP:
                await self._catch_up(averager, membership, trainer, wait_s=max(30.0, 4 * last_inner))
                if node.rounds and averager.round >= node.rounds:
                    break  # caught up with the swarm's final state: a round more would wait for a group in vain
            if membership.record.round != averager.round:  # caught up, or a round failed: no round just done
                membership.update(loss=None, bpb=None, bytes_sent=0)
            # The state I begin this round from (after a catch-up, no longer the last round's): what peers that look
            # for a donor, or for my line (``swarm_round``), read beside my round.
            self._hold(averager.round, averager.outer.digest())
            membership.update(round=averager.round, phase="training", digest=averager.outer.digest())
            observing = averager.lifecycle.phase is Phase.OBSERVE
            if observing:
                # Just synced while the others train this round: join its group at once as an observer
                # (weight 0, no update) and receive its average, so from the next round on we are in step.
                loss, tokens, idle = float("nan"), 0, 0.0
                self.status.set(NodeState.OBSERVING, f"sitting in on round {averager.round} with weight 0")
            else:
                if not self.leaving:
                    self.status.set(NodeState.TRAINING, f"inner steps of round {averager.round}")
                if pending is not None:
                    loss, tokens, inner_s, began = await pending
                    pending = None
                else:
                    loss, tokens, inner_s, began = await inner_steps()
                idle = 0.0 if ended is None else max(began - ended, 0.0)
                ended = began + inner_s
                if checkpoint_due:  # the last round's, now that no step runs
                    await self._checkpoint_serving(trainer, averager)
                    checkpoint_due = False
                last_inner = inner_s
                if not self.leaving:
                    whole_inner = inner_s
                if self.leaving and tokens == 0:
                    break  # asked to leave before a single step of this round: nothing to contribute
            local = trainer.vector()
            delta = averager.outer.theta - local
            if node.overlap and not observing and not self.leaving and not time_up():
                if node.rounds == 0 or averager.round + 1 < node.rounds:
                    pending = asyncio.create_task(inner_steps())
            membership.update(phase="averaging", tokens_per_s=tokens / max(last_inner, 1e-9), inner_s=last_inner)
            if not self.leaving and not observing:
                beside = ", the next round's inner steps beside it" if pending is not None else ""
                self.status.set(NodeState.AVERAGING, f"outer step of round {averager.round}{beside}")
            await membership.publish()
            sent, received = transport.counter.sent, transport.counter.received
            live = list(membership.view)
            if len(live) == 1 and not averager.lifecycle.solo:
                # A lookup that shows no one else (the DHT under load, or stalled by a frozen peer) is not news
                # that everyone left: meet last round's group; the ones that are gone are found by ping.
                live = [p for p in self._last_group if p not in membership.left] or live
            candidates = leader_candidates(live, averager.me, averager.group_size, node.run_id, averager.round)
            # Leaving, I cut my steps short, but my group did not: as its leader I wait as if I had not.
            gather = self._gather_timeout(membership, set(candidates), max(last_inner, whole_inner))
            # A slow leader, not a dead one; sitting in (I never lead then), the rest of the others' inner phase.
            averager.matchmaker.join_timeout = max(30.0, 3 * last_inner, gather)
            try:
                await averager.reconcile()  # after a round I could not confirm: my residual to the group's decision
                weight = float(tokens) if avg.weighting == "tokens" else EQUAL_WEIGHT * (tokens > 0)
                outcome = await averager.run_round(delta, weight, candidates, set(candidates), gather)
            except (SwarmtrainError, OSError) as exc:  # a round that broke must not take the node down
                log.error("round %d failed (%r); catching up from the swarm before the next one", averager.round, exc)
                self.status.set(NodeState.LEFT_OUT, f"round {averager.round} failed ({exc}); catching up")
                averager.round += 1
                averager.lifecycle.advance(Event.FAILED)
                await drop_pending()
                continue
            if pending is not None and averager.lifecycle.phase in (Phase.SOLO, Phase.IN_STEP):
                trainer.merge(averager.outer.theta, node.overlap_keep)  # the steps go on from the mix
            else:
                await drop_pending()
                self._load_theta(trainer, averager)
            bans = ban_table(averager.matchmaker.bans.active(averager.round))  # for `swarmtrain status`
            membership.update(bans=bans)
            self.status.set_bans({peer: ban.model_dump() for peer, ban in bans.items()})
            misses = [Miss(*m) for m in averager.matchmaker.misses]
            state, reason = round_state(outcome.outcome, outcome.group.size, observing, misses)
            if not self.leaving:
                self.status.set(state, f"round {outcome.round}: {reason}")
            if observing and outcome.group.size == 1:
                # The round I caught up into was over before I could sit in (its group formed while I downloaded):
                # still syncing, not a round I took part in. Catch up with the next one.
                log.info("round %d was over before I could sit in; catching up again", outcome.round)
                continue
            # What a dashboard of the swarm shows of the round just done (`swarmtrain dashboard --join`), in the
            # same update as the round it describes; its held-out bpb follows when measured.
            claims = {
                "loss": _bounded(loss, MAX_LOSS), "bpb": None, "tokens": min(trainer.tokens, MAX_COUNT),
                "bytes_sent": min(transport.counter.sent - sent, MAX_COUNT),
            }  # fmt: skip
            membership.update(round=averager.round, digest=outcome.digest, **claims)
            if outcome.group.size > 1:
                self._last_group = outcome.group.members
            bpb = None
            if node.eval_every and averager.round % node.eval_every == 0:
                if pending is not None:  # theta_g, on a copy, beside the steps
                    bpb = await asyncio.to_thread(trainer.evaluate_theta, averager.outer.theta)
                else:
                    bpb = await asyncio.to_thread(trainer.evaluate)
                membership.update(bpb=_bounded(bpb, MAX_LOSS))
            speed = tokens / last_inner if tokens and last_inner > 0 else 0.0
            inner = 0.0 if observing else last_inner
            self._log_round(
                outcome, loss, tokens, speed, inner, idle, trainer.device, transport, sent, received, bpb, started
            )  # fmt: skip
            if averager.round % node.checkpoint_every == 0:
                if pending is None:
                    await self._checkpoint_serving(trainer, averager)
                else:
                    checkpoint_due = True
            if self.leaving and pending is None:
                with contextlib.suppress(Exception):  # at once: the others must not wait for me next round
                    await asyncio.wait_for(membership.leave(), 3.0)
                log.info("left after finishing round %d", outcome.round)
                break
        if not self.leaving:
            await self._finish(trainer, averager, membership, last_inner)
        else:
            averager.lifecycle.advance(Event.LEAVE)
            self.status.set(NodeState.LEAVING, f"left after round {averager.round - 1}")
        bpb = await asyncio.to_thread(trainer.evaluate)
        final = {"kind": "final", "peer_id": averager.me, "round": averager.round, "bpb": bpb,
                 "elapsed_s": round(time.perf_counter() - started, 3), "tokens": trainer.tokens}  # fmt: skip
        on_parts = ""
        if self.parts:  # data.eval_parts: the same model on each part's held-out text and on all of them
            final["bpb_parts"] = {
                name: await asyncio.to_thread(trainer.evaluate, val) for name, val in self.parts.items()
            }
            on_parts = " (" + ", ".join(f"{name} {v:.3f}" for name, v in final["bpb_parts"].items()) + ")"
        self._append(final)
        print(f"node {averager.me[-8:]}: {averager.round} rounds, held-out bpb {bpb:.3f}{on_parts}", flush=True)

    async def _finish(self, trainer: InnerLoop, averager: Averager, membership: Membership, last_inner: float) -> None:
        """The end of a run of fixed length (``--rounds``), so the swarm ends it holding one model.

        A node left out of its last round catches up with the others' final state instead of ending on its own;
        a node in step serves its final state a while longer to peers that are not (bounded: ``node.record_ttl_s``
        past the last sight of a dead one, a few all-reduce deadlines for a live one).
        """
        if averager.lifecycle.phase is Phase.CATCH_UP:
            await self._catch_up(averager, membership, trainer, wait_s=max(30.0, 4 * last_inner))
        averager.lifecycle.advance(Event.FINISH)
        mine = (averager.round, averager.outer.digest())
        membership.update(round=mine[0], digest=mine[1], phase="done")
        self.status.set(NodeState.DONE, f"finished {mine[0]} rounds; serving the final state to peers behind")
        await membership.publish()
        until = time.monotonic() + self.config.averaging.min_gather_s + 4 * averager.deadline_s()
        waiting: set[str] = set()
        while time.monotonic() < until:
            behind = {
                p for p, r in membership.view.items()
                if r.phase != "done" and r.round <= mine[0] and (r.round, r.digest) != mine
            }  # fmt: skip
            if not behind:
                return
            if behind - waiting:
                log.info("serving the final state to %d peers that are not in step yet", len(behind))
            waiting = behind
            await asyncio.sleep(self.config.node.heartbeat_s)
            await membership.refresh()

    def _gather_timeout(self, membership: Membership, expected: set[str], last_inner: float) -> float:
        """How long this node, as leader, waits for expected members that have not joined yet.

        At least ``averaging.min_gather_s`` or one inner phase of mine (a peer slowed by a busy machine is late by
        a fraction of its phase, not more, and waiting costs nothing once everyone joined); for peers with longer
        inner phases (another H,
        a slower machine), up to the end of theirs, but never more than twice my own: a slower peer does not
        hold the group, its update joins a later round (the staleness rule). A node that has not trained yet
        (a joiner sitting in on its first round, which joins and does not lead) waits on its leader as long: the
        others' whole inner phase.
        """
        floor = max(self.config.averaging.min_gather_s, last_inner)
        peers = [r.inner_s for p, r in membership.view.items() if p in expected and p != membership.record.peer_id]
        slowest = max(peers, default=0.0)
        if last_inner > 0:
            slowest = min(slowest, 2 * last_inner)
        return max(floor, 1.25 * slowest - last_inner)

    def _log_round(
        self, outcome: RoundOutcome, loss: float, tokens: int, tokens_per_s: float, inner_s: float, idle_s: float,
        device: str, transport: Any, sent: int, received: int, bpb: float | None, started: float,
    ) -> None:  # fmt: skip
        group = outcome.group
        mine = dict(zip(group.members, group.weights, strict=True)).get(transport.peer_id, 0.0)
        elapsed = time.perf_counter() - started
        wall, self._logged_at = elapsed - self._logged_at, elapsed  # since the last round line (or the start)
        record = {
            "kind": "round",
            "round": outcome.round,
            "peer_id": transport.peer_id,
            "group_id": outcome.group.group_id,
            "group_size": outcome.group.size,
            "group": list(outcome.group.members),
            "weights": list(outcome.group.weights),
            "digest": outcome.digest,
            "loss": None if loss != loss else loss,
            "tokens": tokens,
            "device": device,
            "tokens_per_s": round(tokens_per_s, 1),
            "inner_s": round(inner_s, 4),  # seconds of inner steps this round
            "wall_s": round(wall, 4),  # wall time since the last round line: inner steps, averaging, catching up
            # The trainer's idle seconds between my last inner phase and this one (an exchange, an evaluation, a
            # wait for the group; with node.overlap, hardly any), and the share of the time spent in inner steps.
            "idle_s": round(idle_s, 4),
            "utilisation": round(inner_s / (inner_s + idle_s), 4) if inner_s > 0 else 0.0,
            "token_share": round(mine / sum(group.weights), 6) if sum(group.weights) > 0 else 0.0,
            "bytes_sent": transport.counter.sent - sent,
            "bytes_received": transport.counter.received - received,
            "bytes_per_param": round((transport.counter.sent - sent) / self.numel, 6),
            "bytes_resent": outcome.resent,  # of bytes_sent: sent again to a member whose stream broke
            "duration_s": round(outcome.duration_s, 4),
            "codec": self.config.averaging.codec,
            "outcome": outcome.outcome,
            "applied_fraction": outcome.applied_fraction,
            "excluded": outcome.excluded,
            "elapsed_s": round(elapsed, 3),
            "state": str(self.status.state),
            "state_reason": self.status.reason,
        }
        if self.status.bans:
            record["bans"] = dict(self.status.bans)
        if outcome.checked:  # averaging.verify: the parts of other reducers' shards this node checked
            record["checked"] = [{"shard": j, "part": p, "outcome": how} for j, p, how in outcome.checked]
        if bpb is not None:
            record["bpb"] = bpb
        if outcome.spread is not None:
            record["spread"] = outcome.spread
        if outcome.phases:
            record["phases"] = outcome.phases
        self._append(record)
        self.status.add_round(record)
        self.metrics.on_round(record, len(self._membership.view) if self._membership is not None else 1)
        log.info(
            "round %d: %s in a group of %d, loss %.3f, %.2f s, digest %s",
            outcome.round, outcome.outcome, outcome.group.size, loss, outcome.duration_s, outcome.digest[:8],
        )  # fmt: skip

    def _append(self, record: dict[str, Any]) -> None:
        record = {**record, "time": round(time.time(), 3)}  # wall clock: merges several nodes' metrics (scenarios)
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    async def _checkpoint_serving(self, trainer: InnerLoop, averager: Averager) -> None:
        """``_checkpoint`` in a thread, so that the event loop goes on answering the swarm (a round's last relays,
        pings, a joiner's state download) while the state is written and synced to disk: seconds for a large model.
        Nothing changes that state meanwhile: no inner step runs, and only the round loop, which waits here, starts
        one or a round."""
        self._saving = asyncio.ensure_future(asyncio.to_thread(self._checkpoint, trainer, averager))
        await asyncio.shield(self._saving)  # a stopped node waits for it before its last checkpoint

    def _checkpoint(self, trainer: InnerLoop, averager: Averager) -> None:
        tensors, meta = trainer.state(averager.outer.theta)
        tensors.update({f"outer.{k}": v for k, v in averager.outer.state_tensors().items()})
        meta.update({"round": averager.round, "digest": averager.outer.digest()})
        save_checkpoint(self.run_dir, tensors, meta, keep=self.config.train.keep_checkpoints)


def _bounded(value: float, limit: float) -> float | None:
    """``value`` if a record may carry it (finite, in [0, limit]), else None: a record is never copied with a value
    its readers would refuse, which would drop this node from every view."""
    return value if 0.0 <= value <= limit else None


async def _forge_records(membership: Membership, period: float) -> None:
    """attack.kind = forge-records (tests only): every ``period`` seconds, a record for every other peer in view,
    stored under this node's own key, saying that peer left and is far ahead."""
    while True:
        for peer, record in list(membership.view.items()):
            if peer == membership.record.peer_id:
                continue
            lie = record.model_copy(update={"round": record.round + FORGED_AHEAD, "phase": "leaving"}).model_dump()
            subkey = peer.encode() + membership.subkey[len(membership.record.peer_id) :]  # its id, my key
            with contextlib.suppress(Exception):
                value = {**lie, "mac": membership.auth.seal(subkey, lie)}
                await membership.dht.store(membership.key, value, get_dht_time() + membership.ttl, subkey=subkey)
        await asyncio.sleep(period)


def _hostile(config: Config, seed: int) -> Attack | None:
    """The test-only attack of ``attack.kind`` (the config refuses it without ``attack.test_only``)."""
    if not config.attack.kind:
        return None
    log.warning("TEST ONLY: this node is hostile (attack.kind = %s): its updates are not honest", config.attack.kind)
    return Attack(config.attack.kind, scale=config.attack.scale, z=config.attack.z, seed=seed)


def _peer_table(membership: Membership) -> dict[str, dict[str, Any]]:
    """Each peer in the view as /status shows it (read from the HTTP thread: the view is replaced, never mutated)."""
    return {peer: peer_row(record) for peer, record in membership.view.items()}
