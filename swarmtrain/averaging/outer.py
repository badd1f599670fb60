"""The outer optimizer of DiLoCo on flat tensors, and the digest that replicas compare.

``theta_g -= lr * (g + momentum * buf)`` with ``buf = momentum * buf + g`` (Nesterov), where ``g`` is the
averaged pseudo-gradient ``theta_g - theta_local``. FedAvg is lr 1 without momentum: theta_g becomes the
weighted average of the local models. Every operation is elementwise in a fixed order, so members that apply
the same averaged update to the same state end bit-identical.

The state is theta_g and, with a momentum, its buffer. Without one (FedAvg, SparseLoCo's outer step) there is
no buffer at all: nothing to keep, hash, mix, serve to joiners or checkpoint but theta_g.

The round's hashes of whole tensors (this state digest, the shard and payload hashes members compare in a
report) are BLAKE3: a cryptographic hash, and about 3.7x SHA-256's speed on one core even where the CPU has
SHA extensions (6.7 against 1.8 GB/s measured here), which matters when every member hashes its state (numel
floats, or 2 x numel with a momentum) every round.

The state digest is the hash of the state's chunk hashes (``chunk_hashes``: fixed runs of ``chunk_numel``
elements of theta_g and the momentum, end to end), so that a part of the state can be checked against the
digest alone: a gossip round's reducer checks that what each member sends it is the state that member joined
with (``AllReduce``), given the member's chunk hashes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import blake3
import torch

MAX_CHUNKS = 1024  # chunks of a state at most: their hashes (16 KiB) travel in a message header
CHUNK_HASH = 16  # bytes of each chunk's hash


def chunk_numel(numel: int) -> int:
    """Elements per chunk of a state of ``numel`` elements: the least power of two that makes at most
    ``MAX_CHUNKS`` of them (so that a group of up to that many members has a chunk for each)."""
    size = 1
    while -(-numel // size) > MAX_CHUNKS:
        size *= 2
    return size


def chunk_hashes(*tensors: torch.Tensor) -> bytes:
    """The hash of each chunk of ``tensors`` end to end (``chunk_numel`` elements; the last may be shorter),
    ``CHUNK_HASH`` bytes each."""
    flat = [t.detach().contiguous().view(-1) for t in tensors]
    chunk = chunk_numel(sum(t.numel() for t in flat))
    hashes, hasher, filled = [], blake3.blake3(), 0
    for t in flat:
        data, size = t.view(torch.uint8).numpy(), t.element_size()
        pos = 0
        while pos < t.numel():
            take = min(chunk - filled, t.numel() - pos)
            hasher.update(data[pos * size : (pos + take) * size])
            pos, filled = pos + take, filled + take
            if filled == chunk:
                hashes.append(hasher.digest(CHUNK_HASH))
                hasher, filled = blake3.blake3(), 0
    if filled:
        hashes.append(hasher.digest(CHUNK_HASH))
    return b"".join(hashes)


def add_square_sums(sums: torch.Tensor, tensor: torch.Tensor, at: int, chunk: int, scale: float = 1.0) -> None:
    """Add the squares of ``scale * tensor``, which starts at element ``at`` of a state, to its chunks' ``sums``."""
    t, pos = tensor.detach().reshape(-1), 0
    while pos < t.numel():
        index, offset = divmod(at + pos, chunk)
        whole = (t.numel() - pos) // chunk if offset == 0 else 0
        if whole:  # whole chunks at once
            block = t[pos : pos + whole * chunk].view(whole, chunk)
            sums[index : index + whole] += block.norm(dim=1).double().square() * scale**2
            take = whole * chunk
        else:  # a chunk that begins or ends in another tensor, or the short last one
            take = min(chunk - offset, t.numel() - pos)
            sums[index] += (float(t[pos : pos + take].norm()) * scale) ** 2
        pos += take


def chunk_root(hashes: bytes) -> str:
    """The state digest of a state with these chunk hashes."""
    return blake3.blake3(hashes).hexdigest()[:24]


def outer_digest(*tensors: torch.Tensor) -> str:
    """The digest replicas compare of the outer state ``tensors`` (theta_g, then the momentum where there is one)."""
    return chunk_root(chunk_hashes(*tensors))


class OuterOptimizer:
    def __init__(self, theta: torch.Tensor, lr: float, momentum: float, nesterov: bool = True) -> None:
        self.theta = theta
        self.lr = lr
        self.momentum = momentum
        self.nesterov = nesterov
        self.buf = torch.zeros_like(theta) if momentum else None
        self._digest: tuple[tuple[int, ...], bytes, str] | None = None
        # How far my last step moved each chunk of the state (squared norms, ``add_square_sums``; zeros before the
        # first): what I claim in a gossip mix, where the robust mix counts states about a step apart
        # (``Aggregator.floor``).
        numel = theta.numel() * (1 if self.buf is None else 2)
        self.chunk = chunk_numel(numel)
        self.moved = torch.zeros(-(-numel // self.chunk), dtype=torch.float64)

    def step(self, grad: torch.Tensor) -> None:
        moved = torch.zeros_like(self.moved)
        if self.buf is not None:
            # How far the buffer moves: momentum * buf + grad - buf.
            spare = grad.add(self.buf, alpha=self.momentum - 1)
            add_square_sums(moved, spare, self.theta.numel(), self.chunk)
            self.buf.mul_(self.momentum).add_(grad)
            update = torch.add(grad, self.buf, alpha=self.momentum, out=spare) if self.nesterov else self.buf
        else:
            update = grad
        add_square_sums(moved, update, 0, self.chunk, self.lr)
        self.theta.sub_(update, alpha=self.lr)
        self.moved = moved

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The state every member holds alike, by name: what the digest covers, joiners download and checkpoints
        keep (``theta``, and ``momentum`` where there is one)."""
        return {"theta": self.theta} if self.buf is None else {"theta": self.theta, "momentum": self.buf}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, target in self.state_tensors().items():
            value = tensors[name]
            if value.shape != target.shape or value.dtype != target.dtype:
                raise ValueError(f"{name}: got {tuple(value.shape)} {value.dtype}, want {tuple(target.shape)}")
            target.copy_(value)

    def digest(self) -> str:
        return self._hashed()[2]

    def chunk_hashes(self) -> bytes:
        """The chunk hashes of my state (``chunk_hashes``), whose root is ``digest()``."""
        return self._hashed()[1]

    def _hashed(self) -> tuple[tuple[int, ...], bytes, str]:
        # Hashing costs about 6 ms per 10M floats of state (BLAKE3, one core); tensor version counters tell us whether
        # any in-place op touched the state since the last hash.
        tensors = self.state_tensors().values()
        key = tuple(t._version for t in tensors)
        if self._digest is None or self._digest[0] != key:
            hashes = chunk_hashes(*tensors)
            self._digest = (key, hashes, chunk_root(hashes))
        return self._digest


def state_digest(*tensors: torch.Tensor, extra: bytes = b"", hasher: Callable[[], Any] = blake3.blake3) -> str:
    """A short hash of the exact bytes of ``tensors`` (and ``extra``): equal digests mean bit-identical replicas.
    ``hasher`` makes the hash object; BLAKE3 on one thread (the trainer may be using the other cores, overlap)."""
    h = hasher()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy())  # the buffer itself, no copy
    h.update(extra)
    return h.hexdigest()[:24]
