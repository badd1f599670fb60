"""Which torch device the standard trainer computes on (``train.device``), and the check that it is present.

``auto`` takes the best device present: CUDA, then Apple's MPS, else the CPU. A device asked for by name that
this machine lacks is a ``ConfigError`` naming what is present. Everything the swarm agrees on (theta_g, the outer
step, the codecs, the digest) stays on the CPU in fp32 whatever this says: only the inner steps run here.
"""

from __future__ import annotations

import torch

from swarmtrain.errors import ConfigError


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def present_devices() -> list[str]:
    """The devices this machine can compute on, best first: ``cuda:0`` .. ``cuda:N-1``, ``mps``, ``cpu``."""
    found = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    if _mps_available():
        found.append("mps")
    return [*found, "cpu"]


def resolve_device(name: str) -> torch.device:
    """The ``torch.device`` for a ``train.device`` value; raises ``ConfigError`` if it is not on this machine."""
    present = present_devices()
    if name == "auto":
        return torch.device(present[0])
    wanted = "cuda:0" if name == "cuda" else name
    if wanted not in present:
        raise ConfigError(
            f"config error: train.device = {name!r}, but this machine has no such device (present: "
            f"{', '.join(present)}). Set train.device to one of those, or to auto to take the best present."
        )
    return torch.device(wanted)
