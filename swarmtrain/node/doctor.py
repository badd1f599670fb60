"""``swarmtrain doctor``: check what a user cannot see before a node runs, and name the fix for each failure.

    swarmtrain doctor --config run.toml
    swarmtrain doctor --config run.toml --join /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...

Checks, in order: the run directory is writable and its disk holds the checkpoints, the data is readable, the
inner steps' device (``train.device``) is on this machine, the listen ports are free, the p2p daemon starts, each
announced address can be dialled, and (with --join) the swarm answers, its settings (run id, model shape and
exits, codec, outer step) are this config's, its clocks are within ``settings.MAX_CLOCK_SKEW_S`` of this
machine's, and its peers can dial this machine back on its addresses (``net.reachability``). Exit status 1 when
one fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from hivemind.p2p import P2P
from hivemind.utils.crypto import RSAPrivateKey

from swarmtrain.config import Config
from swarmtrain.errors import ConfigError, SwarmtrainError
from swarmtrain.net import P2PTransport, load_auth, reachability, verify_swarm
from swarmtrain.net.reachability import Reachability, ask_dialback, dialable
from swarmtrain.node import settings
from swarmtrain.node.settings import Answer, ask_settings, differences, fix_for, majority, swarm_settings
from swarmtrain.train.device import present_devices, resolve_device

CHECKPOINT_COPIES = 4  # float32 copies of the parameters in a node checkpoint: model, AdamW m and v, theta_g


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""

    def lines(self) -> list[str]:
        head = f"{'ok  ' if self.ok else 'FAIL'}  {self.name}: {self.detail}"
        return [head, f"      fix: {self.fix}"] if not self.ok and self.fix else [head]


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check_run_dir(config: Config) -> Check:
    run_dir = Path(config.run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".doctor-"):
            pass
    except OSError as exc:
        return Check(
            "run directory", False, f"cannot write to {run_dir} ({exc.strerror})",
            f"give --run-dir a directory you can write to, or make it writable (chmod u+w {run_dir})",
        )  # fmt: skip
    return Check("run directory", True, f"{run_dir} is writable")


def checkpoint_bytes(config: Config) -> int:
    """Bytes of one node checkpoint of this model (counted on the meta device: nothing is allocated)."""
    import torch

    from swarmtrain.model import ByteTransformer

    with torch.device("meta"):
        numel = sum(p.numel() for p in ByteTransformer(config.model).parameters())
    return (CHECKPOINT_COPIES + (config.averaging.outer_momentum > 0)) * 4 * numel  # and the outer momentum


def check_disk(config: Config) -> Check:
    # A new checkpoint is written before the oldest kept one is removed.
    need = (config.train.keep_checkpoints + 1) * checkpoint_bytes(config)
    where = _existing_parent(Path(config.run_dir))
    free = shutil.disk_usage(where).free
    detail = f"{free / 2**20:,.0f} MiB free at {where}; checkpoints need {need / 2**20:,.0f} MiB"
    if free < need:
        return Check(
            "disk for checkpoints", False, detail,
            "free space there, put --run-dir on a larger disk, or lower train.keep_checkpoints",
        )  # fmt: skip
    return Check("disk for checkpoints", True, detail)


def check_data(config: Config) -> Check:
    from swarmtrain.data import load_corpus

    try:
        corpus = load_corpus(config.data)
        corpus.check_context(config.model.context)
    except SwarmtrainError as exc:
        return Check("data", False, str(exc), "point --data (data.path) at a readable text file or folder")
    return Check("data", True, f"{config.data.path or 'the Python standard library source'} is readable")


def check_device(config: Config) -> Check:
    """Where the inner steps will run: ``train.device`` on this machine, and why the CPU when it is the CPU."""
    asked = config.train.device
    if config.train.trainer == "localtrain":
        return Check("device", True, "cpu (localtrain runs its stages on the CPU)")
    try:
        device = resolve_device(asked)
    except ConfigError:
        return Check(
            "device",
            False,
            f"train.device = {asked!r} is not on this machine (present: {', '.join(present_devices())})",
            "set train.device to a present device, or to auto to take the best one",
        )
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return Check("device", True, f"{device} ({props.name}, {props.total_memory / 2**30:.0f} GiB)")
    if device.type == "cpu" and asked == "auto":
        why = "a CPU-only build" if torch.version.cuda is None else "a CUDA build, but CUDA finds no GPU"
        return Check("device", True, f"cpu: no GPU found (torch {torch.__version__} is {why})")
    return Check("device", True, str(device))


def _tcp_ports(addrs: list[str]) -> list[tuple[str, int]]:
    from multiaddr import Multiaddr

    found = []
    for addr in addrs:
        parsed = Multiaddr(addr)
        protocols = [p.name for p in parsed.protocols()]
        if "tcp" in protocols and ("ip4" in protocols or "ip6" in protocols):
            ip = parsed.value_for_protocol("ip4" if "ip4" in protocols else "ip6")
            port = int(parsed.value_for_protocol("tcp"))
            if port:
                found.append((ip, port))
    return found


def check_ports(config: Config) -> Check:
    wanted = [(ip, port, "node.host") for ip, port in _tcp_ports(config.node.host)]
    if config.observe.http_port:
        wanted.append((config.observe.http_host, config.observe.http_port, "observe.http_port"))
    for ip, port, key in wanted:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((ip, port))
            except OSError as exc:
                return Check(
                    "ports", False, f"cannot listen on {ip}:{port} ({key}): {exc.strerror}",
                    f"stop the process that uses port {port} (`ss -ltnp 'sport = :{port}'` names it) or set another "
                    f"port in {key}",
                )  # fmt: skip
    ports = ", ".join(f"{ip}:{port}" for ip, port, _ in wanted) or "none fixed (node.host picks a free port)"
    return Check("ports", True, f"free: {ports}")


async def check_daemon(config: Config) -> tuple[Check, P2P | None]:
    node = config.node
    try:
        p2p = await P2P.create(host_maddrs=node.host, announce_maddrs=node.announce or None)
    except Exception as exc:
        return Check(
            "p2p daemon", False, f"the daemon did not start on {node.host} ({exc})",
            "check that node.host names addresses of this machine (e.g. /ip4/0.0.0.0/tcp/31337) and that "
            "hivemind is installed completely (its p2pd binary)",
        ), None  # fmt: skip
    return Check("p2p daemon", True, f"started as {p2p.peer_id} on {node.host}"), p2p


async def check_announce(config: Config, p2p: P2P) -> Check:
    """Dial each announced address from a second daemon on this machine: a wrong address or port fails here (a
    dial from this machine cannot prove that a firewall or NAT lets other machines in)."""
    failed = []
    for addr in config.node.announce:
        target = f"{addr}/p2p/{p2p.peer_id}"
        try:
            dialler = await P2P.create(initial_peers=[target])
        except Exception:
            failed.append(addr)
            continue
        await dialler.shutdown()
    if failed:
        return Check(
            "announced address", False, f"no daemon answers at {', '.join(failed)} (node.announce)",
            "set --announce to this machine's public address with the port node.host listens on (e.g. "
            "--host /ip4/0.0.0.0/tcp/31337 --announce /ip4/<public ip>/tcp/31337) and forward that port on your "
            "router; without a public address, join through a peer that has one",
        )  # fmt: skip
    return Check("announced address", True, f"{', '.join(config.node.announce)} answers (dialled from this machine)")


async def check_swarm(config: Config) -> list[Check]:
    """Reach the swarm through node.join and compare its settings with this config's."""
    from swarmtrain.dht import swarm_records
    from swarmtrain.node.node import NodeError, join_peers, start_dht, start_p2p

    try:
        p2p = await start_p2p(config, None)
    except NodeError as exc:
        return [Check("swarm", False, str(exc), "copy the --join line a running peer printed; check its port")]
    checks = []
    try:
        auth = load_auth(config.node.swarm_key, config.node.allow_peers)
        transport = P2PTransport(p2p, auth=auth)
        try:
            await verify_swarm(transport, join_peers(config))
        except SwarmtrainError as exc:
            return [Check("swarm key", False, str(exc), "use the swarm's key file in node.swarm_key")]
        peers = list(join_peers(config))
        with contextlib.suppress(NodeError):
            dht = await start_dht(p2p, config, RSAPrivateKey(), client=True)
            try:
                records = await swarm_records(dht, config.node.run_id, auth)
            finally:
                await dht.shutdown()
            peers += [r.peer_id for r in records if r.phase != "leaving"]
        answers = await ask_settings(transport, peers)
        if not answers:
            return [Check("swarm", False, "no peer answered with its settings", "check node.join")]
        trained = {p: a for p, a in answers.items() if "model.depth" in a.settings}
        checks.append(Check("swarm", True, f"{len(answers)} peers answered, {len(trained)} of them training"))
        checks.append(check_clock(answers))
        addrs = dialable(await p2p.get_visible_maddrs())
        checks.append(check_reachable(await ask_dialback(transport, answers, addrs)))
        mine, swarm = swarm_settings(config), majority(answers)
        diffs = differences(mine, swarm)
        for key, value, theirs in diffs:
            fix = fix_for(key, theirs)
            checks.append(Check(f"config {key}", False, f"{value!r} here, the swarm uses {theirs!r}", fix))
        if not diffs:
            compared = "run id and protocol" if not trained else "run id, protocol, model shape and exits, codec"
            checks.append(Check("config", True, f"{compared} match the swarm's"))
    finally:
        await p2p.shutdown()
    return checks


def check_clock(answers: dict[str, Answer]) -> Check:
    """This machine's clock against the peers' that answered (see ``settings.skewed``)."""
    skews = settings.skewed(answers)
    if skews:
        return Check(
            "clock", False, f"more than {settings.MAX_CLOCK_SKEW_S:.0f} s from the peers' "
            f"({settings.describe_skew(skews)}); the DHT's records carry wall-clock expirations, so peers drop this "
            "node's records or it theirs", settings.CLOCK_FIX,
        )  # fmt: skip
    known = [a for a in answers.values() if a.skew_s is not None]
    if not known:
        return Check("clock", True, "not compared: no peer sent its clock")
    worst = max(abs(a.skew_s or 0.0) for a in known)
    return Check("clock", True, f"within {worst:.2f} s of {len(known)} peer{'s' if len(known) > 1 else ''}")


def check_reachable(result: Reachability) -> Check:
    """Whether the peers that answered could dial this machine back on its addresses (``net.reachability``)."""
    if result.known and not result.ok:
        return Check("reachable from the swarm", False, result.summary(), reachability.FIX)
    return Check("reachable from the swarm", True, result.summary())


def run_checks(config: Config, say: Callable[[Check], None]) -> bool:
    """Run every check, report each through ``say`` as it finishes; True when all passed."""
    import uvloop

    results = []
    for check in (check_run_dir, check_disk, check_data, check_device, check_ports):
        results.append(check(config))
        say(results[-1])

    async def network() -> None:
        daemon, p2p = await check_daemon(config)
        results.append(daemon)
        say(daemon)
        if p2p is not None:
            try:
                if config.node.announce:
                    results.append(await check_announce(config, p2p))
                    say(results[-1])
            finally:
                await p2p.shutdown()
        if config.node.join:
            for item in await check_swarm(config):
                results.append(item)
                say(item)

    uvloop.run(asyncio.wait_for(network(), 180))
    return all(check.ok for check in results)
