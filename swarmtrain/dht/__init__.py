"""Swarm membership on hivemind's DHT: signed, expiring peer records and a live view of the swarm."""

from swarmtrain.dht.membership import Membership, PeerRecord, record_validators

__all__ = ["Membership", "PeerRecord", "record_validators"]
