"""The terminal view of `swarmtrain node`: a live panel on a terminal, one plain line per round otherwise."""

from __future__ import annotations

import io
import logging
import sys

import pytest
from rich.console import Console

from swarmtrain.node.panel import Panel, render, round_line
from swarmtrain.node.state import NodeState, NodeStatus

ME, PEER = "QmNodeAaaa11111111", "QmNodeBbbb22222222"


def a_round(number: int, **extra: object) -> dict:
    return {
        "round": number, "outcome": "applied", "group_size": 2, "group": [ME, PEER], "weights": [64.0, 64.0],
        "loss": 3.21456, "tokens_per_s": 1234.4, "bytes_sent": 12_345, "bytes_received": 23_456, "utilisation": 0.8,
        "state": "averaging", **extra,
    }  # fmt: skip


def status_after_two_rounds() -> NodeStatus:
    status = NodeStatus(ME)
    status.peers_source = lambda: {ME: {}, PEER: {}}
    status.add_round(a_round(0))
    status.add_round(a_round(1, bpb=3.9012, outcome="fallback"))
    status.set(NodeState.AVERAGING, "round 1: fallback in a group of 2")
    status.set_bans({"Bbbb2222": {"until": 11, "reason": "sent a NaN payload"}})
    return status


def test_a_round_line_says_outcome_group_loss_bpb_speed_bytes_and_state() -> None:
    line = round_line(a_round(12, bpb=3.9012))
    assert line == (
        "round 12: applied in a group of 2, loss 3.215, bpb 3.901, 1,234 tokens/s, sent 12.3 kB, averaging"
    )
    observed = round_line({**a_round(3), "loss": None, "bytes_sent": 950, "state": "observing"})
    assert observed == "round 3: applied in a group of 2, 1,234 tokens/s, sent 950 B, observing"


def test_the_panel_shows_round_state_group_outcomes_quality_bytes_and_bans() -> None:
    snapshot = status_after_two_rounds().snapshot()
    console = Console(file=io.StringIO(), width=140, record=True)
    console.print(render(snapshot, now=snapshot["since"] + 4))
    text = console.export_text()
    assert f"swarmtrain node {ME[-8:]}  round 2" in text
    assert "averaging  round 1: fallback in a group of 2  (4 s)" in text
    assert f"{ME[-8:]}, {PEER[-8:]}  (2)" in text
    assert "0 applied, 1 fallback" in text
    assert "loss 3.215   held-out bpb 3.901 (round 1)" in text
    assert "1,234 tokens/s, 80% of the last round's time in inner steps" in text
    assert "sent 12.3 kB last round, 24.7 kB in all; received 46.9 kB in all" in text
    assert "2 peers in view; bans: Bbbb2222 until round 11" in text


def test_on_a_terminal_the_panel_is_live_and_log_lines_print_above_it() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=140)
    status = status_after_two_rounds()
    handler = logging.StreamHandler(sys.__stderr__)  # as the CLI's basicConfig makes it
    logger = logging.getLogger("test_panel")
    logger.addHandler(handler)
    try:
        with Panel(status, console) as panel:
            assert panel.live
            logger.warning("a log line while the panel is up")
            status.add_round(a_round(2, outcome="applied"))
            assert panel._live is not None
            panel._live.refresh()
    finally:
        logger.removeHandler(handler)
    assert handler.stream is sys.__stderr__  # given back
    text = out.getvalue()
    assert "a log line while the panel is up" in text
    assert f"swarmtrain node {ME[-8:]}  round 3" in text and "2 applied" in text


def test_off_a_terminal_each_round_prints_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    status = NodeStatus(ME)
    with Panel(status, Console(file=io.StringIO())) as panel:
        assert not panel.live
        status.add_round(a_round(0))
        status.add_round(a_round(1, outcome="diverged", state="left_out"))
    status.add_round(a_round(2))  # after the node's run: nothing printed
    assert capsys.readouterr().out.splitlines() == [
        "round 0: applied in a group of 2, loss 3.215, 1,234 tokens/s, sent 12.3 kB, averaging",
        "round 1: diverged in a group of 2, loss 3.215, 1,234 tokens/s, sent 12.3 kB, left_out",
    ]
