"""RPCs between nodes: framed request/response over libp2p streams (or in memory for tests)."""

from swarmtrain.net.memory import MemoryNetwork, MemoryTransport
from swarmtrain.net.rpc import (
    BadMessage,
    ByteCounter,
    P2PTransport,
    PeerUnreachable,
    Rejected,
    RemoteError,
    RpcError,
    RpcTimeout,
    Transport,
)

__all__ = [
    "BadMessage",
    "ByteCounter",
    "MemoryNetwork",
    "MemoryTransport",
    "P2PTransport",
    "PeerUnreachable",
    "Rejected",
    "RemoteError",
    "RpcError",
    "RpcTimeout",
    "Transport",
]
