"""Private swarms: a shared swarm key and an allowlist of peer ids, checked on every RPC and every DHT record.

The bundled p2pd has no pre-shared-key (pnet) option, so the key is enforced by the application. libp2p already
authenticates the peer id at the other end of every stream (Noise/TLS), so a MAC keyed by the swarm key over
(sender, receiver, method) in a call's header proves that the sender holds the key: a process without it cannot
make one, and a MAC seen by one receiver is worthless to anyone else. DHT records carry a MAC over their subkey
(the owner's peer id and public key) and their content; readers drop records without a valid one.

A refused call answers with code ``swarm-key`` (no or another key) or ``not-allowed`` (not on the allowlist),
so the caller can tell a key mismatch from other refusals; ``verify_swarm`` turns that into a clear exit.

    swarmtrain keygen --swarm swarm.key      # once; copy the file to every machine of the swarm
    swarmtrain node --set node.swarm_key=swarm.key ...
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from swarmtrain.errors import SwarmtrainError

KEY_TAG = "swarmtrain-swarm-key-v1"
AUTH_FIELD = "auth"  # the RPC header field that carries the MAC
KEY_MISMATCH = "swarm-key"  # the code of a call refused for want of the right key
NOT_ALLOWED = "not-allowed"  # the code of a call refused by the allowlist


class SwarmKeyError(SwarmtrainError):
    """The swarm key file is unreadable or malformed, or this node's key is not the swarm's."""


class Refused(SwarmtrainError):
    """A call refused by the swarm's key or allowlist; ``code`` is ``swarm-key`` or ``not-allowed``."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def write_swarm_key(path: str | Path) -> None:
    """Write a new random 256-bit swarm key to ``path`` (readable by its owner only); never overwrites."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(f"{KEY_TAG} {secrets.token_hex(32)}\n")


def read_swarm_key(path: str | Path) -> bytes:
    try:
        text = Path(path).read_text(encoding="ascii", errors="replace").strip()
    except OSError as exc:
        raise SwarmKeyError(
            f"swarm key error: cannot read node.swarm_key file {path}: {exc.strerror}. Copy the swarm's key file "
            "to this machine (`swarmtrain keygen --swarm PATH` writes a new one for a new swarm)."
        ) from None
    tag, _, hex_key = text.partition(" ")
    try:
        key = bytes.fromhex(hex_key)
    except ValueError:
        key = b""
    if tag != KEY_TAG or len(key) != 32:
        raise SwarmKeyError(
            f"swarm key error: {path} (node.swarm_key) is not a swarm key file; it should hold one line "
            f"'{KEY_TAG} <64 hex digits>' as written by `swarmtrain keygen --swarm PATH`."
        )
    return key


def _mac(key: bytes, *parts: bytes) -> str:
    return hmac.new(key, b"\x00".join((KEY_TAG.encode(), *parts)), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class SwarmAuth:
    """Who may talk to this node: holders of ``key`` (if set) among ``allow`` (if set). Both unset: a public
    swarm, where anyone may."""

    key: bytes | None = None
    allow: frozenset[str] | None = None

    @property
    def private(self) -> bool:
        return self.key is not None or self.allow is not None

    def stamp(self, sender: str, receiver: str, method: str) -> dict[str, Any]:
        """The header field that proves to ``receiver`` that ``sender`` holds the key (nothing in a public swarm)."""
        if self.key is None:
            return {}
        return {AUTH_FIELD: _mac(self.key, b"rpc", sender.encode(), receiver.encode(), method.encode())}

    def check(self, sender: str, receiver: str, method: str, header: dict[str, Any]) -> None:
        """Admit a call or raise ``Refused``; removes the proof from ``header`` either way."""
        proof = header.pop(AUTH_FIELD, None)
        if self.allow is not None and sender not in self.allow and sender != receiver:
            raise Refused(
                f"peer {sender[-8:]} is not on this private swarm's allowlist (node.allow_peers)", NOT_ALLOWED
            )
        if self.key is None:
            return
        if proof is None:
            raise Refused("this swarm is private: the call carried no proof of the swarm key", KEY_MISMATCH)
        if not isinstance(proof, str) or not hmac.compare_digest(
            proof, self.stamp(sender, receiver, method)[AUTH_FIELD]
        ):
            raise Refused("the call was made with another swarm key than this node's", KEY_MISMATCH)

    def seal(self, subkey: bytes, value: dict[str, Any]) -> str:
        """The MAC a DHT record of this swarm carries ("" in a public swarm)."""
        if self.key is None:
            return ""
        content = msgpack.packb(sorted(value.items()), use_bin_type=True)
        return _mac(self.key, b"record", subkey, content)

    def admits_record(self, subkey: bytes, peer_id: str, value: dict[str, Any], mac: Any) -> bool:
        if self.allow is not None and peer_id not in self.allow:
            return False
        if self.key is None:
            return True
        return isinstance(mac, str) and hmac.compare_digest(mac, self.seal(subkey, value))


PUBLIC = SwarmAuth()


def load_auth(swarm_key: str | None, allow_peers: Iterable[str] = ()) -> SwarmAuth:
    """The ``SwarmAuth`` of ``node.swarm_key`` and ``node.allow_peers`` (a public swarm when both are unset)."""
    allow = frozenset(allow_peers)
    return SwarmAuth(read_swarm_key(swarm_key) if swarm_key else None, allow or None)
