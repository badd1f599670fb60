"""Signed reports and digests: a member that tells the members of its group different things is caught.

A node signs every report and digest it sends in a round with its libp2p identity key (the key its DHT record is
signed with, ``dht.identity``), over the round's route, the message kind and the value; the message carries the
signature and the public key, which a receiver checks against the member's peer id (peer ids are hashes of these
keys). Relays carry values only. A member asks a relayer for the signature of each relayed value that differs
from what it holds, or that it holds nothing for (``exchange._merge``), so an honest round costs one signature
per message (about 750 bytes), not one per member per relay; and a relayer cannot put words in another member's
mouth: one that cannot prove what it relayed is banned, and the value does not count.

Two different values for one member, both signed by it, prove that it equivocated (told some members one thing
and others another). Every honest survivor sees both: each relays the value it received directly, so the
survivors hold the same relays, ask for and get the same proofs, leave the member's value out of their views
and ban it. Unsigned, the survivors each kept the first value they held, and the member split the group's
decision.

A digest is signed twice: over the round's route, as above, and with the round's number alone ("held"): the second
is a member's statement that it held that state at the end of that round, which another member can show as the
certificate of the same state in a later round (``check_held``, ``matchmaking``): a state that another key
signed for. That keeps out a state its member alone vouches for, but keys are free, so a member can certify a
made-up state with a second key of its own; a public swarm therefore also mixes states with its robust aggregator
(``Averager.state_aggregator``), which such a state does not move where most of a group holds one state.

What it does not cover: peers that collude (one equivocates, another relays selectively or withholds proofs
from some members), and a value that reached only a hostile member before the honest sender died (two faults).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import msgpack
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from swarmtrain.dht.identity import peer_id_of

MAX_KEY_BYTES = 1024  # an OpenSSH RSA public key of up to 4096 bits is under 800 bytes
MAX_SIG_BYTES = 1024  # an RSA signature of up to 4096 bits, base64
_CHECKED = 4096  # signatures a node remembers having checked (a relay repeats what arrived directly)


def message(route: str, kind: str, value: Any) -> bytes:
    """The bytes a member signs: the round's route (its group id, so a signature is not replayed in another
    round), the kind ("report", "digest") and the value."""
    return msgpack.packb([route, kind, value], use_bin_type=True)


MAX_HELD_AGE = 2  # a certificate of the round before last still counts (a round of one in between keeps the state)


def held_message(round_: int, digest: str) -> bytes:
    """The bytes a member signs to say it held the state of ``digest`` at the end of round ``round_``."""
    return msgpack.packb(["held", round_, digest], use_bin_type=True)


class RoundSigner:
    """Signs this member's values and checks the other members' signatures."""

    def __init__(self, key: RSAPrivateKey) -> None:
        self.key = key
        self.public = key.get_public_key().to_bytes()
        self._keys: dict[bytes, str] = {}  # public keys checked, and the peer id each derives to
        self._checked: OrderedDict[bytes, bool] = OrderedDict()

    def sign(self, route: str, kind: str, value: Any) -> dict[str, bytes]:
        return {"sig": self.key.sign(message(route, kind, value)), "key": self.public}

    def sign_held(self, round_: int, digest: str) -> bytes:
        return self.key.sign(held_message(round_, digest))

    def check_held(self, holder: str, digest: str, round_: int, cert: Any) -> str | None:
        """Why ``cert`` does not certify that ``holder``'s state ``digest`` is one another peer held at the end of
        a round shortly before ``round_`` (None: it does). A certificate is {"round", "key", "sig"}: a signature by
        any peer but the holder itself (``held_message``), of round ``round_`` - 1 or - 2."""
        if not isinstance(cert, dict):
            return "no certificate"
        held_round, key, sig = cert.get("round"), cert.get("key"), cert.get("sig")
        if isinstance(held_round, bool) or not isinstance(held_round, int):
            return "a certificate without a round"
        if not 1 <= round_ - held_round <= MAX_HELD_AGE:
            return f"a certificate of round {held_round}, not of the last {MAX_HELD_AGE} before round {round_}"
        if not isinstance(sig, bytes) or not isinstance(key, bytes) or len(sig) > MAX_SIG_BYTES:
            return "a malformed certificate"
        if len(key) > MAX_KEY_BYTES or self._owner(key) in (None, holder):
            return "a certificate signed by its own holder or by no peer"
        if not self._verify(key, held_message(held_round, digest), sig):
            return "a certificate whose signature does not hold"
        return None

    def check(self, peer: str, route: str, kind: str, value: Any, proof: Any) -> bool:
        """Whether ``proof`` is ``peer``'s signature of ``value`` in this round."""
        if not isinstance(proof, dict):
            return False
        sig, key = proof.get("sig"), proof.get("key")
        if not isinstance(sig, bytes) or not isinstance(key, bytes):
            return False
        if len(sig) > MAX_SIG_BYTES or len(key) > MAX_KEY_BYTES or self._owner(key) != peer:
            return False
        return self._verify(key, message(route, kind, value), sig)

    def _verify(self, key: bytes, data: bytes, sig: bytes) -> bool:
        seen = hashlib.blake2b(data + sig + key, digest_size=16).digest()
        if seen in self._checked:
            return self._checked[seen]
        try:
            valid = RSAPublicKey.from_bytes(key).verify(data, sig)
        except (ValueError, TypeError):
            valid = False
        self._checked[seen] = valid
        while len(self._checked) > _CHECKED:
            self._checked.popitem(last=False)
        return valid

    def _owner(self, key: bytes) -> str | None:
        if key not in self._keys:
            try:
                owner = peer_id_of(key)
            except (ValueError, TypeError):
                return None
            if len(self._keys) >= _CHECKED:
                self._keys.clear()
            self._keys[key] = owner
        return self._keys[key]
