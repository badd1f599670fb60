"""Node states, /status and /metrics: the classification of a round's end, the HTTP endpoint, and two real nodes
(in this process, each with its own p2pd) whose scraped metrics match their metrics.jsonl."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from swarmtrain.averaging import PROTOCOL_VERSION
from swarmtrain.config import load_config
from swarmtrain.dht import PeerRecord
from swarmtrain.node import Node
from swarmtrain.node.observe import NodeMetrics, ObserveServer
from swarmtrain.node.state import Miss, NodeState, NodeStatus, round_state
from tests.swarm import TINY


def test_a_round_that_ends_alone_is_named_after_what_the_matchmaker_heard() -> None:
    a, b = "12D3KooWaaaaaaaaaaaaaaaa", "12D3KooWbbbbbbbbbbbbbbbb"
    late = Miss(a, "late", "aaaaaaaa rejected join: the group of round 4 is already formed")
    gone = Miss(b, "unreachable", "peer unreachable: stream reset")
    refused = Miss(b, "refused", "bbbbbbbb rejected join: the group of round 4 is full")
    assert round_state("applied", 3, False, []) == (NodeState.AVERAGING, "applied in a group of 3")
    assert round_state("applied", 3, True, [])[0] is NodeState.OBSERVING
    assert round_state("applied", 1, False, [])[0] is NodeState.TRAINING  # alone in the swarm: contributing
    state, reason = round_state("diverged", 1, False, [gone, late])
    assert state is NodeState.LATE and "aaaaaaaa" in reason and "already formed" in reason
    state, reason = round_state("diverged", 1, False, [gone])
    assert state is NodeState.UNREACHABLE and "bbbbbbbb" in reason and "stream reset" in reason
    state, reason = round_state("diverged", 1, False, [refused])
    assert state is NodeState.LEFT_OUT and "is full" in reason
    held = Miss(a, "held", "aaaaaaaa held my join 35 s without forming a group")  # it answered pings: not unreachable
    state, reason = round_state("diverged", 1, False, [held])
    assert state is NodeState.LEFT_OUT and "aaaaaaaa held my join 35 s" in reason
    assert round_state("diverged", 1, False, [])[0] is NodeState.LEFT_OUT


async def test_a_node_late_for_its_group_left_out_or_cut_off_is_told_which_in_process() -> None:
    """Real Averagers over the in-memory network: the state a round ends in follows what the matchmaker heard."""
    from tests.test_averaging_memory import NUMEL, make_swarm, run_round

    net, averagers = make_swarm(3)
    for a in averagers:
        await a.start()

    def ended(averager: Any, outcome: Any) -> tuple[NodeState, str]:
        misses = [Miss(*m) for m in averager.matchmaker.misses]
        return round_state(outcome.outcome, outcome.group.size, False, misses)

    # Round 0 with all three, so peer2 has averaged with the others (it may not apply an update alone from now on).
    assert {o.group.size for o in await run_round(averagers, [torch.randn(NUMEL) for _ in range(3)], [1.0] * 3)} == {3}
    pair = {"peer0", "peer1"}
    fast = [a.run_round(torch.randn(NUMEL), 1.0, ["peer0", "peer1"], pair, 2.0) for a in averagers[:2]]
    assert {o.group.size for o in await asyncio.gather(*fast)} == {2}
    # peer2 comes to round 1 after peer0's group formed and moved on: late, naming the leader and its answer.
    late = await averagers[2].run_round(torch.randn(NUMEL), 1.0, ["peer0", "peer2"], {"peer2"}, 0.3)
    state, reason = ended(averagers[2], late)
    assert state is NodeState.LATE and reason.startswith("late for the gather: peer0 rejected join: round 1 is over")
    # Round 2: it leads, nobody joins it: left out.
    alone = await averagers[2].run_round(torch.randn(NUMEL), 1.0, ["peer2"], {"peer2"}, 0.3)
    assert ended(averagers[2], alone)[0] is NodeState.LEFT_OUT
    # Round 3: the leader it should join is not on the network: unreachable, naming it.
    cut = await averagers[2].run_round(torch.randn(NUMEL), 1.0, ["ghost", "peer2"], {"peer2"}, 0.3)
    state, reason = ended(averagers[2], cut)
    assert state is NodeState.UNREACHABLE and reason.startswith("could not reach ghost to average"), reason


def _line(round_: int, loss: float, sent: int, outcome: str = "applied") -> dict[str, Any]:
    return {
        "round": round_, "loss": loss, "tokens": 100 * (round_ + 1), "tokens_per_s": 50.0 + round_, "group_size": 2,
        "group": ["a", "b"], "duration_s": 0.25, "bytes_sent": sent, "bytes_received": 2 * sent, "outcome": outcome,
        "bpb": 3.5 - round_, "inner_s": 0.75, "wall_s": 1.0 + round_, "utilisation": round(0.75 / (1.0 + round_), 4),
    }  # fmt: skip


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` parsed by the Prometheus client's own parser: sample name (with labels) -> value."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def get_status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/status", timeout=10) as reply:
        assert reply.headers["Content-Type"] == "application/json"
        return json.loads(reply.read())


def check_metrics_match(samples: dict[str, float], lines: list[dict[str, Any]]) -> None:
    last = lines[-1]
    assert samples["swarmtrain_round"] == last["round"] + 1
    assert samples["swarmtrain_loss"] == pytest.approx(last["loss"])
    assert samples["swarmtrain_tokens_per_second"] == pytest.approx(last["tokens_per_s"])
    assert samples["swarmtrain_group_size"] == last["group_size"]
    assert samples["swarmtrain_utilisation"] == pytest.approx(last["utilisation"])
    assert samples["swarmtrain_tokens_total"] == sum(line["tokens"] for line in lines)
    assert samples["swarmtrain_bytes_sent_total"] == sum(line["bytes_sent"] for line in lines)
    assert samples["swarmtrain_bytes_received_total"] == sum(line["bytes_received"] for line in lines)
    outcomes = {line["outcome"] for line in lines}
    for outcome in outcomes:
        assert samples[f"swarmtrain_rounds_total{{outcome={outcome}}}"] == sum(
            line["outcome"] == outcome for line in lines
        )
    bpbs = [line["bpb"] for line in lines if line.get("bpb") is not None]
    if bpbs:
        assert samples["swarmtrain_bpb"] == pytest.approx(bpbs[-1])


def test_the_endpoint_serves_what_the_node_recorded() -> None:
    status, metrics = NodeStatus("12D3KooWself"), NodeMetrics()
    status.listeners.append(metrics.on_state)
    server = ObserveServer(status.snapshot, metrics.registry, "127.0.0.1", 0)
    server.start()
    try:
        lines = [_line(0, 5.0, 1000), _line(1, 4.0, 1500, "fallback"), _line(2, 3.0, 1200)]
        for line in lines:
            status.add_round(line)
            metrics.on_round(line, peers=2)
        status.set(NodeState.CATCHING_UP, "from bbbbbbbb: round 3 -> 7, 4 rounds behind")
        samples = scrape(server.url)
        check_metrics_match(samples, lines)
        assert samples["swarmtrain_state{swarmtrain_state=catching_up}"] == 1
        assert samples["swarmtrain_state{swarmtrain_state=training}"] == 0
        body = get_status(server.url)
        assert (body["state"], body["reason"]) == ("catching_up", "from bbbbbbbb: round 3 -> 7, 4 rounds behind")
        assert body["round"] == 3 and body["contributing"] is False
        assert [o["outcome"] for o in body["last_outcomes"]] == ["applied", "fallback", "applied"]
        assert body["bytes_sent"] == 3700 and [h["loss"] for h in body["history"]] == [5.0, 4.0, 3.0]
        assert [h["utilisation"] for h in body["history"]] == [0.75, 0.375, 0.25]
        assert body["events"][-1]["state"] == "catching_up"
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(server.url + "/nope", timeout=10)
        assert missing.value.code == 404
    finally:
        server.close()


def test_a_port_in_use_is_an_error_that_names_the_key(tmp_path: Path, text_file: Path) -> None:
    status, metrics = NodeStatus(), NodeMetrics()
    taken = ObserveServer(status.snapshot, metrics.registry, "127.0.0.1", 0)
    try:
        port = int(taken.url.rsplit(":", 1)[1])
        config = load_config(overrides=[f"observe.http_port={port}", f"run_dir={tmp_path / 'run'}"])
        with pytest.raises(Exception, match=rf"observe.http_port={port}.*pick a free port"):
            Node(config)._start_http()
    finally:
        taken.server.server_close()


def _rounds(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "round"]


async def _wait(what: str, predicate: Any, timeout: float, seen: Any) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:.0f} s for {what}; saw {seen()}")
        await asyncio.sleep(0.1)


async def test_status_looks_the_records_up_again_while_it_finds_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """`swarmtrain status` (``fetch_records``): a lookup that finds no record is made again, up to ``LOOKUPS``
    times, before an empty swarm is shown; the first lookup that finds records is what it shows."""
    from swarmtrain.node import commands

    record = PeerRecord(
        peer_id="QmdYxK8nfPPGEHs4YwMebssHkmGKf1sAsYGnGALLde65dY", proto=PROTOCOL_VERSION, run_id="swarmtrain",
        round=0, phase="training", tokens_per_s=1.0, batch_size=1,
    )  # fmt: skip
    answers: list[list[PeerRecord]] = []
    lookups: list[str] = []

    @contextlib.asynccontextmanager
    async def client(config: Any) -> Any:
        yield "dht"

    async def lookup(dht: Any, run_id: str, auth: Any) -> list[PeerRecord]:
        lookups.append(run_id)
        return answers[len(lookups) - 1]

    monkeypatch.setattr(commands, "dht_client", client)
    monkeypatch.setattr(commands, "swarm_records", lookup)
    monkeypatch.setattr(commands, "LOOKUP_PAUSE_S", 0.0)
    config = load_config(overrides=[f"node.join=['/ip4/127.0.0.1/tcp/4000/p2p/{record.peer_id}']"])
    answers[:] = [[], [record], [record]]
    assert await commands.fetch_records(config) == [record] and len(lookups) == 2
    answers[:], lookups[:] = [[]] * commands.LOOKUPS, []
    assert await commands.fetch_records(config) == [] and len(lookups) == commands.LOOKUPS


@pytest.mark.timeout(240)
async def test_two_nodes_serve_status_and_metrics_that_match_their_metrics_file(
    tmp_path: Path, text_file: Path
) -> None:
    """Two nodes in this process (each with its own p2pd; run under the heavy-test lock): after a round, /metrics
    parsed by prometheus_client equals the sums and last values of metrics.jsonl, and /status and each node's DHT
    record (what `swarmtrain status` shows) name the state and its reason."""
    from swarmtrain.node.commands import fetch_records

    # Slow inner steps (0.4 s each) leave a quiet window after each round to scrape in.
    common = [
        *TINY, "node.test_step_delay_s=0.4", "node.min_peers=2", "observe.http_port=0", "node.rounds=3",
        "node.eval_every=1", f"data.path={text_file}", f"data.cache_dir={tmp_path / 'cache'}",
    ]  # fmt: skip
    first = Node(load_config(overrides=[*common, f"run_dir={tmp_path / 'a'}"]))
    task_a = asyncio.create_task(first.run())
    tasks = [task_a]
    try:
        join = tmp_path / "a" / "join.txt"
        await _wait("the first node's join.txt", join.exists, 60, lambda: list((tmp_path / "a").glob("*")))
        address = join.read_text().split()[0]
        second = Node(load_config(overrides=[*common, f"run_dir={tmp_path / 'b'}", f"node.join=['{address}']"]))
        tasks.append(asyncio.create_task(second.run()))
        url = (tmp_path / "a" / "http.txt").read_text().strip()
        for node_dir in ("a", "b"):
            await _wait(f"round 0 of node {node_dir}", lambda d=node_dir: _rounds(tmp_path / d), 120, lambda: None)
        for _ in range(5):  # the window can be missed on a busy machine: a round line written while scraping
            lines = _rounds(tmp_path / "a")
            samples = await asyncio.to_thread(scrape, url)
            body = await asyncio.to_thread(get_status, url)
            if _rounds(tmp_path / "a") == lines:
                break
        check_metrics_match(samples, lines)
        assert lines[-1]["group_size"] == 2 and samples["swarmtrain_bytes_sent_total"] > 0
        # Utilisation: each round's inner steps over them and the trainer's idle time before them, which holds the
        # round before (its outer step: the node does not overlap) and no more than the time between the lines.
        assert lines[0]["idle_s"] == 0.0  # the first inner phase: start-up is not counted
        for before, line in zip(lines, lines[1:], strict=False):
            assert line["wall_s"] == pytest.approx(line["elapsed_s"] - before["elapsed_s"], abs=2e-3), line
            assert before["duration_s"] <= line["idle_s"] <= line["wall_s"] + before["wall_s"], (before, line)
            assert 0 < line["utilisation"] < 1
            assert line["utilisation"] == pytest.approx(line["inner_s"] / (line["inner_s"] + line["idle_s"]), abs=1e-3)
        last, state = lines[-1]["round"], (lines[-1]["state"], lines[-1]["state_reason"])
        assert state == ("averaging", f"round {last}: applied in a group of 2")
        # Between two round lines the node trains the next round, or has just started its outer step.
        doing = {"training": f"inner steps of round {last + 1}", "averaging": f"outer step of round {last + 1}"}
        assert doing.get(body["state"]) == body["reason"], body
        assert body["round"] == last + 1 and set(body["peers"]) == set(lines[-1]["group"])
        assert [h["loss"] for h in body["history"]] == [line["loss"] for line in lines]
        assert [h["bpb"] for h in body["history"]] == [line["bpb"] for line in lines]
        # What `swarmtrain status` reads: each node's record carries its state and reason.
        config = load_config(overrides=[f"node.join=['{address}']"])
        records = await asyncio.wait_for(fetch_records(config), 60)
        assert {r.state for r in records} <= {"training", "averaging"} and all(r.reason for r in records), records
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    final = _rounds(tmp_path / "a")
    assert len(final) == 3 and first.status.state is NodeState.DONE
