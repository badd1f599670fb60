"""Narrow links for a scenario's nodes: a network namespace per node, rate-limited by the kernel's ``tbf``.

    [nodes.node1]
    link = { up_mbit = 100, down_mbit = 20 }

Each node runs in a namespace of its own (``ip netns exec``), joined to the runner's namespace by a veth pair whose
host end sits on a bridge that also carries the bootstrap peer's address. A token-bucket filter on the node's end
shapes what it sends (uplink), one on the host end what it receives (downlink). A ``link`` event replaces them, a
``partition`` moves the listed nodes' host ends onto a second bridge (they still reach each other, not the rest),
and ``heal`` moves them back. Needs root and the ``ip``/``tc`` tools. The kernel's ``netem`` (latency, loss) is not
available on the machines this was built on: a link's loss (up_loss, down_loss) is dropped by a small eBPF
classifier on the host end (``bpf.py``; ingress for what the node sends, egress for what it receives), and its
delay (up_ms, down_ms) is added by the node's own transport (node.up_delay_ms, node.down_delay_ms). Without root
(or with ``[swarm] shaper = "transport"``) the rates are the node's transport's too (node.up_mbit,
node.down_mbit: ``net/rpc.py``'s ``Pacer``), and no namespace is made.

Every name carries a short id of the run, and ``close`` deletes every namespace, veth and bridge it created. A
runner that cannot close (killed by SIGKILL or the OOM killer) leaves them behind: each network's owner is kept in
``OWNERS`` (its pid and that process's start time), and a new network first deletes those of owners no longer
running (``sweep``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from swarmtrain.scenarios.bpf import pinned_drop
from swarmtrain.scenarios.spec import ScenarioError

log = logging.getLogger(__name__)

OWNERS = Path("/run/swarmtrain/networks")  # one file per live network, named by its id: "<pid> <start time>"
BURST_S = 0.004  # tbf bucket: 4 ms of the rate (at least 16 KiB), so a burst cannot hide the rate for long
LIMIT_S = 0.25  # tbf queue: 250 ms of the rate before packets drop (TCP backs off, as on a real narrow link)


def _ip(*args: str, ns: str | None = None) -> None:
    command = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ScenarioError(
            f"scenario error: `{' '.join(command)}` failed: {done.stderr.strip()}. Link shaping needs root and the "
            "`ip` and `tc` tools (iproute2); drop the link settings to run without it."
        )


def kernel_available() -> bool:
    """Whether the kernel can shape links here: root, with the ``ip`` and ``tc`` tools."""
    return os.geteuid() == 0 and bool(shutil.which("ip")) and bool(shutil.which("tc"))


def check_available() -> None:
    """A clear error when shaping cannot work here (not root, no iproute2)."""
    if not kernel_available():
        raise ScenarioError(
            "scenario error: link loss, link events and partitions (and [swarm] shaper = kernel) need root and the "
            "`ip` and `tc` tools (apt-get install iproute2); run as root, or remove them (link rates and delays "
            "alone work without root: each node paces its own messages)."
        )


def _tbf(dev: str, mbit: float | None, ns: str | None) -> None:
    if mbit is None:
        with contextlib.suppress(ScenarioError):  # no qdisc of ours yet: nothing to remove
            _ip("tc", "qdisc", "del", "dev", dev, "root", ns=ns)
        return
    rate = mbit * 1e6 / 8  # bytes per second
    burst, limit = max(16384, int(rate * BURST_S)), max(65536, int(rate * LIMIT_S))
    _ip("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit", "burst", str(burst),
        "limit", str(limit), ns=ns)  # fmt: skip


def _drop(dev: str, hook: str, loss: float) -> None:
    """Drop ``loss`` of the packets at ``dev``'s ingress or egress hook (0: none); replaces what was there."""
    _ip("tc", "qdisc", "replace", "dev", dev, "clsact")
    with contextlib.suppress(ScenarioError):  # no filter of ours yet: nothing to remove
        _ip("tc", "filter", "del", "dev", dev, hook)
    if loss > 0:
        with pinned_drop(loss) as path:
            _ip("tc", "filter", "add", "dev", dev, hook, "bpf", "da", "object-pinned", path)


@dataclass(slots=True)
class Link:
    namespace: str
    address: str
    node_dev: str
    host_dev: str
    lossy: bool = False  # a drop filter is attached (a link event to loss 0 removes it)


def _started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks after boot), or None if there is no such process: a pid alone may
    have been reused by another process since."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[19]  # field 22; the name before it may hold spaces


def _lines(command: list[str]) -> list[str]:
    return subprocess.run(command, capture_output=True, text=True, check=False).stdout.splitlines()


def sweep() -> list[str]:
    """Delete the namespaces, veths and bridges of networks whose runner is no longer running; returns their ids."""
    swept = []
    namespaces = [line.split()[0] for line in _lines(["ip", "netns", "list"]) if line.strip()]
    links = [line.split(": ")[1].split("@")[0] for line in _lines(["ip", "-o", "link", "show"]) if ": " in line]
    for owner in sorted(OWNERS.glob("*")) if OWNERS.is_dir() else []:
        with contextlib.suppress(ValueError, OSError):
            pid, started = owner.read_text().split()
            if _started(int(pid)) == started:
                continue  # its runner is alive: the network is in use
        prefix = f"st{owner.name}"
        for command in [["ip", "netns", "del", ns] for ns in namespaces if ns.startswith(f"{prefix}n")] + [
            ["ip", "link", "del", name] for name in links if name.startswith(prefix)
        ]:  # a veth goes with its namespace: its host end may be gone by the time it is asked for
            subprocess.run(command, capture_output=True, check=False)
        owner.unlink(missing_ok=True)
        swept.append(owner.name)
        log.warning("deleted the namespaces and links of scenario network %s: its runner is gone", owner.name)
    return swept


class Network:
    """The bridges, namespaces and veths of one scenario run."""

    def __init__(self) -> None:
        check_available()
        sweep()
        OWNERS.mkdir(parents=True, exist_ok=True)
        self.id = secrets.token_hex(2)
        while (OWNERS / self.id).exists():
            self.id = secrets.token_hex(2)
        self.owner = OWNERS / self.id
        self.owner.write_text(f"{os.getpid()} {_started(os.getpid())}")  # before anything is made: see ``sweep``
        self.subnet = f"10.{200 + int(self.id, 16) % 50}.{int(self.id, 16) % 250}"
        self.bridge, self.cut = f"st{self.id}br", f"st{self.id}cut"
        self.host_address = f"{self.subnet}.1"
        self.links: dict[str, Link] = {}
        self.created: list[tuple[str, str]] = []  # ("link" | "netns", name), deleted in reverse order
        try:
            for bridge in (self.bridge, self.cut):
                _ip("ip", "link", "add", bridge, "type", "bridge")
                self.created.append(("link", bridge))
                _ip("ip", "link", "set", bridge, "up")
            _ip("ip", "addr", "add", f"{self.host_address}/24", "dev", self.bridge)
        except BaseException:
            self.close()
            raise

    def add(
        self, name: str, up_mbit: float | None, down_mbit: float | None, up_loss: float = 0.0, down_loss: float = 0.0
    ) -> Link:
        """A namespace for node ``name`` with its own address on the bridge, shaped as given (rates: None is
        unlimited; losses: the share of packets dropped)."""
        index = len(self.links) + 2
        if index > 250:
            raise ScenarioError("scenario error: at most 249 nodes can have a namespace of their own")
        ns, node_dev, host_dev = f"st{self.id}n{index}", f"st{self.id}v{index}", f"st{self.id}h{index}"
        _ip("ip", "netns", "add", ns)
        self.created.append(("netns", ns))
        _ip("ip", "link", "add", host_dev, "type", "veth", "peer", "name", node_dev)
        self.created.append(("link", host_dev))
        _ip("ip", "link", "set", node_dev, "netns", ns)
        _ip("ip", "link", "set", host_dev, "master", self.bridge)
        _ip("ip", "link", "set", host_dev, "up")
        address = f"{self.subnet}.{index}"
        _ip("ip", "addr", "add", f"{address}/24", "dev", node_dev, ns=ns)
        _ip("ip", "link", "set", node_dev, "up", ns=ns)
        _ip("ip", "link", "set", "lo", "up", ns=ns)
        link = Link(ns, address, node_dev, host_dev)
        self.links[name] = link
        self.shape(name, up_mbit, down_mbit, up_loss, down_loss)
        return link

    def shape(
        self, name: str, up_mbit: float | None, down_mbit: float | None, up_loss: float = 0.0, down_loss: float = 0.0
    ) -> None:
        link = self.links[name]
        _tbf(link.node_dev, up_mbit, link.namespace)  # what the node sends
        _tbf(link.host_dev, down_mbit, None)  # what it receives
        if up_loss or down_loss or link.lossy:
            _drop(link.host_dev, "ingress", up_loss)  # what the node sent, as it reaches the bridge
            _drop(link.host_dev, "egress", down_loss)
            link.lossy = bool(up_loss or down_loss)

    def partition(self, names: list[str], cut: bool) -> None:
        """Move the nodes' host ends onto the cut bridge (they reach only each other) or back."""
        for name in names:
            _ip("ip", "link", "set", self.links[name].host_dev, "master", self.cut if cut else self.bridge)

    def prefix(self, name: str) -> list[str]:
        """The command prefix that runs a process in node ``name``'s namespace."""
        return ["ip", "netns", "exec", self.links[name].namespace]

    def close(self) -> None:
        for kind, name in reversed(self.created):
            command = ["ip", "netns", "del", name] if kind == "netns" else ["ip", "link", "del", name]
            subprocess.run(command, capture_output=True, check=False)  # a veth goes with its namespace too
        self.created.clear()
        self.owner.unlink(missing_ok=True)
