"""Log lines for people (plain, the default) or for machines: one JSON object per line.

    swarmtrain node --config run.toml --log-format json 2> node.log.jsonl

A JSON line holds ``time`` (Unix seconds, as in ``metrics.jsonl``), ``level``, ``logger`` and ``message`` (and
``exception``, the traceback, when there is one). hivemind's own loggers (also the p2p daemon's lines it relays)
write through the same handler, and so does the error a failing command ends with (exit 2), so every line on
stderr is JSON; the few lines a node prints for people on stdout (the join line, the final bpb) stay as they are.
"""

from __future__ import annotations

import json
import logging
from typing import Literal

LogFormat = Literal["plain", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("plain", "json")
_current: list[LogFormat] = ["plain"]  # what ``use_log_format`` set in this process


def current_log_format() -> LogFormat:
    return _current[0]


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


class _JsonHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler ``use_log_format("json")`` installs (a type of its own, so it is installed once)."""


def use_log_format(kind: LogFormat) -> None:
    """Switch the process's log lines to ``kind``; "plain" keeps what the CLI set up (``logging.basicConfig``
    in its group). "json" replaces the root logger's plain stderr handler with a JSON one and routes hivemind's
    loggers through it."""
    _current[0] = kind
    if kind == "plain":
        return
    from hivemind.utils.logging import use_hivemind_log_handler

    root = logging.getLogger()
    for handler in list(root.handlers):
        if type(handler) in (logging.StreamHandler, _JsonHandler):  # basicConfig's (or ours from an earlier call)
            root.removeHandler(handler)
    handler = _JsonHandler()  # stderr, as the plain lines
    handler.setFormatter(JsonFormatter())
    root.addHandler(handler)
    use_hivemind_log_handler("nowhere")  # hivemind's records propagate to the root logger's handler
