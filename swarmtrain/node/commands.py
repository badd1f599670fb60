"""Process-level entry points: run a node or a bootstrap peer until Ctrl+C, query the swarm's status.

Ctrl+C (or SIGTERM, or SIGHUP when the terminal closes, unless started under nohup) leaves gracefully: the node
cuts its inner steps short, contributes them to the current round and finishes it (bounded by the round's
deadline), then announces its leave, writes a checkpoint and stops its daemons; a second Ctrl+C exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import uvloop
from rich.console import Console
from rich.table import Table
from rich.text import Text

from swarmtrain.config import Config
from swarmtrain.dht import PeerRecord, load_identity_key, swarm_records
from swarmtrain.logs import current_log_format
from swarmtrain.memory import reuse_freed_memory
from swarmtrain.net import P2PTransport, load_auth, serve_hello
from swarmtrain.net.reachability import serve_dialback
from swarmtrain.node.node import Node, NodeError, dht_client, join_line, start_dht, start_p2p
from swarmtrain.node.observe import ObserveServer, dashboard
from swarmtrain.node.panel import Panel
from swarmtrain.node.settings import serve_settings, swarm_settings
from swarmtrain.node.swarmview import SwarmMetrics, SwarmView, watch
from swarmtrain.signals import STOP_SIGNALS, handled_by_loop


def run_until_interrupted(main: Callable[[], Awaitable[None]], leave: Callable[[], float] | None = None) -> None:
    """Run ``main`` in a uvloop loop until it returns. The first SIGINT/SIGTERM/SIGHUP calls ``leave()``, which
    starts a clean leave and returns the seconds it may take, then cancels ``main`` after them (at once without
    ``leave``); the second exits at once. The loop's handlers work however the process was started (also with
    SIGINT ignored)."""

    async def runner() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        signals = 0

        def on_signal() -> None:
            nonlocal signals
            signals += 1
            if signals == 1:
                print("leaving the swarm gracefully (press Ctrl+C again to exit at once)", flush=True)
                loop.call_later(leave() if leave is not None else 0.0, task.cancel)
            else:
                os._exit(130)

        for sig in STOP_SIGNALS:
            if handled_by_loop(sig):
                loop.add_signal_handler(sig, on_signal)
        with contextlib.suppress(asyncio.CancelledError):
            await main()

    uvloop.run(runner())


def run_node(config: Config, resume: bool = False) -> None:
    """Run a node until it finishes or is stopped: a live panel on a terminal, a line per round otherwise."""
    reuse_freed_memory()  # before the node allocates: its rounds free and allocate multi-MB frames
    node = Node(config, resume)
    console = Console()
    with Panel(node.status, console, live=console.is_terminal and current_log_format() == "plain"):
        run_until_interrupted(node.run, leave=node.request_leave)


def run_bootstrap(config: Config) -> None:
    """A DHT-only peer: an entry point for a public or private swarm; trains nothing."""

    async def main() -> None:
        identity = Path(config.node.identity) if config.node.identity else Path(config.run_dir) / "identity.key"
        auth = load_auth(config.node.swarm_key, config.node.allow_peers)
        p2p = await start_p2p(config, identity)
        try:
            transport = P2PTransport(p2p, auth=auth)
            await serve_hello(transport)  # joiners check their swarm key with this peer
            await serve_settings(transport, swarm_settings(config, trains=False))  # and their run id
            await serve_dialback(transport)  # and whether other machines can dial them
            dht = await start_dht(p2p, config, load_identity_key(identity))
            maddrs = await p2p.get_visible_maddrs()
            print(f"bootstrap peer {p2p.peer_id} is up; nodes join with: swarmtrain node {join_line(maddrs)}")
            try:
                await asyncio.Event().wait()
            finally:
                await dht.shutdown()
        finally:
            await p2p.shutdown()

    run_until_interrupted(main)


def run_dashboard(config: Config, host: str, port: int, poll_s: float) -> None:
    """Serve the dashboard of the swarm reached through ``node.join`` (``swarmtrain.node.swarmview``) until Ctrl+C."""
    if not config.node.join:
        raise NodeError("node error: `swarmtrain dashboard` needs --join ADDR: the address of any peer of the swarm.")
    view = SwarmView(config.node.run_id, ttl=config.node.record_ttl_s)
    metrics = SwarmMetrics(view)
    try:
        server = ObserveServer(
            view.snapshot, metrics.registry, host, port, pages=dashboard(), on_scrape=metrics.refresh
        )
    except OSError as exc:
        raise NodeError(
            f"node error: cannot serve the dashboard on {host}:{port} ({exc.strerror}); pick a free --port, or 0 "
            "for any."
        ) from None
    server.start()
    print(f"dashboard of swarm {config.node.run_id!r} at {server.url}/ (and /status, /metrics)", flush=True)
    try:
        run_until_interrupted(lambda: watch(config, view, poll_s))
    finally:
        server.close()


LOOKUPS = 3  # `swarmtrain status`: lookups of the swarm's records while they find none
LOOKUP_PAUSE_S = 2.0


async def fetch_records(config: Config) -> list[PeerRecord]:
    if not config.node.join:
        raise NodeError("node error: `swarmtrain status` needs --join ADDR: the address of any peer of the swarm.")
    auth = load_auth(config.node.swarm_key, config.node.allow_peers)
    async with dht_client(config) as dht:
        # The peer joined through answered (the client's bootstrap needs it), so a lookup that finds no record at
        # all may have missed (seen once: the private-swarm node test's status found none while the node it had
        # joined through was up and publishing). Ask again, a few times, before showing an empty swarm.
        records = await swarm_records(dht, config.node.run_id, auth)
        for _ in range(LOOKUPS - 1):
            if records:
                break
            await asyncio.sleep(LOOKUP_PAUSE_S)
            records = await swarm_records(dht, config.node.run_id, auth)
        return records


def show_status(config: Config, as_json: bool) -> None:
    records: list[PeerRecord] = []

    async def main() -> None:
        records.extend(await asyncio.wait_for(fetch_records(config), 60))

    uvloop.run(main())
    if as_json:
        print(json.dumps([r.model_dump() for r in records], indent=2))
        return
    Console().print(status_table(config.node.run_id, records))


def status_table(run_id: str, records: list[PeerRecord]) -> Table:
    """The swarm as `swarmtrain status` prints it: one row per peer, with the peers it bans (until which round,
    and why) and the loss and held-out bpb it gives for the round it last finished."""
    table = Table(title=f"swarm {run_id!r}: {len(records)} peers")
    columns = ("peer", "round", "state", "reason", "bans", "loss", "bpb", "device", "tokens/s", "batch", "digest")
    for column in (*columns, "address"):
        table.add_column(column, overflow="fold")
    for r in records:
        bans = "\n".join(f"{peer} until round {ban.until}: {ban.reason}" for peer, ban in r.bans.items())
        row: list[Any] = [
            r.peer_id[-12:], r.round, r.state or r.phase, r.reason or "-", bans or "-", _figure(r.loss),
            _figure(r.bpb), r.device or "-", f"{r.tokens_per_s:,.0f}", r.batch_size, r.digest[:8],
            r.addrs[0] if r.addrs else "",
        ]  # fmt: skip
        table.add_row(*(Text(str(cell)) for cell in row))  # Text: a peer's words are never read as markup
    return table


def _figure(value: float | None) -> str:
    """A loss or bpb of the round a record last finished, or "-" where it says none."""
    return "-" if value is None else f"{value:.3f}"
