"""Fixed-slot single-producer/single-consumer rings of float32 arrays in shared memory.

A ring is one segment: a header with two sequence counters (``write_seq`` owned by the producer, ``read_seq``
owned by the consumer, each on its own cache line) and ``depth`` slots of ``slot_bytes``. The producer fills
slot ``write_seq % depth`` and then bumps ``write_seq`` (publish); the consumer copies slot ``read_seq % depth``
out and then bumps ``read_seq`` (release). A full ring blocks the producer (back-pressure, never an unbounded
queue); an empty ring blocks the consumer. Nothing is pickled: an item is a step number, a version tag, a
shape, and raw float32 bytes.

Every wait polls with a short backoff and checks, every few milliseconds, that the other side is alive (its pid
is in the header) and has not closed the ring, plus an optional hook (the run's abort flag). A consumer still
gets every item published before the producer closed or died; after that it gets ``ChannelClosed`` or
``PeerLost``. Counters are 8-byte aligned words written by one side only; on x86 (TSO) the payload stores are
visible before the counter store that publishes them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from swarmtrain.localtrain.errors import ChannelClosed, PeerLost, WaitTimeout
from swarmtrain.localtrain.shm import Segments, attach_segment, close_segment, pid_alive

MAGIC = 0x5357_5452_494E_4701  # "SWTRING" v1
HEADER_BYTES = 256
SLOT_HEADER_BYTES = 64
MAX_DIMS = 3
CHECK_INTERVAL = 0.005
PEER_EXIT_GRACE_S = 2.0  # how long a dead peer's process may take to become reapable (see ``_check_peer``)
MIN_PAUSE, MAX_PAUSE = 20e-6, 500e-6

# header words (int64)
_MAGIC, _DEPTH, _SLOT_BYTES, _PRODUCER_PID, _CONSUMER_PID, _PRODUCER_CLOSED, _CONSUMER_CLOSED = range(7)
_WRITE_SEQ = 8  # byte 64: its own cache line
_READ_SEQ = 16  # byte 128
# slot header words (int64)
_S_SEQ, _S_STEP, _S_VERSION, _S_NDIM, _S_SHAPE = 0, 1, 2, 3, 4

Hook = Callable[[], None]


def _round64(n: int) -> int:
    return (n + 63) // 64 * 64


def wait_until(
    ready: Callable[[], bool], check: Hook, timeout: float, what: str | Callable[[], str] = "the condition"
) -> float:
    """Poll ``ready`` with backoff until it holds; ``check`` (which raises to give up) runs every few ms.

    Returns the seconds spent waiting (0.0 when ``ready`` already held). On timeout ``WaitTimeout`` says what
    was awaited (``what``, or ``what()`` evaluated then, so it can name the stages still missing).
    """
    if ready():
        return 0.0
    start = time.perf_counter()
    deadline = start + timeout
    next_check = start
    pause = MIN_PAUSE
    while True:
        now = time.perf_counter()
        if now >= next_check:
            check()
            if now >= deadline:
                awaited = what() if callable(what) else what
                raise WaitTimeout(f"waited {timeout:.1f} s for {awaited} without progress")
            next_check = now + CHECK_INTERVAL
        time.sleep(pause)
        pause = min(pause * 2, MAX_PAUSE)
        if ready():
            return time.perf_counter() - start


@dataclass(frozen=True)
class RingSpec:
    """What a process needs to attach to a ring (picklable; sent once at start-up)."""

    name: str
    depth: int
    slot_bytes: int

    @property
    def size(self) -> int:
        return HEADER_BYTES + self.depth * (SLOT_HEADER_BYTES + _round64(self.slot_bytes))


@dataclass(frozen=True)
class RingItem:
    step: int
    version: int
    data: np.ndarray


class Ring:
    """One side's handle on a ring. Create with ``Ring.create`` (parent) or ``Ring.attach`` (child), then ``bind``."""

    def __init__(self, shm, spec: RingSpec, owner: bool) -> None:
        self.spec = spec
        self._shm = shm
        self._owner = owner
        self.role: str | None = None
        self.label = f"pid {os.getpid()}"  # who waits, in timeout messages (``bind`` names the stage)
        self._hook: Hook | None = None
        self._header = np.ndarray((HEADER_BYTES // 8,), dtype=np.int64, buffer=shm.buf, offset=0)
        stride = SLOT_HEADER_BYTES + _round64(spec.slot_bytes)
        self._slot_headers = []
        self._payloads = []
        for i in range(spec.depth):
            base = HEADER_BYTES + i * stride
            self._slot_headers.append(np.ndarray((8,), dtype=np.int64, buffer=shm.buf, offset=base))
            self._payloads.append(
                np.ndarray((spec.slot_bytes // 4,), dtype=np.float32, buffer=shm.buf, offset=base + SLOT_HEADER_BYTES)
            )
        self.wait_seconds = 0.0
        self.copy_seconds = 0.0

    @classmethod
    def create(cls, segments: Segments, suffix: str, depth: int, slot_bytes: int) -> Ring:
        if depth < 1:
            raise ValueError("ring depth must be >= 1")
        slot_bytes = _round64(max(slot_bytes, 4))
        shm = segments.create(suffix, RingSpec("", depth, slot_bytes).size)
        spec = RingSpec(shm.name, depth, slot_bytes)
        ring = cls(shm, spec, owner=True)
        ring._header[:] = 0
        ring._header[_MAGIC], ring._header[_DEPTH], ring._header[_SLOT_BYTES] = MAGIC, depth, slot_bytes
        return ring

    @classmethod
    def attach(cls, spec: RingSpec) -> Ring:
        ring = cls(attach_segment(spec.name), spec, owner=False)
        if ring._header[_MAGIC] != MAGIC or ring._header[_DEPTH] != spec.depth:
            ring.detach()
            raise ValueError(f"shared-memory segment {spec.name} is not a ring of depth {spec.depth}")
        return ring

    def bind(self, role: str, hook: Hook | None = None, pid: int | None = None, label: str | None = None) -> Ring:
        """Take the ``"producer"`` or ``"consumer"`` side; ``hook`` runs during waits and may raise to abort;
        ``label`` names this side (``"stage 1"``) in timeout messages."""
        if role not in ("producer", "consumer"):
            raise ValueError(f"ring role must be producer or consumer, not {role!r}")
        self.role = role
        self._hook = hook
        if label is not None:
            self.label = label
        self._header[_PRODUCER_PID if role == "producer" else _CONSUMER_PID] = pid or os.getpid()
        return self

    # -- state -------------------------------------------------------------------------------------------------
    @property
    def written(self) -> int:
        return int(self._header[_WRITE_SEQ])

    @property
    def read(self) -> int:
        return int(self._header[_READ_SEQ])

    def __len__(self) -> int:
        return self.written - self.read

    def _check_peer(self, peer_pid_word: int, peer_closed_word: int, who: str) -> None:
        if self._hook is not None:
            self._hook()
        if self._header[peer_closed_word]:
            raise ChannelClosed(f"the {who} closed ring {self.spec.name}")
        pid = int(self._header[peer_pid_word])
        if pid and not pid_alive(pid):
            # A SIGKILLed process shows as a zombie once its main thread is gone, but its parent can reap it (and
            # the hook, which names the failed stage, see it dead) only after its other threads exit too. Give the
            # hook that moment rather than surface a bare PeerLost (which a loaded machine did).
            until = time.monotonic() + PEER_EXIT_GRACE_S
            while self._hook is not None and time.monotonic() < until:
                time.sleep(0.01)
                self._hook()
            raise PeerLost(f"the {who} of ring {self.spec.name} (pid {pid}) died")

    # -- producer ----------------------------------------------------------------------------------------------
    def put(self, array: np.ndarray, step: int, version: int = 0, timeout: float = 60.0) -> None:
        """Copy a float32 array into the next slot and publish it; blocks while the ring is full."""
        if array.dtype != np.float32 or array.ndim > MAX_DIMS or array.nbytes > self.spec.slot_bytes:
            raise ValueError(
                f"ring {self.spec.name} takes float32 arrays of <= {MAX_DIMS} dims and {self.spec.slot_bytes} bytes, "
                f"got {array.dtype} {array.shape}"
            )
        header, depth = self._header, self.spec.depth
        self._check_closed(_CONSUMER_CLOSED, "consumer")
        self.wait_seconds += wait_until(
            lambda: header[_WRITE_SEQ] - header[_READ_SEQ] < depth,
            lambda: self._check_peer(_CONSUMER_PID, _CONSUMER_CLOSED, "consumer"),
            timeout,
            f"{self.label}: a free slot in ring {self.spec.name} (its consumer is not taking items)",
        )
        start = time.perf_counter()
        seq = int(header[_WRITE_SEQ])
        slot = seq % depth
        payload = self._payloads[slot][: array.size]
        np.copyto(payload, array.reshape(-1))
        sh = self._slot_headers[slot]
        sh[_S_STEP], sh[_S_VERSION], sh[_S_NDIM] = step, version, array.ndim
        sh[_S_SHAPE : _S_SHAPE + MAX_DIMS] = (*array.shape, *(0,) * (MAX_DIMS - array.ndim))
        sh[_S_SEQ] = seq
        header[_WRITE_SEQ] = seq + 1  # publish
        self.copy_seconds += time.perf_counter() - start

    def close(self) -> None:
        """Mark this side closed; the other side finishes what was published and then sees ``ChannelClosed``."""
        if self.role == "producer":
            self._header[_PRODUCER_CLOSED] = 1
        elif self.role == "consumer":
            self._header[_CONSUMER_CLOSED] = 1

    def _check_closed(self, word: int, who: str) -> None:
        if self._header[word]:
            raise ChannelClosed(f"the {who} closed ring {self.spec.name}")

    # -- consumer ----------------------------------------------------------------------------------------------
    def get(self, timeout: float = 60.0) -> RingItem:
        """Copy the oldest item out of its slot and release the slot; blocks while the ring is empty."""
        header = self._header

        def check() -> None:
            if header[_WRITE_SEQ] == header[_READ_SEQ]:  # only give up once everything published was read
                self._check_peer(_PRODUCER_PID, _PRODUCER_CLOSED, "producer")
            elif self._hook is not None:
                self._hook()

        self.wait_seconds += wait_until(
            lambda: header[_WRITE_SEQ] > header[_READ_SEQ],
            check,
            timeout,
            f"{self.label}: the next item in ring {self.spec.name} (its producer is not sending)",
        )
        start = time.perf_counter()
        seq = int(header[_READ_SEQ])
        slot = seq % self.spec.depth
        sh = self._slot_headers[slot]
        if sh[_S_SEQ] != seq:
            raise RuntimeError(f"ring {self.spec.name}: slot {slot} holds item {int(sh[_S_SEQ])}, expected {seq}")
        ndim = int(sh[_S_NDIM])
        shape = tuple(int(d) for d in sh[_S_SHAPE : _S_SHAPE + ndim])
        size = int(np.prod(shape)) if ndim else 1
        data = self._payloads[slot][:size].reshape(shape).copy()
        item = RingItem(int(sh[_S_STEP]), int(sh[_S_VERSION]), data)
        header[_READ_SEQ] = seq + 1  # release
        self.copy_seconds += time.perf_counter() - start
        return item

    def detach(self) -> None:
        """Drop this handle's views and unmap the segment (the creator unlinks it separately)."""
        self._header = self._slot_headers = self._payloads = None  # type: ignore[assignment]
        close_segment(self._shm)
