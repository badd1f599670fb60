"""The composition root: one swarm node (P2P, DHT, membership, averaging, training) and its lifecycle."""

from swarmtrain.node.node import Node, NodeError

__all__ = ["Node", "NodeError"]
