"""Every state a node can be in, with the reason it gives, reads the same in every view a person has: the node's
/status and /metrics, its DHT record as `swarmtrain status` prints it, and the dashboard of the swarm
(`swarmtrain dashboard --join`); with a browser (slow), on both dashboard pages. The node's own wiring carries the
state: its ``NodeStatus`` listeners feed the metrics and the record (as ``Node.run`` installs them). Which
situation puts a node in which state is tested where it happens: late, left out and unreachable in
test_observe, the decision to catch up in test_node_catch_up, observing in test_swarm, banned in
test_bans_status, a config mismatch in test_doctor, leaving in test_swarmview."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import pytest
from rich.console import Console

from swarmtrain.dht import read_record
from swarmtrain.node.commands import status_table
from swarmtrain.node.observe import NodeMetrics, ObserveServer, dashboard
from swarmtrain.node.state import NodeState, NodeStatus
from swarmtrain.node.swarmview import SwarmMetrics, SwarmView
from tests.test_dashboard import Page, browse, chromium
from tests.test_observe import get_status, scrape
from tests.test_private_swarm import FakeDHT, Identity, member

# Each state with a reason as the node words it.
REASONS = {
    NodeState.TRAINING: "inner steps of round 12",
    NodeState.AVERAGING: "round 11: applied in a group of 3",
    NodeState.CATCHING_UP: "from 12D3KooWdonor: round 9 to 12, 3 rounds behind",
    NodeState.OBSERVING: "sitting in on round 12 with weight 0",
    NodeState.LATE: "round 11: late for the gather: aaaaaaaa rejected join: round 11 is over",
    NodeState.LEFT_OUT: "round 11: no group took this node in; catching up before the next",
    NodeState.BANNED: "round 11: bbbbbbbb refused the join: banned until round 15: a payload out of bounds",
    NodeState.UNREACHABLE: "round 11: could not reach cccccccc to average: stream reset",
    NodeState.CONFIG_MISMATCH: "model.width is 64 here, the swarm uses 128 (peer dddddddd)",
    NodeState.LEAVING: "left after round 11",
}


@pytest.fixture(scope="module")
def identities(tmp_path_factory: pytest.TempPathFactory) -> dict[NodeState, Identity]:
    root = tmp_path_factory.mktemp("ids")
    return {state: Identity(root / f"{state}.key") for state in REASONS}


async def wired_nodes(identities: dict[NodeState, Identity]) -> tuple[dict[NodeState, NodeStatus], FakeDHT]:
    """One node per state, wired as ``Node.run`` wires it (status -> metrics, status -> DHT record), each set to
    its state; their records published to one DHT."""
    dht = FakeDHT()
    statuses = {}
    for state, who in identities.items():
        status, membership = NodeStatus(who.peer_id), member(dht, who)
        status.listeners.append(lambda s, why, m=membership: m.update(state=str(s), reason=why[:240]))
        status.set(state, REASONS[state])
        await membership.publish()
        statuses[state] = status
    return statuses, dht


def swarm_view(dht: FakeDHT) -> SwarmView:
    view = SwarmView("test", ttl=30.0)
    view.update(r for r in (read_record(k, v) for k, v in dht.values.items()) if r is not None)
    return view


async def test_each_state_and_its_reason_read_the_same_in_status_metrics_the_status_table_and_the_swarm_view(
    identities: dict[NodeState, Identity],
) -> None:
    statuses, dht = await wired_nodes(identities)
    for state, status in statuses.items():
        metrics = NodeMetrics()
        status.listeners.append(metrics.on_state)
        status.set(NodeState.STARTING, "again")  # the metrics follow each change from here
        status.set(state, REASONS[state])
        server = ObserveServer(status.snapshot, metrics.registry, "127.0.0.1", 0)
        server.start()
        try:
            body = await asyncio.to_thread(get_status, server.url)
            samples = await asyncio.to_thread(scrape, server.url)
        finally:
            server.close()
        assert (body["state"], body["reason"]) == (str(state), REASONS[state]), body
        assert body["contributing"] is (state in (NodeState.TRAINING, NodeState.AVERAGING))
        assert samples[f"swarmtrain_state{{swarmtrain_state={state}}}"] == 1.0
        assert sum(v for k, v in samples.items() if k.startswith("swarmtrain_state{")) == 1.0
    records = [r for r in (read_record(k, v) for k, v in dht.values.items()) if r is not None]
    assert {r.peer_id: (r.state, r.reason) for r in records} == {
        identities[s].peer_id: (str(s), REASONS[s]) for s in REASONS
    }
    text = io.StringIO()
    Console(file=text, width=400).print(status_table("test", records))
    rows = {
        line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[1:-1]]
        for line in text.getvalue().splitlines()
        if line.startswith("│")
    }
    for state, who in identities.items():
        _, _, shown_state, shown_reason = rows[who.peer_id[-12:]][:4]
        assert (shown_state, shown_reason) == (str(state), REASONS[state]), rows[who.peer_id[-12:]]
    peers = swarm_view(dht).snapshot()["peers"]
    assert {p: (v["state"], v["reason"]) for p, v in peers.items()} == {
        identities[s].peer_id: (str(s), REASONS[s]) for s in REASONS
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_each_state_and_its_reason_show_on_the_node_and_the_swarm_dashboards(
    identities: dict[NodeState, Identity], tmp_path: Path
) -> None:
    browser = chromium()
    statuses, dht = await wired_nodes(identities)
    view = swarm_view(dht)
    page = await read_page(
        browser, ObserveServer(view.snapshot, SwarmMetrics(view).registry, "127.0.0.1", 0, pages=dashboard())
    )
    shown = {p: (row["data-state"], row["data-reason"]) for p, row in page.rows.items()}
    assert shown == {identities[s].peer_id: (str(s), REASONS[s]) for s in REASONS}
    for state, status in statuses.items():
        page = await read_page(
            browser, ObserveServer(status.snapshot, NodeMetrics().registry, "127.0.0.1", 0, pages=dashboard())
        )
        assert (page.texts["state"], page.texts["reason"]) == (str(state), f"({REASONS[state]})"), page.texts


async def read_page(browser: str, server: ObserveServer) -> Page:
    """The dashboard ``server`` serves, as Chromium renders it."""
    server.start()
    try:
        page = Page()
        page.feed(await asyncio.to_thread(browse, browser, server.url + "/"))
        return page
    finally:
        server.close()
