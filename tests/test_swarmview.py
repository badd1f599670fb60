"""The dashboard of a whole swarm (`swarmtrain dashboard --join`), from records made here: what it says of each
peer, the swarm's loss, bpb and bytes per round, and the events it sees between looks; a node's claims are never
values its record's readers refuse; bad command lines are errors that say what to do. Then a live swarm of two
nodes: what the dashboard read of each round in their records is what their metrics.jsonl say."""

from __future__ import annotations

import asyncio
import io
import json
import socket
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from swarmtrain.averaging import PROTOCOL_VERSION
from swarmtrain.cli import cli
from swarmtrain.config import load_config
from swarmtrain.dht import BanEntry, PeerRecord
from swarmtrain.dht.membership import MAX_LOSS
from swarmtrain.node import Node
from swarmtrain.node.commands import status_table
from swarmtrain.node.node import _bounded
from swarmtrain.node.observe import ObserveServer, dashboard
from swarmtrain.node.swarmview import SwarmMetrics, SwarmView, watch
from tests.swarm import TINY
from tests.test_observe import _rounds, _wait

TTL = 30.0
A, B, C = "QmPeerAaaaaaaaaa", "QmPeerBbbbbbbbbb", "QmPeerCccccccccc"


def record(peer: str, round_: int, **changes: Any) -> PeerRecord:
    fields: dict[str, Any] = {
        "peer_id": peer, "proto": PROTOCOL_VERSION, "run_id": "test", "round": round_, "phase": "training",
        "tokens_per_s": 100.0, "batch_size": 4, "state": "training", "reason": f"inner steps of round {round_}",
    }  # fmt: skip
    return PeerRecord(**{**fields, **changes})


def test_each_round_shows_the_mean_loss_and_bpb_of_the_peers_that_finished_it_and_the_bytes_they_sent() -> None:
    view = SwarmView("test", ttl=TTL)
    view.update([record(A, 0), record(B, 0)], now=0.0)  # nothing finished yet: no point
    view.update([record(A, 1, loss=4.0, tokens=100, bytes_sent=1000), record(B, 0)], now=1.0)
    view.update(
        [record(A, 1, loss=4.0, bpb=6.0, tokens=100, bytes_sent=1000), record(B, 1, loss=5.0, bytes_sent=3000)],
        now=2.0,
    )  # fmt: skip
    view.update([record(A, 2, loss=3.0, tokens=300, bytes_sent=500), record(B, 1, loss=5.0, bytes_sent=3000)], 3.0)
    status = view.snapshot()
    assert [(h["round"], h["loss"], h["bpb"], h["bytes_sent"]) for h in status["history"]] == [
        (0, 4.5, 6.0, 4000),  # A's bpb came with a later look at the same round: the newest record counts
        (1, 3.0, None, 500),
    ]
    assert status["history"][0]["peers"] == {
        A: {"loss": 4.0, "bpb": 6.0, "bytes_sent": 1000},
        B: {"loss": 5.0, "bpb": None, "bytes_sent": 3000},
    }
    assert status["round"] == 2 and status["contributed"] == {A: 300.0, B: 0.0}
    assert (status["swarm"], status["state"]) == ("test", "watching")
    assert status["reason"] == "2 of 2 peers contributing (after 4 looks)"
    assert (status["peers"][A]["state"], status["peers"][A]["round"], status["peers"][A]["loss"]) == (
        "training",
        2,
        3.0,
    )


def test_joins_leaves_bans_and_states_that_stop_a_peer_contributing_are_events() -> None:
    view = SwarmView("test", ttl=TTL)
    view.update([record(A, 3), record(B, 3)], now=0.0)
    view.update([record(A, 3, state="averaging", reason="outer step of round 3"), record(B, 3)], now=1.0)
    ban = BanEntry(until=7, reason="a payload out of bounds")
    view.update(
        [
            record(A, 4, bans={C[-12:]: ban}),
            record(B, 4, state="catching_up", reason="from Aaaaaaaa, 2 rounds behind"),
            record(C, 4, state="starting", reason="waiting for 3 peers"),
        ],
        now=2.0,
    )
    view.update([record(A, 4, bans={C[-12:]: ban}), record(B, 4, phase="leaving", reason="left after round 3")], 3.0)
    view.update([record(A, 5, bans={C[-12:]: ban})], now=3.0 + TTL / 2)  # B and C: records missing, not yet gone
    assert set(view.snapshot()["peers"]) == {A, B, C}
    view.update([record(A, 5, bans={C[-12:]: ban})], now=3.0 + TTL + 1)
    status = view.snapshot()
    assert set(status["peers"]) == {A}
    assert [(e["state"], e["round"], e["reason"]) for e in status["events"]] == [
        ("join", 3, "aaaaaaaa at round 3, training: inner steps of round 3"),
        ("join", 3, "bbbbbbbb at round 3, training: inner steps of round 3"),
        # A averaging, then training again: contributing both times, not news
        ("ban", 4, f"aaaaaaaa bans {C[-12:]} until round 7: a payload out of bounds"),
        ("catching_up", 4, "bbbbbbbb: from Aaaaaaaa, 2 rounds behind"),
        ("join", 4, "cccccccc at round 4, starting: waiting for 3 peers"),
        ("leave", 4, "bbbbbbbb: left after round 3"),
        ("leave", 4, f"bbbbbbbb: no record for {TTL:.0f} s"),
        ("leave", 4, f"cccccccc: no record for {TTL:.0f} s"),
    ]


def test_a_look_that_finds_no_one_or_fails_says_so() -> None:
    view = SwarmView("test", ttl=TTL)
    assert view.snapshot()["reason"] == "no look at the swarm yet"
    view.update([], now=0.0)
    assert view.snapshot()["reason"] == "the lookup found no peer records (yet)"
    view.failed("the last lookup failed: TimeoutError()")
    assert view.snapshot()["reason"] == "the last lookup failed: TimeoutError()"
    view.update([record(A, 1, state="late", reason="came to the gather after its group formed")], now=1.0)
    assert view.snapshot()["reason"] == "0 of 1 peers contributing (after 2 looks)"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), -0.5, MAX_LOSS * 2])
def test_a_loss_no_reader_would_accept_is_left_out_of_the_nodes_record(value: float) -> None:
    """A record copied with a value its readers refuse would drop the node from every view."""
    claims = {"loss": _bounded(value, MAX_LOSS), "bpb": _bounded(value, MAX_LOSS)}
    assert claims == {"loss": None, "bpb": None}
    PeerRecord.model_validate(record(A, 1).model_copy(update=claims).model_dump())
    assert (_bounded(3.25, MAX_LOSS), _bounded(0.0, MAX_LOSS), _bounded(MAX_LOSS, MAX_LOSS)) == (3.25, 0.0, MAX_LOSS)


def test_the_page_status_and_metrics_of_a_swarm_are_served() -> None:
    view = SwarmView("test", ttl=TTL)
    view.update([record(A, 2, loss=3.0), record(B, 2, state="late", reason="late"), record(C, 2)], now=0.0)
    metrics = SwarmMetrics(view)
    server = ObserveServer(
        view.snapshot, metrics.registry, "127.0.0.1", 0, pages=dashboard(), on_scrape=metrics.refresh
    )
    server.start()
    try:
        with urlopen(server.url + "/status", timeout=10) as reply:
            status = json.load(reply)
        with urlopen(server.url + "/metrics", timeout=10) as reply:
            families = {f.name: f for f in text_string_to_metric_families(reply.read().decode())}
        with urlopen(server.url + "/", timeout=10) as reply:
            page = reply.read().decode()
    finally:
        server.close()
    assert set(status["peers"]) == {A, B, C} and status["history"][0]["loss"] == 3.0
    by_state = {s.labels["state"]: s.value for s in families["swarmtrain_swarm_peers"].samples}
    assert (by_state["training"], by_state["late"], by_state["banned"]) == (2, 1, 0)
    assert families["swarmtrain_swarm_round"].samples[0].value == 2
    assert "swarmtrain swarm" in page


def test_the_command_without_join_a_bad_poll_or_a_taken_port_says_what_to_do() -> None:
    runner = CliRunner()
    done = runner.invoke(cli, ["dashboard"])
    assert done.exit_code != 0 and "needs --join ADDR" in str(done.exception or done.output), done.output
    done = runner.invoke(
        cli,
        [
            "dashboard",
            "--join",
            "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWEyoppNCUx8Yx66oV9fJnriXwCcXwDDUA2kj6vnc6iDEp",
            "--poll",
            "0",
        ],
    )
    assert done.exit_code == 2 and "--poll must be a positive number of seconds" in done.output, done.output
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = runner.invoke(
            cli,
            [
                "dashboard",
                "--join",
                "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWEyoppNCUx8Yx66oV9fJnriXwCcXwDDUA2kj6vnc6iDEp",
                "--port",
                str(port),
            ],
        )
    message = str(done.exception or done.output)
    assert done.exit_code != 0 and f"cannot serve the dashboard on 127.0.0.1:{port}" in message, message
    assert "pick a free --port" in message


@pytest.mark.timeout(300)
async def test_what_the_dashboard_of_a_live_swarm_reads_of_each_round_is_what_the_nodes_did(
    tmp_path: Path, text_file: Path
) -> None:
    """Two nodes in this process (each with its own p2pd) train until asked to leave; a swarm dashboard joins
    through the first. Every finished round it read in a node's record has that node's loss for the round, its
    tokens trained so far and at most the bytes its round line counts (the record is made a moment earlier), and
    both leaves show as events."""
    common = [
        *TINY, "node.test_step_delay_s=0.2", "node.min_peers=2", "node.rounds=0", f"data.path={text_file}",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]  # fmt: skip
    first = Node(load_config(overrides=[*common, f"run_dir={tmp_path / 'a'}"]))
    tasks = [asyncio.create_task(first.run())]
    view = SwarmView(first.config.node.run_id, ttl=3.0)  # a peer whose record is gone 3 s has left
    try:
        join = tmp_path / "a" / "join.txt"
        await _wait("the first node's join.txt", join.exists, 60, lambda: None)
        address = join.read_text().split()[0]
        second = Node(load_config(overrides=[*common, f"run_dir={tmp_path / 'b'}", f"node.join=['{address}']"]))
        tasks.append(asyncio.create_task(second.run()))
        tasks.append(asyncio.create_task(watch(load_config(overrides=[f"node.join=['{address}']"]), view, 0.2)))
        await _wait("the second node's join.txt", (tmp_path / "b" / "join.txt").exists, 60, lambda: None)
        run_dirs = {first.status.peer_id: tmp_path / "a", second.status.peer_id: tmp_path / "b"}

        def finished() -> dict[str, int]:  # finished rounds the dashboard read of each node
            return {p[-8:]: sum(p in points for points in view.points.values()) for p in run_dirs}

        await _wait(
            "two finished rounds of each node on the dashboard", lambda: min(finished().values()) >= 2, 180, finished
        )
        for node in (first, second):
            node.request_leave()
        await asyncio.wait_for(asyncio.gather(*tasks[:2]), 120)

        def left() -> set[str]:
            return {e["reason"][:8] for e in view.events if e["state"] == "leave"}

        await _wait(
            "both leaves on the dashboard", lambda: left() == {p[-8:] for p in run_dirs}, 60, lambda: view.events
        )
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for round_, points in view.points.items():
        for peer, record in points.items():
            lines = [line for line in _rounds(run_dirs[peer]) if line["round"] <= round_]
            assert lines and lines[-1]["round"] == round_, (round_, record, lines)
            assert record.loss == lines[-1]["loss"], (record, lines[-1])
            assert record.tokens == sum(line["tokens"] for line in lines), (record, lines)
            assert record.bytes_sent <= lines[-1]["bytes_sent"], (record, lines[-1])


def test_swarmtrain_status_shows_the_loss_and_bpb_each_peer_gives_for_its_last_round() -> None:
    text = io.StringIO()
    records = [record(A, 4, loss=3.25, bpb=5.5), record(B, 4, loss=3.5), record(C, 0)]
    Console(file=text, width=400).print(status_table("test", records))
    lines = text.getvalue().splitlines()
    header = [cell.strip() for cell in next(line for line in lines if line.startswith("┃")).split("┃")[1:-1]]
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in lines if line.startswith("│")]
    shown = {row[0]: (row[header.index("loss")], row[header.index("bpb")]) for row in rows}
    assert shown == {A[-12:]: ("3.250", "5.500"), B[-12:]: ("3.500", "-"), C[-12:]: ("-", "-")}, text.getvalue()
