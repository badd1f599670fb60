"""RPCs between nodes: framed request/response over libp2p streams (or in memory for tests)."""

from swarmtrain.net.memory import MemoryNetwork, MemoryTransport
from swarmtrain.net.rpc import (
    BadMessage,
    ByteCounter,
    Handler,
    P2PTransport,
    PeerUnreachable,
    Rejected,
    RemoteError,
    RpcError,
    RpcTimeout,
    StreamHandler,
    Transport,
)

__all__ = [
    "BadMessage",
    "ByteCounter",
    "Handler",
    "MemoryNetwork",
    "MemoryTransport",
    "P2PTransport",
    "PeerUnreachable",
    "Rejected",
    "RemoteError",
    "RpcError",
    "RpcTimeout",
    "StreamHandler",
    "Transport",
]
