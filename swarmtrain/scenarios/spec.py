"""A scenario file: the swarm, per-node overrides and a timeline of events, parsed from TOML into dataclasses.

    swarmtrain scenario check scenarios/churn.toml

```toml
[swarm]
nodes = 3              # node0..node2 start at time 0 (more may be named under [nodes.*] and join later)
rounds = 8             # every node stops after this many outer rounds (or: wall_time_s = 300)
inner_steps = 10       # H
codec = "fp16"
model = "tiny"         # a preset: tiny, bench or default; [config.model] sets the shape key by key
# data = "corpus.txt"  # unset: the Python standard library's source
# checkpoint = "runs/x/node0/checkpoints/step-00000100.safetensors"  # a swarm node's checkpoint to start from

[config]               # any node setting (`swarmtrain config --keys`), for every node
train.batch_size = 8

[nodes.node3]          # overrides for one node; start = false: it joins through an event
start = false
config.train.batch_size = 4

[[event]]
at_round = 2           # once the swarm completed 2 rounds (or: at_s = 12.5, seconds since the start)
action = "kill"        # join, leave (graceful), kill (SIGKILL), pause (SIGSTOP), resume (SIGCONT)
nodes = ["node1"]      # or "random": one live node, drawn from [swarm] seed

[[repeat]]             # kill a random node every round from round 1 to 6, back (a fresh process) a round later
action = "kill"
nodes = "random"
every_rounds = 1       # or every_s
from_round = 1
until_round = 6
back_after_rounds = 1  # or back_after_s; leave/kill come back with join, pause with resume
```

Every error names the file, the line and the key, and says how to fix it; ``ScenarioError`` exits with code 2.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from swarmtrain.config import Config, known_keys
from swarmtrain.data.corpus import stdlib_root
from swarmtrain.errors import SwarmtrainError

Action = Literal["join", "leave", "kill", "pause", "resume", "link", "partition", "heal"]
ACTIONS: tuple[str, ...] = ("join", "leave", "kill", "pause", "resume", "link", "partition", "heal")
SHAPERS = ("auto", "kernel", "transport")  # what limits link rates ([swarm] shaper)
NETWORK_ACTIONS = ("link", "partition", "heal")  # need link shaping (a namespace per node; see links.py)
RATE_KEYS, LOSS_KEYS = ("up_mbit", "down_mbit"), ("up_loss", "down_loss")
LINK_KEYS = (*RATE_KEYS, *LOSS_KEYS)  # shaped by the kernel (links.py): a link event changes them
DELAY_KEYS = ("up_ms", "down_ms")  # the node's own transport adds them (node.up_delay_ms), fixed at its start
BACK = {"kill": "join", "leave": "join", "pause": "resume", "partition": "heal"}  # what brings a node back

# Keys the runner sets for each node process; a spec that sets them would fight it.
RUNNER_KEYS = ("run_dir", "node.join", "node.rounds", "node.min_peers", "node.host", "train.max_time")

MODELS: dict[str, dict[str, Any]] = {
    "tiny": {"model.depth": 1, "model.width": 32, "model.heads": 2, "model.context": 32},
    "bench": {"model.depth": 2, "model.width": 64, "model.heads": 4, "model.context": 64},
    "default": {},
}


class ScenarioError(SwarmtrainError):
    """A scenario file is malformed or names something that does not exist."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeSpec:
    name: str
    """node0, node1, ... or a name from [nodes.*]."""
    start: bool = True
    """Started at time 0 (false: it joins through a join event)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Dotted node config keys for this node ([config] merged with its own overrides)."""
    up_mbit: float | None = None
    """Rate of what the node sends, Mbit/s (None: unlimited)."""
    down_mbit: float | None = None
    """Rate of what the node receives, Mbit/s (None: unlimited)."""
    up_loss: float = 0.0
    """Share of the packets the node sends that its link drops."""
    down_loss: float = 0.0
    """Share of the packets sent to the node that its link drops."""
    up_ms: float = 0.0
    """Delay of each message the node sends, ms: a message from A to B is late by A's up_ms plus B's down_ms."""
    down_ms: float = 0.0
    """Delay of each message the node receives, ms."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Event:
    action: Action
    nodes: tuple[str, ...]
    """Node names, or ("random",): one live node drawn when the event fires."""
    at_s: float | None = None
    """Seconds since the scenario started."""
    at_round: int | None = None
    """Fires once the swarm has completed this many rounds."""
    up_mbit: float | None = None
    """A link event's new uplink rate (None: unlimited)."""
    down_mbit: float | None = None
    """A link event's new downlink rate (None: unlimited)."""
    up_loss: float = 0.0
    """A link event's new share of uplink packets dropped."""
    down_loss: float = 0.0
    """A link event's new share of downlink packets dropped."""
    line: int = 0
    """Line of the event in the spec, for messages."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Repeat:
    action: Action
    nodes: tuple[str, ...]
    every_rounds: int | None = None
    every_s: float | None = None
    start: float = 0.0
    """First firing: a round (every_rounds) or seconds (every_s)."""
    until: float | None = None
    """No firing after this round or second (unset: until the end)."""
    back_after: float | None = None
    """Rounds or seconds after which the node comes back (join or resume); unset: it stays away."""
    line: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Scenario:
    path: Path
    text: str
    """The spec as written (copied into the report)."""
    rounds: int = 0
    wall_time_s: float | None = None
    seed: int = 0
    timeout_s: float = 900.0
    """The runner stops everything after this long, whatever the timeline says."""
    checkpoint: Path | None = None
    nodes: tuple[NodeSpec, ...] = ()
    events: tuple[Event, ...] = ()
    repeats: tuple[Repeat, ...] = ()
    shaper: str = "auto"
    """What limits link rates: kernel (tc in a namespace per node, needs root), transport (each node paces its
    own messages: rates only), auto (the kernel where it works, else the transport where that is enough)."""

    @property
    def shaped(self) -> bool:
        """Whether some link is shaped: a rate (the kernel or the nodes' own pacing), or what only the kernel does."""
        return any(n.up_mbit is not None or n.down_mbit is not None for n in self.nodes) or self.kernel_only

    @property
    def kernel_only(self) -> bool:
        """Whether only the kernel can shape this: a loss, or links that change or partition during the run."""
        lossy = any(n.up_loss or n.down_loss for n in self.nodes)
        return lossy or any(e.action in NETWORK_ACTIONS for e in [*self.events, *self.repeats])

    def node(self, name: str) -> NodeSpec:
        return next(n for n in self.nodes if n.name == name)


class _Lines:
    """Line numbers of tables and keys in the TOML text (tomllib keeps none): good enough to point at a key."""

    def __init__(self, text: str) -> None:
        self.lines = text.splitlines()

    def header(self, table: str, index: int | None = None) -> int:
        pattern = re.compile(
            rf"^\s*\[\[\s*{re.escape(table)}\s*\]\]" if index is not None else rf"^\s*\[\s*{re.escape(table)}\s*\]"
        )
        seen = 0
        for number, line in enumerate(self.lines, 1):
            if pattern.match(line):
                if index is None or seen == index:
                    return number
                seen += 1
        return 0

    def key(self, table: str, key: str, index: int | None = None) -> int:
        """The line of ``key`` (a dotted key is found by its written form or its last part) inside ``table``."""
        start = self.header(table, index)
        leaf = key.rsplit(".", 1)[-1]
        forms = [re.compile(rf"^\s*{re.escape(key)}\s*="), re.compile(rf"(^|[\s.{{,]){re.escape(leaf)}\s*=")]
        for pattern in forms:
            for number in range(start + 1, len(self.lines) + 1):
                line = self.lines[number - 1]
                stripped = line.lstrip()
                if number > start + 1 and stripped.startswith("[") and not stripped.startswith(f"[{table}"):
                    break
                if pattern.search(line):
                    return number
        return start


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


class _Parser:
    def __init__(self, path: Path, text: str) -> None:
        self.path, self.where = path, _Lines(text)

    def fail(self, line: int, key: str, problem: str) -> ScenarioError:
        return ScenarioError(f"scenario error: {self.path}:{line}: {key}: {problem}")

    def take(self, table: dict[str, Any], name: str, key: str, types: tuple[type, ...], line: int) -> Any:
        value = table.get(key)
        if value is None:
            return None
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            names = " or ".join(t.__name__ for t in types)
            raise self.fail(line, f"{name}.{key}", f"must be {names}, not {value!r}.")
        return value

    def unknown(self, table: dict[str, Any], allowed: tuple[str, ...], name: str, lines: Any) -> None:
        for key in table:
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = (
                    f" Did you mean {close[0]}?"
                    if close
                    else f" The keys of {name or 'a scenario'} are: {', '.join(allowed)}."
                )
                raise self.fail(lines(key), f"{name}.{key}" if name else key, f"is not a known key.{hint}")

    def settings(self, table: dict[str, Any], name: str, header: str, index: int | None = None) -> dict[str, Any]:
        """Node config keys in ``table`` (nested or dotted), checked against the node's own config model."""
        flat = _flatten(table)
        for key in flat:
            if key in RUNNER_KEYS:
                line = self.where.key(header, key, index)
                raise self.fail(line, f"{name}.{key}", "is set by the scenario runner for each node; remove it.")
        try:
            Config.model_validate(_nest(flat))
        except ValidationError as exc:
            item = exc.errors()[0]
            dotted = ".".join(str(p) for p in item["loc"])
            line = self.where.key(header, dotted, index)
            if item["type"] == "extra_forbidden":
                close = difflib.get_close_matches(dotted, list(known_keys()), n=1)
                hint = f" Did you mean {close[0]}?" if close else ""
                problem = f"is not a node setting.{hint} `swarmtrain config --keys` lists every setting."
            else:
                problem = item["msg"].removeprefix("Value error, ") + "."
            raise self.fail(line, f"{name}.{dotted}" if dotted else name, problem) from None
        return flat

    def targets(self, table: dict[str, Any], name: str, line: int, names: set[str]) -> tuple[str, ...]:
        value = table.get("nodes")
        if value is None:
            raise self.fail(line, f"{name}.nodes", 'is missing: name the nodes (["node1"]) or "random".')
        if value == "random":
            return ("random",)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise self.fail(line, f"{name}.nodes", f'must be a list of node names or "random", not {value!r}.')
        for v in value:
            if v not in names:
                raise self.fail(
                    line,
                    f"{name}.nodes",
                    f"names {v!r}, which is not a node of this scenario ({', '.join(sorted(names))}).",
                )
        return tuple(value)

    def link(self, table: Any, name: str, line: int) -> dict[str, float | None]:
        """The rates, losses and delays of a link table ({ up_mbit = 100, down_mbit = 20, up_loss = 0.01,
        up_ms = 25, down_ms = 25 }); an absent rate is unlimited, an absent loss or delay 0."""
        if not isinstance(table, dict):
            raise self.fail(line, name, "must be a table such as { up_mbit = 100, down_mbit = 20, up_ms = 25 }.")
        if "latency_ms" in table:
            raise self.fail(line, f"{name}.latency_ms", "is set per direction: up_ms delays what the node sends, "
                            "down_ms what it receives (A to B: A's up_ms plus B's down_ms).")  # fmt: skip
        if "loss" in table:
            raise self.fail(line, f"{name}.loss", "is set per direction: up_loss drops a share of what the node "
                            "sends, down_loss of what it receives (0.01: one packet in a hundred).")  # fmt: skip
        self.unknown(table, (*LINK_KEYS, *DELAY_KEYS), name, lambda k: line)
        rates = {k: self.take(table, name, k, (int, float), line) for k in RATE_KEYS}
        for key, value in rates.items():
            if value is not None and value <= 0:
                raise self.fail(line, f"{name}.{key}", "must be positive Mbit/s (leave it out for an unlimited link).")
        losses = {k: self.take(table, name, k, (int, float), line) or 0.0 for k in LOSS_KEYS}
        for key, value in losses.items():
            if not 0 <= value < 1:
                raise self.fail(line, f"{name}.{key}", "must be a share of packets from 0 up to 1 (0.01: one in 100).")
        delays = {k: self.take(table, name, k, (int, float), line) or 0.0 for k in DELAY_KEYS}
        for key, value in delays.items():
            if not 0 <= value <= 10_000:
                raise self.fail(line, f"{name}.{key}", "must be 0 to 10000 ms.")
        return {
            **{k: None if v is None else float(v) for k, v in rates.items()},
            **{k: float(v) for k, v in {**losses, **delays}.items()},
        }

    def data(self, settings: dict[str, Any], base: Path, origins: dict[str, tuple[str, int]]) -> None:
        """The node's corpus exists, and every folder data.include and data.eval_parts name is inside it: a node
        would fail at its start otherwise. ``origins`` gives the name and line of the key that set each setting."""
        data = settings.get("data.path")
        root = stdlib_root() if data is None else data_path(base, data)
        if not root.exists():
            name, line = origins["data.path"]
            raise self.fail(line, name, f"{root} does not exist; name a text file or folder (relative to this file).")
        for key in ("data.include", "data.eval_parts"):
            for folder in settings.get(key) or []:
                if not (root / folder).is_dir():
                    name, line = origins[key]
                    raise self.fail(line, name, f"names {folder!r}, which is not a folder inside the corpus ({root}).")

    def action(self, table: dict[str, Any], name: str, line: int) -> Action:
        action = table.get("action")
        if action not in ACTIONS:
            raise self.fail(line, f"{name}.action", f"must be one of {', '.join(ACTIONS)}, not {action!r}.")
        return action  # type: ignore[return-value]


def parse_spec(text: str, path: Path | str = "<scenario>") -> Scenario:
    """A ``Scenario`` from TOML text; any problem raises ``ScenarioError`` naming the line and key."""
    path = Path(path)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"scenario error: {path} is not valid TOML: {exc}. Fix the file's syntax.") from None
    p = _Parser(path, text)
    where = p.where
    p.unknown(
        doc,
        ("swarm", "config", "nodes", "event", "repeat"),
        "",
        lambda k: where.header(k) or where.header(k, 0),
    )
    swarm = doc.get("swarm")
    if not isinstance(swarm, dict):
        raise p.fail(
            1, "swarm", "the [swarm] table is missing; it names at least `nodes` and `rounds` or `wall_time_s`."
        )
    allowed = (
        "nodes",
        "rounds",
        "wall_time_s",
        "inner_steps",
        "codec",
        "model",
        "data",
        "checkpoint",
        "seed",
        "timeout_s",
        "link",
        "shaper",
    )
    line = lambda k: where.key("swarm", k)  # noqa: E731
    p.unknown(swarm, allowed, "swarm", line)
    count = p.take(swarm, "swarm", "nodes", (int,), line("nodes"))
    if count is None or count < 1:
        raise p.fail(line("nodes"), "swarm.nodes", "must be a whole number >= 1 (the nodes started at time 0).")
    rounds = p.take(swarm, "swarm", "rounds", (int,), line("rounds"))
    wall = p.take(swarm, "swarm", "wall_time_s", (int, float), line("wall_time_s"))
    if (rounds is None) == (wall is None):
        raise p.fail(
            where.header("swarm"), "swarm", "set exactly one of rounds (outer rounds per node) and wall_time_s."
        )
    if rounds is not None and rounds < 1 or wall is not None and wall <= 0:
        key = "rounds" if rounds is not None else "wall_time_s"
        raise p.fail(line(key), f"swarm.{key}", "must be positive.")
    model = p.take(swarm, "swarm", "model", (str,), line("model")) or "default"
    if model not in MODELS:
        raise p.fail(
            line("model"), "swarm.model", f"must be one of {', '.join(MODELS)} (or set [config.model]), not {model!r}."
        )
    base: dict[str, Any] = dict(MODELS[model])
    for key, target, types in (
        ("inner_steps", "node.inner_steps", (int,)),
        ("codec", "averaging.codec", (str,)),
        ("data", "data.path", (str,)),
    ):
        value = p.take(swarm, "swarm", key, types, line(key))
        if value is not None:
            base[target] = value
    checkpoint = p.take(swarm, "swarm", "checkpoint", (str,), line("checkpoint"))
    if checkpoint is not None:
        checkpoint = (path.parent / checkpoint) if not Path(checkpoint).is_absolute() else Path(checkpoint)
        if not checkpoint.is_file():
            raise p.fail(
                line("checkpoint"),
                "swarm.checkpoint",
                f"{checkpoint} is not a file; name a checkpoint a swarm node wrote "
                "(<run_dir>/checkpoints/step-*.safetensors).",
            )
    config = doc.get("config", {})
    if not isinstance(config, dict):
        raise p.fail(where.header("config"), "config", "must be a table of node settings.")
    from_config = p.settings(config, "config", "config")
    common = {**base, **from_config}

    default_link = p.link(swarm.get("link", {}), "swarm.link", line("link"))
    declared = doc.get("nodes", {})
    if not isinstance(declared, dict):
        raise p.fail(where.header("nodes"), "nodes", "must be tables such as [nodes.node1].")
    names = [f"node{i}" for i in range(count)] + [n for n in declared if n not in {f"node{i}" for i in range(count)}]
    nodes = []
    for name in names:
        own = declared.get(name, {})
        header = f"nodes.{name}"
        if not isinstance(own, dict):
            raise p.fail(where.key("nodes", name), header, "must be a table ([nodes.NAME]).")
        p.unknown(own, ("start", "config", "link"), header, lambda k, h=header: where.key(h, k))
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,32}", name) or name == "random":
            raise p.fail(
                where.header(header), header, "a node name is 1-32 letters, digits, - or _ (and not 'random')."
            )
        start = p.take(own, header, "start", (bool,), where.key(header, "start"))
        if start is None:
            start = name in {f"node{i}" for i in range(count)}
        table = f"{header}.config" if where.header(f"{header}.config") else header
        from_node = p.settings(own.get("config", {}), f"{header}.config", table)
        settings = {**common, **from_node}

        origins = {  # the name and line of the key that set each data setting, for the check's message
            key: (f"{header}.config.{key}", where.key(table, key)) if key in from_node
            else (f"config.{key}", where.key("config", key)) if key in from_config
            else ("swarm.data", line("data"))
            for key in ("data.path", "data.include", "data.eval_parts")
        }  # fmt: skip
        p.data(settings, path.parent, origins)
        rates = default_link
        if "link" in own:
            rates = p.link(own["link"], f"{header}.link", where.key(header, "link"))
        nodes.append(NodeSpec(name=name, start=start, settings=settings, **rates))
    if not any(n.start for n in nodes):
        raise p.fail(where.key("swarm", "nodes"), "swarm.nodes", "no node starts at time 0.")
    known = {n.name for n in nodes}

    events = []
    for i, table in enumerate(doc.get("event", [])):
        first = where.header("event", i)
        name = f"event[{i}]"
        lines = lambda k, i=i: where.key("event", k, i)  # noqa: E731
        p.unknown(table, ("action", "nodes", "at_s", "at_round", *LINK_KEYS, *DELAY_KEYS), name, lines)
        at_s = p.take(table, name, "at_s", (int, float), lines("at_s"))
        at_round = p.take(table, name, "at_round", (int,), lines("at_round"))
        if (at_s is None) == (at_round is None):
            raise p.fail(
                first, name, "set exactly one of at_s (seconds since the start) and at_round (rounds completed)."
            )
        if (at_s if at_s is not None else at_round) < 0:
            raise p.fail(lines("at_s" if at_s is not None else "at_round"), name, "must not be negative.")
        action = p.action(table, name, lines("action"))
        targets = p.targets(table, name, lines("nodes"), known)
        shape: dict[str, float | None] = {}
        if key := next((k for k in DELAY_KEYS if k in table), None):
            raise p.fail(lines(key), f"{name}.{key}", "a node's delay is fixed when it starts (its transport adds "
                         "it): set it in the swarm's or the node's link table, not in an event.")  # fmt: skip
        if action == "link":
            link = p.link({k: table[k] for k in LINK_KEYS if k in table}, name, first)
            shape = {k: link[k] for k in LINK_KEYS}
        elif key := next((k for k in LINK_KEYS if k in table), None):
            raise p.fail(lines(key), f"{name}.{key}", f"only a link event sets a link, not {action}; remove it.")
        events.append(Event(action=action, nodes=targets, at_s=at_s, at_round=at_round, line=first, **shape))

    repeats = []
    for i, table in enumerate(doc.get("repeat", [])):
        first = where.header("repeat", i)
        name = f"repeat[{i}]"
        lines = lambda k, i=i: where.key("repeat", k, i)  # noqa: E731
        keys = (
            "action",
            "nodes",
            "every_rounds",
            "every_s",
            "from_round",
            "from_s",
            "until_round",
            "until_s",
            "back_after_rounds",
            "back_after_s",
        )
        p.unknown(table, keys, name, lines)
        action = p.action(table, name, lines("action"))
        if action == "link":
            raise p.fail(lines("action"), f"{name}.action", "a repeating event cannot change links; use [[event]]s.")
        if action not in BACK and (key := next((k for k in table if k.startswith("back_after")), None)):
            raise p.fail(lines(key), f"{name}.{key}", f"{action} has nothing to come back from; remove it.")
        targets = p.targets(table, name, lines("nodes"), known)
        every_rounds = p.take(table, name, "every_rounds", (int,), lines("every_rounds"))
        every_s = p.take(table, name, "every_s", (int, float), lines("every_s"))
        if (every_rounds is None) == (every_s is None):
            raise p.fail(first, name, "set exactly one of every_rounds and every_s.")
        unit = "round" if every_rounds is not None else "s"
        if (every_rounds or every_s) <= 0:
            raise p.fail(first, name, "every_rounds / every_s must be positive.")
        keys_of = {
            "round": ("from_round", "until_round", "back_after_rounds"),
            "s": ("from_s", "until_s", "back_after_s"),
        }
        other = keys_of["s" if unit == "round" else "round"]
        for key in table:
            if key in other:
                mine = ", ".join(keys_of[unit])
                raise p.fail(
                    lines(key),
                    f"{name}.{key}",
                    f"mixes units: with every_{'rounds' if unit == 'round' else 's'} use {mine}.",
                )
        from_key, until_key, back_key = keys_of[unit]
        start = p.take(table, name, from_key, (int, float), lines(from_key)) or 0
        until = p.take(table, name, until_key, (int, float), lines(until_key))
        back = p.take(table, name, back_key, (int, float), lines(back_key))
        if back is not None and back <= 0:
            raise p.fail(lines(back_key), f"{name}.{back_key}", "must be positive.")
        repeats.append(
            Repeat(
                action=action,
                nodes=targets,
                every_rounds=every_rounds,
                every_s=every_s,
                start=start,
                until=until,
                back_after=back,
                line=first,
            )
        )

    seed = p.take(swarm, "swarm", "seed", (int,), line("seed")) or 0
    timeout = p.take(swarm, "swarm", "timeout_s", (int, float), line("timeout_s")) or 900.0
    shaper = p.take(swarm, "swarm", "shaper", (str,), line("shaper")) or "auto"
    if shaper not in SHAPERS:
        raise p.fail(line("shaper"), "swarm.shaper", f"must be one of {', '.join(SHAPERS)}, not {shaper!r}.")
    scenario = Scenario(
        path=path, text=text, rounds=rounds or 0, wall_time_s=wall, seed=seed, timeout_s=float(timeout),
        checkpoint=checkpoint, nodes=tuple(nodes), events=tuple(events), repeats=tuple(repeats), shaper=shaper,
    )  # fmt: skip
    if shaper == "transport" and scenario.kernel_only:
        raise p.fail(
            line("shaper"), "swarm.shaper",
            "= transport paces link rates only: a loss, a link event or a partition needs the kernel (root); "
            "use kernel or auto, or drop those.",
        )  # fmt: skip
    return scenario


def data_path(base: Path, data: str) -> Path:
    """A node's data.path: relative to the scenario file's folder when it is there, else as written."""
    path = Path(data).expanduser()
    return base / path if not path.is_absolute() and (base / path).exists() else path


def load_spec(path: Path | str) -> Scenario:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"scenario error: cannot read {path} ({exc}). Check the path.") from None
    return parse_spec(text, path)
