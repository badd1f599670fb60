"""Link shaping with network namespaces and tbf: the rate a node gets is the rate configured, both directions."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from swarmtrain.scenarios.links import OWNERS, Network

from .swarm import NEEDS_ROOT_AND_TC

pytestmark = NEEDS_ROOT_AND_TC

SECONDS, WARMUP = 2.0, 0.5  # count 2 s of a saturated link, after half a second of slow start and bucket burst
BUFFER = 4 << 20  # socket buffers of 4 MiB: a sender or receiver descheduled for a second (a loaded machine) does
# not let the link idle, so what is measured is the link, not the CPU time the test's processes got

# Run inside the node's namespace: send to (or receive from) the host until the other side closes.
PEER = """
import socket, sys
mode, host, port, buffer = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF if mode == "send" else socket.SO_RCVBUF, buffer)
s.settimeout(30)
s.connect((host, port))
chunk = bytes(65536)
try:
    while (s.sendall(chunk) if mode == "send" else s.recv(1 << 20)) != b"":
        pass
except OSError:
    pass  # the host closed when it had measured
s.close()
"""


def _pump(conn: socket.socket, direction: str, stop: threading.Event) -> None:
    """Keep the link busy from the host's side: drain what the node sends (up), or send to it (down)."""
    chunk = bytes(65536)
    try:
        while not stop.is_set():
            if direction == "down":
                conn.sendall(chunk)
            elif not conn.recv(1 << 20):
                return
    except OSError:
        pass


def _sent_bytes(net: Network, name: str, direction: str) -> tuple[float, int]:
    """When, and how many bytes the shaping qdisc of the node's uplink (or downlink) has sent so far."""
    link = net.links[name]
    prefix = net.prefix(name) if direction == "up" else []
    dev = link.node_dev if direction == "up" else link.host_dev
    before = time.monotonic()
    out = subprocess.run([*prefix, "tc", "-s", "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
    when = (before + time.monotonic()) / 2
    match = re.search(r"Sent (\d+) bytes", out)
    assert match, f"no tbf statistics on {dev}: {out}"
    return when, int(match.group(1))


def _measure(net: Network, name: str, direction: str) -> float:
    """Mbit/s the node sends (``up``) or receives (``down``) through a saturated link: the bytes its shaping qdisc
    sent over SECONDS, read from the kernel's counters."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF if direction == "up" else socket.SO_SNDBUF, BUFFER)
    server.bind((net.host_address, 0))
    server.listen()
    port = server.getsockname()[1]
    mode = "send" if direction == "up" else "receive"
    args = [*net.prefix(name), sys.executable, "-c", PEER, mode, net.host_address, str(port), str(BUFFER)]
    peer = subprocess.Popen(args)
    stop = threading.Event()
    try:
        server.settimeout(30)
        conn, _ = server.accept()
        pump = threading.Thread(target=_pump, args=(conn, direction, stop), daemon=True)
        pump.start()
        time.sleep(WARMUP)
        t0, sent0 = _sent_bytes(net, name, direction)
        time.sleep(SECONDS)
        t1, sent1 = _sent_bytes(net, name, direction)
        stop.set()
        conn.close()
        pump.join(timeout=10)
        return (sent1 - sent0) * 8 / (t1 - t0) / 1e6
    finally:
        server.close()
        peer.kill()
        peer.wait()


def test_a_node_sends_and_receives_at_the_configured_rates_within_ten_percent() -> None:
    net = Network()
    try:
        net.add("node0", up_mbit=20, down_mbit=8)
        up, down = _measure(net, "node0", "up"), _measure(net, "node0", "down")
        assert abs(up / 20 - 1) < 0.10, f"uplink measured {up:.2f} Mbit/s, configured 20"
        assert abs(down / 8 - 1) < 0.10, f"downlink measured {down:.2f} Mbit/s, configured 8"
        net.shape("node0", up_mbit=5, down_mbit=None)  # a link event: new rates while the node runs
        up = _measure(net, "node0", "up")
        assert abs(up / 5 - 1) < 0.10, f"uplink measured {up:.2f} Mbit/s after the change, configured 5"
    finally:
        net.close()
    leftover = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"st{net.id}" not in leftover
    assert f"st{net.id}" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _reaches(net: Network, name: str, host: str, port: int) -> bool:
    probe = f"import socket; socket.create_connection(({host!r}, {port}), timeout=1).close()"
    return subprocess.run([*net.prefix(name), sys.executable, "-c", probe], capture_output=True).returncode == 0


def test_a_partition_cuts_nodes_off_from_the_rest_but_not_from_each_other_until_healed() -> None:
    net = Network()
    try:
        for name in ("node0", "node1", "node2"):
            net.add(name, up_mbit=None, down_mbit=None)
        host = socket.create_server((net.host_address, 0))
        port = host.getsockname()[1]
        listen = (
            f"import socket, time; s = socket.create_server(({net.links['node1'].address!r}, 7000)); time.sleep(30)"
        )
        listener = [*net.prefix("node1"), sys.executable, "-c", listen]
        server = subprocess.Popen(listener)
        try:
            assert _reaches(net, "node0", net.host_address, port) and _reaches(net, "node2", net.host_address, port)
            deadline = time.monotonic() + 10
            while not _reaches(net, "node2", net.links["node1"].address, 7000):
                assert time.monotonic() < deadline, "node1's listener did not come up"
            net.partition(["node1", "node2"], cut=True)
            assert not _reaches(net, "node2", net.host_address, port)  # cut off from the rest
            assert _reaches(net, "node2", net.links["node1"].address, 7000)  # but not from each other
            net.partition(["node1", "node2"], cut=False)
            assert _reaches(net, "node2", net.host_address, port)
        finally:
            server.kill()
            server.wait()
            host.close()
    finally:
        net.close()


# Run on either side of the link: send numbered datagrams, or count the distinct ones received (until 2 s quiet).
DATAGRAMS = """
import socket, sys, time
mode, host, port, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
if mode == "send":
    for i in range(count):
        s.sendto(i.to_bytes(4, "big"), (host, port))
        time.sleep(0.0002)  # paced: no socket buffer overflows, only the link's drops
else:
    s.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE (root): a receiver descheduled a while drops none
    s.bind((host, port))
    s.settimeout(2.0)
    print("ready", flush=True)
    seen = set()
    try:
        while True:
            seen.add(s.recv(16))
    except OSError:
        pass
    print(len(seen), flush=True)
"""


def _delivered(net: Network, name: str, direction: str, count: int) -> float:
    """The share of ``count`` datagrams that crossed the node's link up (it sends) or down (it receives)."""
    inside, outside = net.prefix(name), []
    sends, receives = (inside, outside) if direction == "up" else (outside, inside)
    to = net.host_address if direction == "up" else net.links[name].address
    script = [sys.executable, "-c", DATAGRAMS]
    receiver = subprocess.Popen([*receives, *script, "receive", to, "7001", "0"], stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout is not None and receiver.stdout.readline().strip() == "ready"
        subprocess.run([*sends, *script, "send", to, "7001", str(count)], check=True, timeout=60)
        return int(receiver.stdout.readline()) / count
    finally:
        receiver.kill()
        receiver.wait()


def test_a_lossy_link_drops_the_configured_share_of_packets_each_way() -> None:
    """up_loss and down_loss: the kernel drops that share of the node's packets (an eBPF classifier: no netem
    here), each way; a link event back to 0 removes the drop. 4000 datagrams: the share is within 3 points (about
    five standard deviations)."""
    net = Network()
    try:
        net.add("node0", up_mbit=None, down_mbit=None)
        for direction in ("up", "down"):  # no loss yet; also settles ARP both ways before anything is dropped
            assert _delivered(net, "node0", direction, 50) == 1.0, direction
        net.shape("node0", up_mbit=None, down_mbit=None, up_loss=0.2, down_loss=0.05)
        up, down = _delivered(net, "node0", "up", 4000), _delivered(net, "node0", "down", 4000)
        assert abs(up - 0.8) < 0.03 and abs(down - 0.95) < 0.03, (up, down)
        net.shape("node0", up_mbit=None, down_mbit=None)
        assert _delivered(net, "node0", "up", 1000) == 1.0
    finally:
        net.close()
    assert not [p for p in Path(tempfile.gettempdir()).glob("swarmtrain-bpf-*")]  # each pin's mount is gone


# A runner in miniature: one network with one node's namespace; it closes it once its stdin closes.
RUNNER = """
import sys
from swarmtrain.scenarios.links import OWNERS, Network
net = Network()
net.add("node0", up_mbit=10, down_mbit=10)
print(net.id, flush=True)
sys.stdin.read()
net.close()
"""


def _ours(id_: str) -> list[str]:
    """The namespaces and links of network ``id_`` still on this machine."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.splitlines()
    names += [line.split(": ")[1].split("@")[0] for line in links if ": " in line]
    return sorted(name for name in names if name.startswith(f"st{id_}"))


def test_a_network_whose_runner_was_killed_is_deleted_by_the_next_network_and_a_live_runners_is_kept() -> None:
    """A runner killed by SIGKILL cannot close its network: the next Network made on the machine deletes its
    namespaces, veths and bridges, and leaves those of a runner still running."""
    runners = [
        subprocess.Popen([sys.executable, "-c", RUNNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        killed, live = (r.stdout.readline().strip() for r in runners)  # type: ignore[union-attr]
        made = ["br", "cut", "h2", "n2"]  # its bridges, the host end of node0's veth, node0's namespace
        assert _ours(killed) == [f"st{killed}{name}" for name in made], _ours(killed)
        runners[0].kill()
        runners[0].wait(timeout=30)
        net = Network()
        net.close()
        assert _ours(killed) == [] and not (OWNERS / killed).exists()
        assert _ours(live) == [f"st{live}{name}" for name in made] and (OWNERS / live).exists()
    finally:
        for runner in runners:
            runner.communicate(timeout=30)  # the live one closes its network as its stdin closes
    assert _ours(live) == [] and not (OWNERS / live).exists()
