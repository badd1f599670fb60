"""RPCs between nodes: framed request/response over libp2p streams (or in memory for tests)."""

from swarmtrain.net.auth import PUBLIC, SwarmAuth, SwarmKeyError, load_auth, write_swarm_key
from swarmtrain.net.hello import serve_hello, verify_swarm
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
    "PUBLIC",
    "PeerUnreachable",
    "Rejected",
    "RemoteError",
    "RpcError",
    "RpcTimeout",
    "StreamHandler",
    "SwarmAuth",
    "SwarmKeyError",
    "Transport",
    "load_auth",
    "serve_hello",
    "verify_swarm",
    "write_swarm_key",
]
