"""What `swarmtrain node` shows on its stdout: a live panel on a terminal, one plain line per round otherwise.

On a terminal the panel (peer, round, state and why, group, last outcomes, loss, bpb, speed, bytes, peers, bans)
is redrawn twice a second from the node's ``NodeStatus``; log lines and the node's other prints scroll above it.
When stdout is a file or a pipe (a service, ``nohup``, a scenario run), each round prints one line instead:

    round 12: applied in a group of 3, loss 3.214, bpb 3.901, 1,234 tokens/s, sent 12.3 kB, averaging
"""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType
from typing import Any

from rich.console import Console, RenderableType
from rich.live import Live
from rich.panel import Panel as Box
from rich.table import Table
from rich.text import Text

from swarmtrain.node.state import CONTRIBUTING, NodeState, NodeStatus

_STYLES = {str(NodeState.BANNED): "bold red", str(NodeState.CONFIG_MISMATCH): "bold red"}
_STYLES.update({str(s): "green" for s in CONTRIBUTING})


def size(n: float) -> str:
    """Bytes for people: 950 B, 12.3 kB, 4.1 MB, 2.0 GB."""
    for unit in ("B", "kB", "MB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def round_line(record: dict[str, Any]) -> str:
    """One round of ``metrics.jsonl`` as a line for people."""
    parts = [f"{record['outcome']} in a group of {record['group_size']}"]
    if record.get("loss") is not None:
        parts.append(f"loss {record['loss']:.3f}")
    if record.get("bpb") is not None:
        parts.append(f"bpb {record['bpb']:.3f}")
    parts += [f"{record.get('tokens_per_s', 0):,.0f} tokens/s", f"sent {size(record.get('bytes_sent', 0))}"]
    parts.append(record.get("state", ""))
    return f"round {record['round']}: " + ", ".join(p for p in parts if p)


def render(snapshot: dict[str, Any], now: float | None = None) -> RenderableType:
    """The panel for one ``NodeStatus.snapshot()``."""
    now = time.time() if now is None else now
    history = snapshot["history"]
    last = history[-1] if history else {}
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    state = snapshot["state"]
    line = Text(state, style=_STYLES.get(state, "yellow"))
    line.append(f"  {snapshot['reason']}  ({now - snapshot['since']:.0f} s)", style="default")
    grid.add_row("state", line)
    group = snapshot["group"]
    grid.add_row("group", ", ".join(p[-8:] for p in group) + f"  ({len(group)})" if group else "-")
    outcomes = [f"{o['round']} {o['outcome']}" for o in snapshot["last_outcomes"][-5:]]
    grid.add_row("last rounds", ", ".join(outcomes) or "-")
    losses = [h["loss"] for h in history if h.get("loss") is not None]
    bpbs = [(h["round"], h["bpb"]) for h in history if h.get("bpb") is not None]
    quality = f"loss {losses[-1]:.3f}" if losses else "loss -"
    quality += f"   held-out bpb {bpbs[-1][1]:.3f} (round {bpbs[-1][0]})" if bpbs else ""
    grid.add_row("quality", quality)
    speed = f"{snapshot['tokens_per_s']:,.0f} tokens/s"
    if last.get("utilisation") is not None:
        speed += f", {last['utilisation']:.0%} of the last round's time in inner steps"
    grid.add_row("speed", speed)
    grid.add_row(
        "bytes",
        f"sent {size(last.get('bytes_sent') or 0)} last round, {size(snapshot['bytes_sent'])} in all; "
        f"received {size(snapshot['bytes_received'])} in all",
    )
    bans = snapshot["bans"]
    banned = ", ".join(f"{p} until round {b['until']}" for p, b in bans.items()) if bans else "none"
    peers = len(snapshot["peers"])
    grid.add_row("swarm", f"{peers} peer{'s' if peers != 1 else ''} in view; bans: {banned}")
    title = f"swarmtrain node {snapshot['peer_id'][-8:]}  round {snapshot['round']}"
    return Box(grid, title=title, title_align="left", expand=False)


class Panel:
    """``with Panel(status):`` around a node's run: the live panel when ``console`` is a terminal (and the log
    lines are plain), else one ``round_line`` per round on stdout."""

    def __init__(self, status: NodeStatus, console: Console | None = None, live: bool | None = None) -> None:
        self.status = status
        self.console = console or Console()
        self.live = self.console.is_terminal if live is None else live
        self._live: Live | None = None
        self._last: RenderableType = Text("starting")
        self._streams: list[tuple[logging.StreamHandler[Any], Any]] = []

    def _renderable(self) -> RenderableType:
        try:
            self._last = render(self.status.snapshot())
        except RuntimeError:  # the peer table changed under the refresh thread: draw the last panel again
            pass
        return self._last

    def _print_round(self, record: dict[str, Any]) -> None:
        print(round_line(record), flush=True)

    def __enter__(self) -> Panel:
        if not self.live:
            self.status.round_listeners.append(self._print_round)
            return self
        self._live = Live(
            console=self.console, get_renderable=self._renderable, refresh_per_second=2,
            redirect_stdout=True, redirect_stderr=True,
        )  # fmt: skip
        self._live.start()
        # Log handlers hold the stderr they were made with; point them at the redirected one, so log lines print
        # above the panel instead of through it.
        loggers = [
            logging.root,
            *(x for x in logging.root.manager.loggerDict.values() if isinstance(x, logging.Logger)),
        ]
        for handler in {h for logger in loggers for h in logger.handlers}:
            if type(handler) is logging.StreamHandler and handler.stream in (sys.__stderr__, sys.__stdout__):
                self._streams.append((handler, handler.setStream(sys.stderr)))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._live is None:
            self.status.round_listeners.remove(self._print_round)
            return
        for handler, stream in self._streams:
            handler.setStream(stream)
        self._live.stop()
