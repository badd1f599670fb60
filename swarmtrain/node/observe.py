"""A node's HTTP endpoint (``observe.http_port``): ``/metrics`` for Prometheus, ``/status`` as JSON, ``/`` the
dashboard (``dashboard.html``, self-contained).

    swarmtrain node --set observe.http_port=9100
    curl -s localhost:9100/status | python -m json.tool
    curl -s localhost:9100/metrics

Off unless ``observe.http_port`` is set, and on 127.0.0.1 unless ``observe.http_host`` says otherwise: the status
names peers and their addresses. The server is the standard library's WSGI server in a daemon thread (the
Prometheus client's own exposition app serves ``/metrics``), so a slow scraper never blocks the event loop or the
training; it reads the node's ``NodeStatus`` under its lock and the metrics registry, which is thread-safe.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, make_wsgi_app

from swarmtrain.dht import PeerRecord
from swarmtrain.node.state import NodeState

log = logging.getLogger(__name__)

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


def peer_row(record: PeerRecord) -> dict[str, Any]:
    """A peer as ``/status`` lists it (a node's and the swarm dashboard's): what its record claims."""
    return {
        "round": record.round, "state": record.state, "reason": record.reason, "phase": record.phase,
        "tokens_per_s": record.tokens_per_s, "device": record.device, "addrs": record.addrs[:1], "loss": record.loss,
        "bpb": record.bpb, "tokens": record.tokens,
        "bans": {peer: ban.model_dump() for peer, ban in record.bans.items()},
    }  # fmt: skip


class NodeMetrics:
    """The node's Prometheus metrics, in a registry of their own (two nodes in one process do not collide)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.state = Enum(
            "swarmtrain_state", "Why the node is or is not contributing.", states=[str(s) for s in NodeState],
            registry=r,
        )  # fmt: skip
        self.round = Gauge("swarmtrain_round", "The next outer round this node takes part in.", registry=r)
        self.loss = Gauge("swarmtrain_loss", "Mean training loss of the last round's inner steps.", registry=r)
        self.bpb = Gauge("swarmtrain_bpb", "The last held-out bits per byte (node.eval_every).", registry=r)
        self.tokens_per_s = Gauge("swarmtrain_tokens_per_second", "Inner-step tokens/s of the last round.", registry=r)
        self.group_size = Gauge("swarmtrain_group_size", "Members of the last round's group.", registry=r)
        self.duration = Gauge("swarmtrain_round_duration_seconds", "Wall time of the last outer step.", registry=r)
        self.utilisation = Gauge(
            "swarmtrain_utilisation",
            "Share of the last round's time in inner steps (inner over inner plus idle seconds).",
            registry=r,
        )
        self.peers = Gauge("swarmtrain_peers", "Peers in this node's view of the swarm (itself included).", registry=r)
        self.tokens = Counter("swarmtrain_tokens", "Tokens this node trained on and contributed.", registry=r)
        self.sent = Counter("swarmtrain_bytes_sent", "Bytes this node sent in its outer steps.", registry=r)
        self.received = Counter("swarmtrain_bytes_received", "Bytes it received in its outer steps.", registry=r)
        self.rounds = Counter(
            "swarmtrain_rounds", "Outer rounds by outcome (applied, fallback, diverged...).", ["outcome"], registry=r
        )
        self.state.state(str(NodeState.STARTING))

    def on_state(self, state: NodeState, reason: str) -> None:
        self.state.state(str(state))

    def on_round(self, line: dict[str, Any], peers: int) -> None:
        """Account one ``metrics.jsonl`` round line."""
        self.round.set(line["round"] + 1)
        if line.get("loss") is not None:
            self.loss.set(line["loss"])
        if line.get("bpb") is not None:
            self.bpb.set(line["bpb"])
        self.tokens_per_s.set(line["tokens_per_s"])
        self.group_size.set(line["group_size"])
        self.duration.set(line["duration_s"])
        self.utilisation.set(line["utilisation"])
        self.peers.set(peers)
        self.tokens.inc(line["tokens"])
        self.sent.inc(line["bytes_sent"])
        self.received.inc(line["bytes_received"])
        self.rounds.labels(outcome=line["outcome"]).inc()


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scraper that hangs never keeps the node from exiting


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the standard library's name)
        log.debug("http %s", format % args)


class ObserveServer:
    """``/metrics`` (the registry's, after ``on_scrape()``) and ``/status`` (``snapshot()`` as JSON), and
    ``pages`` (extra paths to (content type, bytes)) on host:port."""

    def __init__(
        self, snapshot: Callable[[], dict[str, Any]], registry: CollectorRegistry, host: str, port: int,
        pages: dict[str, tuple[str, bytes]] | None = None, on_scrape: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.snapshot = snapshot
        self.metrics_app = make_wsgi_app(registry)
        self.on_scrape = on_scrape
        self.pages = dict(pages or {})
        self.server = make_server(host, port, self._app, server_class=_Server, handler_class=_QuietHandler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="observe-http", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    def _app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            if self.on_scrape is not None:
                self.on_scrape()
            return self.metrics_app(environ, start_response)  # type: ignore[no-any-return]
        if path == "/status":
            return _reply(start_response, "application/json", json.dumps(self.snapshot()).encode())
        if path in self.pages:
            return _reply(start_response, *self.pages[path])
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [f"no such page: {path}; try /status or /metrics\n".encode()]


def _reply(start_response: StartResponse, content_type: str, body: bytes) -> list[bytes]:
    start_response("200 OK", [("Content-Type", content_type), ("Content-Length", str(len(body)))])
    return [body]


def dashboard() -> dict[str, tuple[str, bytes]]:
    """The dashboard page (``/``): one self-contained HTML file that polls ``/status``."""
    page = (Path(__file__).with_name("dashboard.html")).read_bytes()
    return {"/": ("text/html; charset=utf-8", page)}
