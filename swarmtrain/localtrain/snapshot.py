"""A seqlock-versioned float32 snapshot in shared memory: one writer (the readout's owner), many readers.

The writer makes the sequence word odd, copies the payload and its version, then makes it even again. A reader
copies the payload between two reads of the sequence word and keeps the copy only if both reads are equal and
even, so it never uses a torn snapshot and never blocks the writer. Versions count the owner's readout updates:
version ``v`` is the readout after ``v`` optimizer steps.
"""

from __future__ import annotations

import numpy as np

from swarmtrain.localtrain.ring import Hook, wait_until
from swarmtrain.localtrain.shm import Segments, attach_segment, close_segment

MAGIC = 0x5357_5453_4E41_5001  # "SWTSNAP" v1
HEADER_BYTES = 128
_MAGIC, _NUMEL = 0, 1
_SEQ, _VERSION = 8, 9  # byte 64: own cache line


def _no_check() -> None:
    return None


class Snapshot:
    """Create with ``Snapshot.create`` (parent) or ``Snapshot.attach`` (child)."""

    def __init__(self, shm, shape: tuple[int, ...]) -> None:
        self.shape = tuple(shape)
        self.numel = int(np.prod(self.shape))
        self._shm = shm
        self._header = np.ndarray((HEADER_BYTES // 8,), dtype=np.int64, buffer=shm.buf, offset=0)
        self._payload = np.ndarray(self.shape, dtype=np.float32, buffer=shm.buf, offset=HEADER_BYTES)
        self.retries = 0
        self.wait_seconds = 0.0

    @property
    def name(self) -> str:
        return self._shm.name

    @classmethod
    def create(cls, segments: Segments, suffix: str, shape: tuple[int, ...]) -> Snapshot:
        numel = int(np.prod(shape))
        snap = cls(segments.create(suffix, HEADER_BYTES + 4 * numel), shape)
        snap._header[:] = 0
        snap._header[_MAGIC], snap._header[_NUMEL] = MAGIC, numel
        snap._header[_VERSION] = -1  # nothing published yet
        return snap

    @classmethod
    def attach(cls, name: str, shape: tuple[int, ...]) -> Snapshot:
        snap = cls(attach_segment(name), shape)
        if snap._header[_MAGIC] != MAGIC or snap._header[_NUMEL] != snap.numel:
            snap.detach()
            raise ValueError(f"shared-memory segment {name} is not a snapshot of shape {shape}")
        return snap

    def publish(self, array: np.ndarray, version: int) -> None:
        """Write a new snapshot (writer side only)."""
        seq = int(self._header[_SEQ])
        self._header[_SEQ] = seq + 1  # odd: writing
        np.copyto(self._payload, array.reshape(self.shape))
        self._header[_VERSION] = version
        self._header[_SEQ] = seq + 2  # even: stable

    @property
    def version(self) -> int:
        """The latest published version (-1 before the first); a plain word read, exact once the writer is done."""
        return int(self._header[_VERSION])

    def read_into(
        self, out: np.ndarray, check: Hook | None = None, timeout: float = 60.0, who: str = "a reader"
    ) -> int:
        """Copy a consistent snapshot into ``out``; return its version (-1 if nothing was published yet).

        A read that overlaps a write is retried; ``check`` and ``timeout`` bound the wait for a writer that died
        in the middle of a write.
        """
        header = self._header
        while True:
            first = int(header[_SEQ])
            if first % 2 == 0:
                np.copyto(out, self._payload)
                version = int(header[_VERSION])
                if int(header[_SEQ]) == first:
                    return version
            self.retries += 1
            self.wait_seconds += wait_until(
                lambda: header[_SEQ] % 2 == 0,
                check or _no_check,
                timeout,
                f"{who}: the readout snapshot's writer (the owner stage) to finish a write",
            )

    def wait_for(self, min_version: int, check: Hook, timeout: float, who: str = "a reader") -> None:
        """Block until a snapshot of at least ``min_version`` is published (this is what bounds staleness)."""
        self.wait_seconds += wait_until(
            lambda: self._header[_VERSION] >= min_version,
            check,
            timeout,
            f"{who}: readout snapshot version {min_version} from the owner stage",
        )

    def detach(self) -> None:
        self._header = self._payload = None  # type: ignore[assignment]
        close_segment(self._shm)
