"""The outer step: group formation, butterfly all-reduce, outer optimizer, signed digest confirmation, state sync."""

from swarmtrain.averaging.allreduce import AllReduce
from swarmtrain.averaging.averager import PROTOCOL_VERSION, Averager, RoundOutcome
from swarmtrain.averaging.exchange import AllReduceResult
from swarmtrain.averaging.group import Group, gossip_groups, leader_candidates
from swarmtrain.averaging.outer import OuterOptimizer, outer_digest, state_digest
from swarmtrain.averaging.round import Event, Lifecycle, Phase
from swarmtrain.averaging.signing import RoundSigner

__all__ = [
    "PROTOCOL_VERSION",
    "AllReduce",
    "AllReduceResult",
    "Averager",
    "Event",
    "Group",
    "Lifecycle",
    "OuterOptimizer",
    "Phase",
    "RoundOutcome",
    "RoundSigner",
    "gossip_groups",
    "leader_candidates",
    "outer_digest",
    "state_digest",
]
