"""Swarm membership on hivemind's DHT: signed, expiring peer records and a live view of the swarm."""

from swarmtrain.dht.identity import IdentityError, load_identity_key
from swarmtrain.dht.membership import (
    BanEntry,
    Membership,
    PeerRecord,
    ban_table,
    read_record,
    record_validators,
    swarm_records,
)

__all__ = [
    "BanEntry",
    "IdentityError",
    "Membership",
    "PeerRecord",
    "ban_table",
    "load_identity_key",
    "read_record",
    "record_validators",
    "swarm_records",
]
