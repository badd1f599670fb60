"""The dashboard in a real browser: headless Chromium loads the page of a live 3-node swarm (three nodes in this
process, each with its own p2pd; run under the heavy-test lock), and the peers, their states and the loss curve it
shows are checked against the node's /status and metrics.jsonl. Saves a screenshot; the README's is made by

    DASHBOARD_SCREENSHOT=docs/dashboard.png SWARM_DASHBOARD_SCREENSHOT=docs/swarm-dashboard.png \
        python -m pytest -m slow tests/test_dashboard.py

It also serves `swarmtrain dashboard --join` of the same swarm and checks its page against the peers' records.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from swarmtrain.config import load_config
from swarmtrain.node import Node
from swarmtrain.node.observe import ObserveServer, dashboard
from swarmtrain.node.swarmview import SwarmMetrics, SwarmView, watch
from tests.swarm import TINY
from tests.test_observe import _rounds, _wait, get_status


def chromium() -> str:
    """Debian's chromium, installed with apt-get when missing (skips, saying why, where that is impossible). A fresh
    machine may have no package lists yet: then the lists are updated and the install tried once more."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "chromium"]
    for before in ([], [["apt-get", "update", "-q"]]):
        if shutil.which("chromium"):
            break
        for command in [*before, install]:
            done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    found = shutil.which("chromium")
    if found is None:
        pytest.skip(f"chromium is missing and `apt-get install chromium` failed: {done.stderr[-500:]}")
    return found


class Page(HTMLParser):
    """What the dashboard shows, read from the DOM Chromium dumps after the page's script ran."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, dict[str, str]] = {}
        self.curves: dict[str, list[tuple[int, float]]] = {}
        self.loaded_round: int | None = None
        self.texts: dict[str, str] = {}  # id -> text of the elements whose text the test reads
        self._open: str | None = None

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self.texts[self._open] = self.texts.get(self._open, "") + data

    def handle_endtag(self, tag: str) -> None:
        self._open = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "tr" and "data-peer" in a:
            self.rows[a["data-peer"]] = a
        if tag == "polyline" and a.get("data-rounds"):
            rounds, values = a["data-rounds"].split(","), a["data-values"].split(",")
            self.curves[a["id"]] = [(int(r), float(v)) for r, v in zip(rounds, values, strict=True)]
        if a.get("id") in ("utilisation", "utilisation-all", "state", "reason"):
            self._open = a["id"]
        if tag == "body" and "data-loaded-round" in a:
            self.loaded_round = int(a["data-loaded-round"])


def browse(browser: str, url: str, screenshot: Path | None = None) -> str:
    args = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1200,900"]
    args += ["--virtual-time-budget=3000"]
    args += [f"--screenshot={screenshot}"] if screenshot is not None else ["--dump-dom"]
    done = subprocess.run([*args, url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


async def check_swarm_dashboard(browser: str, address: str, peer_ids: set[str], tmp_path: Path) -> None:
    """`swarmtrain dashboard --join` of the same swarm: the page shows every peer's state and round as the
    peers' records say, and the mean loss of the rounds the dashboard saw."""
    view = SwarmView(load_config().node.run_id, ttl=30.0)
    metrics = SwarmMetrics(view)
    server = ObserveServer(
        view.snapshot, metrics.registry, "127.0.0.1", 0, pages=dashboard(), on_scrape=metrics.refresh
    )
    server.start()
    watcher = asyncio.create_task(watch(load_config(overrides=[f"node.join=['{address}']"]), view, 0.5))
    try:
        seen = lambda: {p for points in view.points.values() for p in points}  # noqa: E731
        await _wait("a finished round of each peer on the swarm dashboard", lambda: seen() == peer_ids, 120, seen)
        for _ in range(8):
            before = view.snapshot()
            page = Page()
            page.feed(await asyncio.to_thread(browse, browser, server.url + "/"))
            after = view.snapshot()
            if states(before) == states(after) and page.loaded_round == after["round"]:
                break
        else:
            raise AssertionError(f"the swarm never held still for a page read: {states(before)} / {states(after)}")
        assert set(page.rows) == peer_ids, page.rows
        for peer, row in page.rows.items():
            assert (row["data-state"], int(row["data-round"])) == states(after)[peer], (row, after["peers"])
        means = [(h["round"], pytest.approx(h["loss"])) for h in after["history"] if h["loss"] is not None]
        assert page.curves["loss-curve"] == means and means, (page.curves, after["history"])
        screenshot = Path(os.environ.get("SWARM_DASHBOARD_SCREENSHOT", tmp_path / "swarm.png")).absolute()
        await asyncio.to_thread(browse, browser, server.url + "/", screenshot)
        assert screenshot.stat().st_size > 10_000
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        server.close()


def states(status: dict[str, Any]) -> dict[str, tuple[str, int]]:
    return {peer: (p["state"], p["round"]) for peer, p in status["peers"].items()}


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_the_dashboard_of_a_live_swarm_shows_its_peers_states_and_loss(tmp_path: Path, text_file: Path) -> None:
    browser = chromium()
    # Slow inner steps (2 s each): the swarm's states hold still long enough for a page read; rounds until Ctrl+C.
    common = [
        *TINY, "node.test_step_delay_s=2", "node.min_peers=3", "node.rounds=0", "node.eval_every=1",
        f"data.path={text_file}", f"data.cache_dir={tmp_path / 'cache'}",
    ]  # fmt: skip
    nodes = [Node(load_config(overrides=[*common, "observe.http_port=0", f"run_dir={tmp_path / 'a'}"]))]
    tasks = [asyncio.create_task(nodes[0].run())]
    try:
        join = tmp_path / "a" / "join.txt"
        await _wait("the first node's join.txt", join.exists, 60, lambda: None)
        address = join.read_text().split()[0]
        for name in ("b", "c"):
            config = load_config(overrides=[*common, f"run_dir={tmp_path / name}", f"node.join=['{address}']"])
            nodes.append(Node(config))
            tasks.append(asyncio.create_task(nodes[-1].run()))
        url = (tmp_path / "a" / "http.txt").read_text().strip()
        await _wait("two rounds of node a", lambda: len(_rounds(tmp_path / "a")) >= 2, 180, lambda: None)
        for _ in range(8):  # a page read while the swarm changes is read again: compare a still picture
            before = await asyncio.to_thread(get_status, url)
            page = Page()
            page.feed(await asyncio.to_thread(browse, browser, url + "/"))
            after = await asyncio.to_thread(get_status, url)
            if states(before) == states(after) and page.loaded_round == before["round"] == after["round"]:
                break
        else:
            raise AssertionError(f"the swarm never held still for a page read: {states(before)} / {states(after)}")
        peer_ids = {node.status.peer_id for node in nodes}
        assert set(page.rows) == peer_ids, page.rows
        for peer, row in page.rows.items():
            assert (row["data-state"], int(row["data-round"])) == states(after)[peer], (row, after["peers"])
        lines = [line for line in _rounds(tmp_path / "a") if line["round"] < page.loaded_round]
        assert page.curves["loss-curve"] == [(line["round"], pytest.approx(line["loss"])) for line in lines]
        assert page.curves["bpb-curve"] == [(line["round"], pytest.approx(line["bpb"])) for line in lines]
        # Compute utilisation: the last round's, and inner steps over inner steps and idle time of all rounds.
        percent = {key: float(page.texts[key].removesuffix(" %")) for key in ("utilisation", "utilisation-all")}
        assert percent["utilisation"] == pytest.approx(100 * lines[-1]["utilisation"], abs=0.051), page.texts
        overall = sum(line["inner_s"] for line in lines) / sum(line["inner_s"] + line["idle_s"] for line in lines)
        assert percent["utilisation-all"] == pytest.approx(100 * overall, abs=0.051), page.texts
        shares = {peer: float(row["data-share"]) for peer, row in page.rows.items()}
        assert sum(shares.values()) == pytest.approx(1.0, abs=1e-4) and all(s > 0 for s in shares.values())
        screenshot = Path(os.environ.get("DASHBOARD_SCREENSHOT", tmp_path / "dashboard.png")).absolute()
        await asyncio.to_thread(browse, browser, url + "/", screenshot)
        assert screenshot.stat().st_size > 10_000
        await check_swarm_dashboard(browser, address, peer_ids, tmp_path)
        for node in nodes:  # Ctrl+C, as it were: each finishes its round and leaves
            node.request_leave()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
