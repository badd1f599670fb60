"""`swarmtrain node --log-format json`: one JSON object per log line (time, level, logger, message), hivemind's
lines included; plain lines stay the default. The node itself is replaced by a stand-in that logs (no daemon)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from hivemind.utils.logging import get_logger, use_hivemind_log_handler

from swarmtrain.cli import cli, main
from swarmtrain.logs import use_log_format
from swarmtrain.node.node import NodeError

WARNING = logging.getLevelName(logging.WARNING)  # hivemind names it "WARN" in every process that imports it


def _node_that_logs(config: object, resume: bool = False) -> None:
    logging.getLogger("swarmtrain.node.node").warning('round %d failed: "quoted"\nsecond line', 3)
    get_logger("hivemind.p2p.p2p_daemon").warning("p2pd: relayed line")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("swarmtrain.node.node").exception("round 4 broke")


@contextlib.contextmanager
def fresh_root_logger() -> Iterator[None]:
    """The root logger as a fresh process has it, without pytest's handlers (so the CLI's own set-up runs);
    restored afterwards, hivemind's handler too."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers.clear()
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        use_hivemind_log_handler("in_hivemind")
        use_log_format("plain")


def _invoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *flags: str) -> str:
    monkeypatch.setattr("swarmtrain.node.commands.run_node", _node_that_logs)
    with fresh_root_logger():
        result = CliRunner().invoke(cli, ["node", "--run-dir", str(tmp_path / "run"), *flags], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stderr


def test_json_log_format_writes_one_object_per_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started = time.time()
    lines = _invoke(tmp_path, monkeypatch, "--log-format", "json").splitlines()
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert [(r["level"], r["logger"]) for r in records] == [
        (WARNING, "swarmtrain.node.node"),
        (WARNING, "hivemind.p2p.p2p_daemon"),
        ("ERROR", "swarmtrain.node.node"),
    ], records
    assert records[0]["message"] == 'round 3 failed: "quoted"\nsecond line'
    assert records[1]["message"] == "p2pd: relayed line"
    assert records[2]["message"] == "round 4 broke" and "ValueError: boom" in records[2]["exception"]
    assert all(started - 1 <= r["time"] <= time.time() + 1 for r in records), records


def test_plain_lines_stay_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = _invoke(tmp_path, monkeypatch)
    assert stderr.startswith(f'{WARNING} swarmtrain.node.node: round 3 failed: "quoted"\nsecond line\n'), stderr
    for line in stderr.splitlines():
        with pytest.raises(json.JSONDecodeError):
            json.loads(line)


def test_the_error_a_node_stops_with_is_a_json_line_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refused(config: object, resume: bool = False) -> None:
        raise NodeError("node error: none of the peers in node.join answered")

    monkeypatch.setattr("swarmtrain.node.commands.run_node", refused)
    with fresh_root_logger(), pytest.raises(SystemExit) as stopped:
        main(["node", "--run-dir", str(tmp_path / "run"), "--log-format", "json"])
    assert stopped.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    record = json.loads(line)
    assert (record["level"], record["message"]) == ("ERROR", "node error: none of the peers in node.join answered")


def test_an_unknown_log_format_is_refused_with_the_choices(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["node", "--log-format", "xml"])
    assert result.exit_code == 2 and "'xml' is not one of 'plain', 'json'" in result.stderr, result.stderr
