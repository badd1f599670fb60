"""The "hello" handshake: a node checks, before it takes part, that the peers it joins through are of its swarm.

A key mismatch is otherwise silent (each side just drops the other's records and calls), so a node started with
the wrong ``node.swarm_key`` would train alone; with this check it exits with a message that names the fix.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from swarmtrain.net.auth import AUTH_FIELD, KEY_MISMATCH, NOT_ALLOWED, SwarmKeyError
from swarmtrain.net.rpc import RemoteError, RpcError, Transport

log = logging.getLogger(__name__)

HELLO_TIMEOUT = 10.0


async def serve_hello(transport: Transport) -> None:
    """Answer "hello": a caller that passed the key check gets back this node's own proof of the key."""

    async def on_hello(sender: str, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        return {"private": transport.auth.private, **transport.auth.stamp(transport.peer_id, sender, "hello")}, b""

    await transport.serve("hello", on_hello, max_body=0)


async def verify_swarm(transport: Transport, peers: Iterable[str]) -> int:
    """Check that ``peers`` (the peer ids this node joins through) belong to the same swarm as this node: the
    same key, the same public/private kind. Returns how many answered; raises ``SwarmKeyError`` on a mismatch."""
    auth, answered = transport.auth, 0
    for peer in peers:
        if auth.allow is not None and peer not in auth.allow:
            raise SwarmKeyError(
                f"swarm key error: node.join names peer {peer}, which is not on node.allow_peers; add it there or "
                "join through a peer of the swarm."
            )
        try:
            answer, _ = await transport.call(peer, "hello", {}, timeout=HELLO_TIMEOUT)
        except RemoteError as exc:
            if exc.code == KEY_MISMATCH:
                fix = (
                    "set node.swarm_key to the swarm's key file"
                    if auth.key is None
                    else "check that node.swarm_key is a copy of the swarm's key file (a key made by another "
                    "`swarmtrain keygen --swarm` run is a different swarm)"
                )
                raise SwarmKeyError(
                    f"swarm key error: peer {peer} refused this node's swarm key ({exc}); {fix}."
                ) from None
            if exc.code == NOT_ALLOWED:
                raise SwarmKeyError(
                    f"swarm key error: peer {peer} does not allow this node ({exc}); ask the swarm to add "
                    f"{transport.peer_id} to node.allow_peers."
                ) from None
            log.warning("could not check the swarm key with %s: %s", peer[-8:], exc)
            continue
        except RpcError as exc:
            log.warning("could not check the swarm key with %s: %s", peer[-8:], exc)
            continue
        answered += 1
        proof = answer.get(AUTH_FIELD)
        if auth.key is not None and not (
            isinstance(proof, str) and proof == auth.stamp(peer, transport.peer_id, "hello")[AUTH_FIELD]
        ):
            raise SwarmKeyError(
                f"swarm key error: peer {peer} does not hold this node's swarm key "
                f"({'it runs a public swarm' if not answer.get('private') else 'its answer proves another key'}); "
                "check node.join and node.swarm_key."
            )
    return answered
