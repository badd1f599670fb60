"""swarmtrain: a peer-to-peer training node for ordinary machines.

The public faces live in the subpackages: ``swarmtrain.model``, ``swarmtrain.data``, ``swarmtrain.train``.
"""

from swarmtrain.errors import SwarmtrainError

__version__ = "0.1.0"
__all__ = ["SwarmtrainError", "__version__"]
