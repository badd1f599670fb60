from __future__ import annotations

import multiprocessing as mp
import random
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from hivemind.p2p import P2P

from swarmtrain.config import Config, load_config
from swarmtrain.localtrain.shm import leftover_segments, new_prefix, sweep

from .swarm import TINY, Swarm

WORDS = (
    "the swarm trains one model together over ordinary links while nodes join and leave at any time "
    "a peer averages its update with others in a group and every replica applies the same result "
    "bytes on the wire are the figure we compete on and nothing is lost when a machine crashes"
).split()


def english_like(n_bytes: int, seed: int = 0) -> bytes:
    """Deterministic word salad with sentence structure: enough regularity for a small model to learn fast."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < n_bytes:
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))).capitalize() + ". "
        out.append(sentence)
        size += len(sentence)
    return "".join(out).encode()[:n_bytes]


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (``timeout``, a CI runner giving up) stops the suite like Ctrl+C, so fixtures still reap the
    processes, daemons and shared-memory segments of the test in progress."""
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, signal.default_int_handler)


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_bytes(english_like(200_000))
    return path


def tiny_config(tmp_path: Path, data: Path, **overrides: object) -> Config:
    """A model small enough that a few dozen steps take about a second on one core."""
    settings = {
        "model.depth": 2,
        "model.width": 32,
        "model.heads": 2,
        "model.context": 32,
        "train.batch_size": 8,
        "train.max_steps": 20,
        "train.warmup_steps": 5,
        "train.eval_batches": 2,
        "train.threads": 1,
        "data.path": str(data),
        "data.cache_dir": str(tmp_path / "cache"),
        "run_dir": str(tmp_path / "run"),
    }
    settings.update(overrides)
    return load_config(flags=settings, environ={})


@pytest.fixture
def swarm(tmp_path: Path, text_file: Path) -> Iterator[Swarm]:
    """Real node processes on loopback with the tiny model; every process it started is reaped afterwards."""
    s = Swarm(tmp_path, text_file, TINY)
    try:
        yield s
    finally:
        s.close()


def localtrain_config(tmp_path: Path, data: Path, steps: int) -> Config:
    """The tiny model four blocks deep, so localtrain can cut it into stages."""
    return tiny_config(tmp_path, data, **{"model.depth": 4, "train.max_steps": steps, "train.warmup_steps": 2})


@pytest.fixture
def reap_children() -> Iterator[None]:
    """Kill and join the multiprocessing children a test left running (use with ``pytest.mark.usefixtures``)."""
    yield
    for proc in mp.active_children():
        proc.kill()
        proc.join(timeout=5)


@pytest.fixture
def prefix() -> Iterator[str]:
    """A fresh /dev/shm name prefix; the test fails if any segment under it is left behind."""
    name = new_prefix()
    yield name
    assert leftover_segments(name) == []
    sweep(name)


@pytest.fixture
async def pair() -> AsyncIterator[tuple[P2P, P2P]]:
    """Two p2p daemons on loopback, the second bootstrapped from the first."""
    a = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    b = await P2P.create(initial_peers=await a.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        yield a, b
    finally:
        await b.shutdown()
        await a.shutdown()
