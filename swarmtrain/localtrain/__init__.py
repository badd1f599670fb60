"""Bounded-horizon local training on one machine's CPU cores, with Readout-Gradient Consensus.

``LocalTrainer`` runs one method (global backprop, live local, broadcast or RGC, serial or async) behind the
shape of ``swarmtrain.train.Trainer``; ``run_bench`` compares methods side by side
(``swarmtrain localtrain bench``). Names are imported lazily so that light users (ring children) do not pay
for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarmtrain.localtrain.bench import BenchReport as BenchReport
    from swarmtrain.localtrain.bench import run_bench as run_bench
    from swarmtrain.localtrain.config import METHODS as METHODS
    from swarmtrain.localtrain.config import LocalTrainConfig as LocalTrainConfig
    from swarmtrain.localtrain.errors import LocalTrainError as LocalTrainError
    from swarmtrain.localtrain.errors import StageFailed as StageFailed
    from swarmtrain.localtrain.trainer import LocalTrainer as LocalTrainer

# The names are listed in __all__ through _EXPORTS; the TYPE_CHECKING imports only tell type checkers about them.
_EXPORTS = {
    "BenchReport": "swarmtrain.localtrain.bench",
    "run_bench": "swarmtrain.localtrain.bench",
    "METHODS": "swarmtrain.localtrain.config",
    "LocalTrainConfig": "swarmtrain.localtrain.config",
    "LocalTrainError": "swarmtrain.localtrain.errors",
    "StageFailed": "swarmtrain.localtrain.errors",
    "LocalTrainer": "swarmtrain.localtrain.trainer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
