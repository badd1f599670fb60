"""Run a scenario: a bootstrap peer and real node processes on loopback, with the timeline applied.

    swarmtrain scenario run scenarios/churn-drop-one.toml --out runs/churn

The nodes are ordinary ``swarmtrain node`` processes (the spec's settings become ``--set`` flags), all joining
through one ``swarmtrain bootstrap`` peer. The runner writes, in the --out folder: ``scenario.toml`` (the spec as
given), ``nodes/<name>/`` (each node's run directory; a node that comes back after a kill or leave is a fresh
process in ``nodes/<name>.2`` and so on), ``events.jsonl`` (every start, event and exit with its time) and
``run.json`` (the run's processes and times). ``report.write_report`` turns that folder into the report.

Whatever happens (the end, an error, Ctrl+C), every process it started is stopped before it returns.
"""

from __future__ import annotations

import json
import math
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from swarmtrain.scenarios.links import Network, kernel_available
from swarmtrain.scenarios.procs import Processes
from swarmtrain.scenarios.spec import LINK_KEYS, NETWORK_ACTIONS, Scenario, ScenarioError, data_path
from swarmtrain.scenarios.timeline import Firing, Timeline

POLL_S = 0.5
BOOTSTRAP_TIMEOUT_S = 120.0
STOP_GRACE_S = 120.0  # a graceful stop at the end of a wall-time scenario: the round in flight plus a checkpoint
DEFAULTS = {"node.eval_every": 1}  # held-out bpb after every round: the report's loss curves


def toml_value(value: Any) -> str:
    """``value`` as TOML text for ``--set key=VALUE`` (the node parses it back with the same types)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise ScenarioError(f"scenario error: cannot pass {value!r} to a node as a setting")


@dataclass(slots=True)
class Incarnation:
    """One process of a node; a node that comes back after a kill or leave gets a new one."""

    name: str
    number: int
    run_dir: Path
    proc: Any
    started: float
    ended: float | None = None
    exit_code: int | None = None
    rows_read: list[dict[str, Any]] = field(default_factory=list)


class Runner:
    def __init__(self, spec: Scenario, out: Path, stream: TextIO | None = None) -> None:
        self.spec, self.out, self.stream = spec, out, stream or sys.stdout
        self.procs = Processes()
        self.timeline = Timeline(spec)
        self.states = {n.name: "idle" for n in spec.nodes}
        self.lives: dict[str, list[Incarnation]] = {n.name: [] for n in spec.nodes}
        self.t0 = time.time()
        self.join_addr = ""
        self.rounds_done = 0
        self.contributing: set[str] = set()  # nodes whose current process has logged a round (random victims)
        self.stopping = False
        self.net: Network | None = None  # a namespace per node when some link is shaped (links.py)
        self.stop_deadline = math.inf  # a wall-time scenario's nodes get this long to leave, then they are killed

    # ---- output ---------------------------------------------------------------------------------------------

    def now(self) -> float:
        return time.time() - self.t0

    def record(self, action: str, node: str | None = None, **detail: Any) -> None:
        entry = {"time": round(time.time(), 3), "t": round(self.now(), 3), "action": action, "node": node, **detail}
        with open(self.out / "events.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")

    def say(self, what: str = "") -> None:
        by_state: dict[str, list[str]] = {}
        for name, state in self.states.items():
            by_state.setdefault(state, []).append(name)
        total = f"/{self.spec.rounds}" if self.spec.rounds else ""
        parts = [f"round {self.rounds_done}{total}"]
        parts += [f"{s} {' '.join(by_state[s])}" for s in ("running", "paused", "leaving", "gone") if s in by_state]
        line = f"[{self.now():7.1f} s] " + " | ".join(parts) + (f" | {what}" if what else "")
        print(line, file=self.stream, flush=True)

    # ---- processes ------------------------------------------------------------------------------------------

    def start_bootstrap(self) -> None:
        run_dir = self.out / "bootstrap"
        args = [sys.executable, "-m", "swarmtrain", "bootstrap", "--run-dir", str(run_dir)]
        if self.net is not None:  # on the bridge every node's namespace reaches
            args += ["--host", f"/ip4/{self.net.host_address}/tcp/0"]
        settings = self.spec.nodes[0].settings
        for key in ("node.run_id", "node.swarm_key", "node.allow_peers"):
            if key in settings:
                args += ["--set", f"{key}={toml_value(settings[key])}"]
        proc = self.procs.start(args, run_dir / "bootstrap.log")
        deadline = time.monotonic() + BOOTSTRAP_TIMEOUT_S
        while time.monotonic() < deadline:
            found = re.search(r"--join (\S+)", (run_dir / "bootstrap.log").read_text(errors="replace"))
            if found:
                self.join_addr = found.group(1)
                self.record("bootstrap", address=self.join_addr)
                return
            if self.procs.exit_code(proc) is not None:
                break
            time.sleep(0.2)
        tail = (run_dir / "bootstrap.log").read_text(errors="replace")[-1500:]
        raise ScenarioError(f"scenario error: the bootstrap peer did not come up. Its log ends with:\n{tail}")

    def node_args(self, name: str, run_dir: Path, initial: bool, resume: bool) -> list[str]:
        node = self.spec.node(name)
        settings = {**DEFAULTS, **node.settings}
        if node.up_ms or node.down_ms:  # the node's transport delays its messages (links.py: rates and loss)
            settings |= {"node.up_delay_ms": node.up_ms, "node.down_delay_ms": node.down_ms}
        if self.net is None and (node.up_mbit or node.down_mbit):  # no kernel shaping: the node paces itself
            settings |= {"node.up_mbit": node.up_mbit or 0.0, "node.down_mbit": node.down_mbit or 0.0}
        if isinstance(settings.get("data.path"), str):
            settings["data.path"] = str(data_path(self.spec.path.parent, settings["data.path"]))
        initial_count = sum(n.start for n in self.spec.nodes)
        # The first nodes start round 0 together. A joiner waits until it sees one peer of the running swarm: its
        # first look at the DHT through the bootstrap peer can come back empty, and a node that sees no one trains
        # on as a swarm of one from round 0 (seen in two runs: 13 s after its start it was on its own).
        settings["node.min_peers"] = initial_count if initial else min(2, len(self.spec.nodes))
        args = [sys.executable, "-m", "swarmtrain", "node", "--run-dir", str(run_dir), "--join", self.join_addr]
        if self.net is not None:
            args = [*self.net.prefix(name), *args, "--host", f"/ip4/{self.net.links[name].address}/tcp/0"]
        args += ["--rounds", str(self.spec.rounds)] if self.spec.rounds else []
        args += ["--resume"] if resume else []
        for key, value in settings.items():
            args += ["--set", f"{key}={toml_value(value)}"]
        return args

    def start_node(self, name: str, initial: bool) -> None:
        number = len(self.lives[name]) + 1
        run_dir = self.out / "nodes" / (name if number == 1 else f"{name}.{number}")
        resume = False
        if initial and self.spec.checkpoint is not None:
            target = run_dir / "checkpoints" / self.spec.checkpoint.name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(self.spec.checkpoint.read_bytes())
            resume = True
        proc = self.procs.start(self.node_args(name, run_dir, initial, resume), run_dir / "node.log")
        self.lives[name].append(Incarnation(name, number, run_dir, proc, time.time()))
        where = str(run_dir.relative_to(self.out))
        self.record("start", name, run_dir=where, pid=proc.pid, initial=initial, incarnation=number)

    @staticmethod
    def link(firing: Firing) -> dict[str, float | None]:
        return dict(zip(LINK_KEYS, firing.link, strict=True)) if firing.action == "link" else {}

    def current(self, name: str) -> Incarnation:
        return self.lives[name][-1]

    def apply(self, firing: Firing) -> None:
        if firing.node is None:
            self.record(firing.action, None, source=firing.source, skipped=firing.skipped)
            self.say(f"{firing.action} skipped ({firing.source}: {firing.skipped})")
            return
        name = firing.node
        if firing.action == "join":
            self.start_node(name, initial=False)
        elif firing.action not in NETWORK_ACTIONS:
            proc = self.current(name).proc
            if firing.action == "kill":
                self.procs.signal_group(proc, signal.SIGKILL)
            elif firing.action == "pause":
                self.procs.signal_group(proc, signal.SIGSTOP)
            elif firing.action == "resume":
                self.procs.signal_group(proc, signal.SIGCONT)
            elif firing.action == "leave":
                self.procs.signal_leader(proc, signal.SIGTERM)
        if firing.action in NETWORK_ACTIONS:
            assert self.net is not None  # Scenario.shaped holds for any network event
            if firing.action == "link":
                self.net.shape(name, *firing.link)
            else:
                self.net.partition([name], cut=firing.action == "partition")
        self.record(firing.action, name, source=firing.source, **self.link(firing))
        self.say(f"{firing.action} {name} ({firing.source})")

    # ---- the loop ---------------------------------------------------------------------------------------------

    def read_progress(self) -> None:
        from swarmtrain.node.demo import read_metrics

        done, contributing = self.rounds_done, set()
        for name, lives in self.lives.items():
            for life in lives:
                rows = [r for r in read_metrics(life.run_dir / "metrics.jsonl") if r.get("kind") == "round"]
                if rows:
                    done = max(done, max(r["round"] for r in rows) + 1)
                    if life is lives[-1] and life.ended is None:
                        contributing.add(name)
        self.contributing = contributing
        if done != self.rounds_done:
            self.rounds_done = done
            self.say()

    def reap_exits(self) -> None:
        for name, lives in self.lives.items():
            for life in lives:  # an earlier life too: a node killed and back within one poll
                if life.ended is not None or (code := self.procs.exit_code(life.proc)) is None:
                    continue
                life.ended, life.exit_code = time.time(), code
                latest = life is lives[-1]
                killed = not latest or self.states[name] == "gone"
                if latest:
                    self.states[name] = "gone"
                self.record("exit", name, code=code, killed=killed, incarnation=life.number)
                if not killed:
                    self.say(f"{name} exited (code {code})")

    def kernel_shapes(self) -> bool:
        """Whether the kernel shapes the links ([swarm] shaper): auto takes it where it works, and otherwise where
        the nodes' own pacing cannot do (a loss, a link event, a partition: Network() then says it needs root)."""
        spec = self.spec
        return kernel_available() or spec.kernel_only if spec.shaper == "auto" else spec.shaper == "kernel"

    def alive(self) -> list[str]:
        return [n for n, lives in self.lives.items() if lives and lives[-1].ended is None]

    def run(self) -> None:
        spec = self.spec
        self.out.mkdir(parents=True, exist_ok=True)
        if any(self.out.iterdir()):
            raise ScenarioError(f"scenario error: {self.out} is not empty; choose a new --out folder.")
        (self.out / "scenario.toml").write_text(spec.text, encoding="utf-8")
        self.record("scenario", path=str(spec.path))
        try:
            if spec.shaped and not self.kernel_shapes():
                self.say("link rates: each node paces its own messages (no kernel shaping here)")
            elif spec.shaped:
                self.net = Network()
                for node in spec.nodes:
                    shape = {k: getattr(node, k) for k in LINK_KEYS}
                    self.net.add(node.name, **shape)
                    self.record("link", node.name, **shape)
            self.start_bootstrap()
            for node in spec.nodes:
                if node.start:
                    self.start_node(node.name, initial=True)
                    self.states[node.name] = "running"
            self.say("started")
            self.loop()
        finally:
            self.procs.close()
            if self.net is not None:
                self.net.close()
            for lives in self.lives.values():
                for life in lives:
                    if life.ended is None:
                        life.ended, life.exit_code = time.time(), life.proc.returncode
            self.write_run()

    def loop(self) -> None:
        spec = self.spec
        while True:
            time.sleep(POLL_S)
            self.reap_exits()
            self.read_progress()
            if not self.alive():
                self.say("every node has exited")
                return
            now = self.now()
            if now > spec.timeout_s:
                raise ScenarioError(
                    f"scenario error: the scenario ran past its timeout ({spec.timeout_s:g} s) with "
                    f"{len(self.alive())} nodes still running; raise [swarm] timeout_s or shorten the run."
                )
            if spec.wall_time_s is not None and now >= spec.wall_time_s and not self.stopping:
                self.stop_all(now, f"wall time {spec.wall_time_s:g} s reached: every node leaves")
                continue
            late = [n for n in self.alive() if n not in self.contributing]
            if spec.rounds and self.rounds_done >= spec.rounds and late == self.alive() and not self.stopping:
                # The swarm logged its last round and every node that trained has left: the nodes still running
                # came back too late to take part (they would wait node.min_peers_timeout_s for peers in vain).
                self.stop_all(now, f"the swarm finished its {spec.rounds} rounds before {' '.join(late)} took part "
                                   "in one: they leave")  # fmt: skip
                continue
            if self.stopping:
                if now > self.stop_deadline:
                    self.say(f"nodes {' '.join(self.alive())} did not leave in {STOP_GRACE_S:g} s: killing them")
                    return
                continue
            for firing in self.timeline.due(now, self.rounds_done, self.states, self.contributing):
                self.apply(firing)
            running = [n for n in self.alive() if self.states[n] in ("running", "leaving")]
            if not running and not self.timeline.has_pending("s"):
                for name in self.alive():  # only paused nodes are left and nothing would resume them
                    self.apply(Firing("resume", name, "end of the timeline"))
                    self.states[name] = "running"

    def stop_all(self, now: float, why: str) -> None:
        """The end of a scenario's time, or of its rounds for nodes too late to take part: every node left leaves
        gracefully (paused ones are resumed first)."""
        self.stopping = True
        self.say(why)
        for name in self.alive():
            proc = self.current(name).proc
            self.procs.signal_group(proc, signal.SIGCONT)
            self.procs.signal_leader(proc, signal.SIGTERM)
            self.states[name] = "leaving"
            self.record("stop", name)
        self.stop_deadline = now + STOP_GRACE_S

    def write_run(self) -> None:
        lives = [
            {
                "node": life.name, "incarnation": life.number, "run_dir": str(life.run_dir.relative_to(self.out)),
                "started": life.started, "ended": life.ended, "exit_code": life.exit_code,
            }
            for lives in self.lives.values() for life in lives
        ]  # fmt: skip
        ended = max((life["ended"] for life in lives if life["ended"]), default=time.time())
        run = {
            "scenario": str(self.spec.path), "started": self.t0, "ended": ended, "rounds": self.spec.rounds,
            "wall_time_s": self.spec.wall_time_s, "nodes": lives, "rounds_done": self.rounds_done,
        }  # fmt: skip
        (self.out / "run.json").write_text(json.dumps(run, indent=2) + "\n", encoding="utf-8")


def run_scenario(spec: Scenario, out: Path, stream: TextIO | None = None) -> None:
    Runner(spec, out, stream).run()


__all__ = ["Runner", "run_scenario", "toml_value"]
