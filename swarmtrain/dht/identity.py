"""Peer records bound to libp2p identities: a record is signed with the key of the peer id it describes.

The node's libp2p identity file (``node.identity``, a protobuf-wrapped RSA key as ``P2P.generate_identity``
writes it) is also the key its DHT record is signed with. The record's subkey carries the public key
(hivemind's ``[owner:...]`` marker, which makes every DHT peer check the signature), and a reader derives the
peer id from that public key the way libp2p does and drops a record that claims any other peer id. So a
process can publish a record only for its own peer id, the id that libp2p authenticates on its streams.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from swarmtrain.errors import SwarmtrainError

_OWNER_PREFIX, _OWNER_SUFFIX = RSASignatureValidator.PUBLIC_KEY_FORMAT.split(b"_key_")


class IdentityError(SwarmtrainError):
    """The identity file cannot be used to sign this node's records."""


def load_identity_key(path: str | Path) -> RSAPrivateKey:
    """The RSA key of a libp2p identity file, to sign this node's DHT records with."""
    try:
        wrapped = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes())
        if wrapped.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError(f"key type {wrapped.key_type} is not RSA")
        key = serialization.load_der_private_key(wrapped.data, password=None)
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ValueError("not an RSA key")
    except (OSError, ValueError, TypeError) as exc:
        raise IdentityError(
            f"identity error: cannot use {path} (node.identity) to sign this node's records: {exc}. Use a key "
            "written by `swarmtrain keygen PATH`, or leave node.identity unset to have one made."
        ) from None
    signer = RSAPrivateKey.__new__(RSAPrivateKey)
    signer.__setstate__({"_private_key": wrapped.data})  # hivemind's own (pickle) way to rebuild a key from DER
    return signer


def peer_id_of(public_key: bytes) -> str:
    """The libp2p peer id (base58) of an RSA public key in OpenSSH form, as hivemind writes it in subkeys."""
    key = serialization.load_ssh_public_key(public_key)
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("not an RSA public key")
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    wrapped = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(wrapped).digest(), multihash.coerce_code("sha2-256"))).to_base58()


def record_subkey(peer_id: str, signer: RSASignatureValidator) -> bytes:
    """The subkey a node stores its record under: its peer id, then its public key in hivemind's owner marker."""
    return peer_id.encode() + signer.local_public_key


def owner_of(subkey: bytes, claimed: str) -> bool:
    """Whether ``subkey`` is ``claimed``'s own: the claimed peer id followed by the public key it derives from."""
    head = claimed.encode()
    if not subkey.startswith(head + _OWNER_PREFIX) or not subkey.endswith(_OWNER_SUFFIX):
        return False
    try:
        return peer_id_of(subkey[len(head) + len(_OWNER_PREFIX) : -len(_OWNER_SUFFIX)]) == claimed
    except (ValueError, TypeError, IndexError):
        return False
