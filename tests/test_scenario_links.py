"""Link shaping with network namespaces and tbf: the rate a node gets is the rate configured, both directions."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from swarmtrain.scenarios.links import Network

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("tc"), reason="link shaping needs root and tc (iproute2)"
)

SECONDS, WARMUP = 2.0, 0.5  # measure 2 s of a steady stream, after half a second of slow start and bucket burst

# Run inside the node's namespace: send to (or receive from) the host for SECONDS; a receiver prints its rate.
PEER = """
import socket, sys, time
mode, host, port, seconds, warmup = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
s = socket.create_connection((host, port), timeout=30)
chunk = bytes(65536)
if mode == "send":
    end = time.monotonic() + seconds + warmup + 0.5
    try:
        while time.monotonic() < end:
            s.sendall(chunk)
    except OSError:
        pass  # the receiver closed when it had measured
else:
    start = time.monotonic(); got = 0; counted_from = None
    while True:
        data = s.recv(1 << 20)
        if not data:
            break
        now = time.monotonic()
        if counted_from is None and now - start >= warmup:
            counted_from = now
        elif counted_from is not None:
            got += len(data)
        if counted_from is not None and now - counted_from >= seconds:
            print(got * 8 / (now - counted_from) / 1e6); break
s.close()
"""


def _receive(conn: socket.socket, result: list[float]) -> None:
    start, got, counted_from = time.monotonic(), 0, None
    while True:
        data = conn.recv(1 << 20)
        if not data:
            return
        now = time.monotonic()
        if counted_from is None and now - start >= WARMUP:
            counted_from = now
        elif counted_from is not None:
            got += len(data)
        if counted_from is not None and now - counted_from >= SECONDS:
            result.append(got * 8 / (now - counted_from) / 1e6)
            return


def _send(conn: socket.socket, stop: threading.Event) -> None:
    chunk = bytes(65536)
    try:
        while not stop.is_set():
            conn.sendall(chunk)
    except OSError:
        pass  # the receiver closed when it had measured


def _measure(net: Network, name: str, direction: str) -> float:
    """Mbit/s the node sends (``up``) or receives (``down``), measured by the receiving side."""
    server = socket.create_server((net.host_address, 0))
    port = server.getsockname()[1]
    mode = "send" if direction == "up" else "receive"
    args = [
        *net.prefix(name),
        sys.executable,
        "-c",
        PEER,
        mode,
        net.host_address,
        str(port),
        str(SECONDS),
        str(WARMUP),
    ]
    peer = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    try:
        server.settimeout(30)
        conn, _ = server.accept()
        conn.settimeout(30)
        if direction == "up":
            result: list[float] = []
            _receive(conn, result)
            conn.close()
            peer.wait(timeout=30)
            return result[0]
        stop = threading.Event()
        sender = threading.Thread(target=_send, args=(conn, stop), daemon=True)
        sender.start()
        out, _ = peer.communicate(timeout=30)
        stop.set()
        conn.close()
        return float(out.strip())
    finally:
        server.close()
        if peer.poll() is None:
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
