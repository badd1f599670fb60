"""A private swarm of real node processes: two members with the swarm key train together; a node with another key
and one without a key each exit 2 with a message that says so, and a hostile process without the key (here, in
the test's own loop) gets no join, no state byte and no record accepted.

    flock /tmp/swarmtrain-heavy.lock python -m pytest -q tests/test_private_swarm_nodes.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator
from hivemind.p2p import P2P

from swarmtrain.averaging import PROTOCOL_VERSION
from swarmtrain.dht import Membership, PeerRecord, load_identity_key, record_validators
from swarmtrain.net import P2PTransport, RemoteError, SwarmAuth
from swarmtrain.net.auth import read_swarm_key

from .swarm import Swarm

pytestmark = pytest.mark.timeout(300)


def keygen(path: Path) -> None:
    subprocess.run([sys.executable, "-m", "swarmtrain", "keygen", "--swarm", str(path)], check=True)


@pytest.mark.slow  # about a minute of real processes; tests/test_private_swarm.py checks the same rules in process
async def test_only_holders_of_the_swarm_key_take_part(swarm: Swarm, tmp_path: Path) -> None:
    key, other = tmp_path / "swarm.key", tmp_path / "other.key"
    keygen(key)
    keygen(other)
    members = [f"node.swarm_key={key}", "node.min_peers=2"]
    swarm.start("a", 4, extra=members)  # waits for b (node.min_peers) while the hostile process tries its luck
    first = swarm.join_line("a")

    # A hostile process that knows a's address and the run id, but not the key: it calls with no key, then with
    # another one, and publishes a record sealed with the other key.
    p2p = await P2P.create(
        initial_peers=[first], identity_path=str(tmp_path / "hostile.key"), host_maddrs=["/ip4/127.0.0.1/tcp/0"]
    )
    dht = None
    try:
        wrong = SwarmAuth(read_swarm_key(other))
        a = first.rsplit("/p2p/", 1)[1]
        header = {"run": "swarmtrain", "v": PROTOCOL_VERSION}
        join = {**header, "round": 0, "weight": 1.0, "numel": 1, "codec": "fp16", "group": "g" * 8}
        for hostile in (P2PTransport(p2p), P2PTransport(p2p, auth=wrong)):
            for method, request in [("join", join), ("state", {**header, "chunk": 1 << 16}), ("ping", header)]:
                with pytest.raises(RemoteError) as refused:
                    await hostile.call(a, method, request, timeout=30)
                assert refused.value.code == "swarm-key", (method, refused.value)
            # Answers of a header each and nothing else: no state byte.
            assert hostile.counter.received < 3 * 1024, hostile.counter.received
        signer = record_validators("swarmtrain", load_identity_key(tmp_path / "hostile.key"))
        dht = await DHTNode.create(p2p=p2p, initial_peers=[first], record_validator=CompositeValidator(signer))
        me = p2p.peer_id.to_base58()
        record = PeerRecord(
            peer_id=me, proto=PROTOCOL_VERSION, run_id="swarmtrain", round=0, phase="training", tokens_per_s=1.0,
            batch_size=1,
        )  # fmt: skip
        assert await Membership(dht, signer[0], record, ttl=60, auth=wrong).publish()
        swarm.wait_until(
            lambda: f"ignoring the record of {me[-8:]}" in (swarm.root / "a" / "node.log").read_text(),
            60,
            "a: the hostile record ignored",
        )
        status = [sys.executable, "-m", "swarmtrain", "status", "--join", first, "--json"]
        shown = subprocess.run([*status, "--set", f"node.swarm_key={key}"], capture_output=True, timeout=120)
        assert shown.returncode == 0, shown.stderr.decode()
        assert [r["peer_id"] for r in json.loads(shown.stdout)] == [a]
    finally:
        if dht is not None:
            await dht.shutdown()
        await p2p.shutdown()

    swarm.start("b", 4, join=first, extra=members)
    swarm.start("wrong", 4, join=first, extra=[f"node.swarm_key={other}"])
    swarm.start("nokey", 4, join=first)
    for name, fix in [("wrong", "copy of the swarm's key file"), ("nokey", "set node.swarm_key")]:
        code = swarm.procs[name].wait(timeout=120)
        assert code == 2, f"{name} exited with {code}:\n{swarm.log(name)}"
        assert "swarm key error" in swarm.log(name) and fix in swarm.log(name), swarm.log(name)

    swarm.wait(["a", "b"], timeout=180)
    ids = {name: swarm.rounds(name)[0]["peer_id"] for name in ("a", "b")}
    for name in ("a", "b"):
        rounds = swarm.rounds(name)
        assert [r["round"] for r in rounds] == [0, 1, 2, 3], rounds
        assert all(set(r["group"]) == set(ids.values()) for r in rounds), rounds
    assert [r["digest"] for r in swarm.rounds("a")] == [r["digest"] for r in swarm.rounds("b")]
    log = (swarm.root / "a" / "node.log").read_text()
    assert f"refused join from {me[-8:]}" in log and f"refused state from {me[-8:]}" in log
