"""Shared-memory rings and snapshots: ordering, back-pressure, peers killed mid-stream, no leaked segments.

The child processes here import numpy and the ring module only (no torch), so each starts in a fraction of a
second; every test reaps its children and checks /dev/shm for its segments afterwards.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from swarmtrain.localtrain.errors import ChannelClosed, PeerLost, WaitTimeout
from swarmtrain.localtrain.ring import Ring, RingSpec, wait_until
from swarmtrain.localtrain.shm import Segments, attach_segment, close_segment, leftover_segments, pid_alive, sweep
from swarmtrain.localtrain.snapshot import Snapshot

CTX = mp.get_context("spawn")
pytestmark = [pytest.mark.usefixtures("reap_children"), pytest.mark.timeout(60)]

EXIT_CLOSED, EXIT_LOST, EXIT_BAD = 0, 7, 3


@pytest.fixture
def segments():
    segs = Segments()
    yield segs
    segs.unlink_all()
    assert leftover_segments(segs.prefix) == []


def item(i: int) -> np.ndarray:
    return np.full((2, 3 + i % 4), i, dtype=np.float32)


# -- child process targets (module level: spawn imports them) --------------------------------------------------
def produce(spec: RingSpec, count: int, delay: float) -> None:
    ring = Ring.attach(spec).bind("producer")
    try:
        for i in range(count):
            ring.put(item(i), step=i, version=10 * i, timeout=30)
            if delay:
                time.sleep(delay)
        ring.close()
    finally:
        ring.detach()


def consume(spec: RingSpec, delay: float) -> None:
    """Read until the ring ends; the exit code says how it ended (and 3 if anything arrived out of order)."""
    ring = Ring.attach(spec).bind("consumer")
    code = EXIT_BAD
    try:
        expected = 0
        while True:
            got = ring.get(timeout=30)
            if got.step != expected or not np.array_equal(got.data, item(expected)):
                break
            expected += 1
            if delay:
                time.sleep(delay)
    except ChannelClosed:
        code = EXIT_CLOSED
    except PeerLost:
        code = EXIT_LOST
    finally:
        ring.detach()
    os._exit(code)


def publish_versions(name: str, shape: tuple[int, ...], count: int) -> None:
    snap = Snapshot.attach(name, shape)
    try:
        for version in range(1, count + 1):
            snap.publish(np.full(shape, version, dtype=np.float32), version)
    finally:
        snap.detach()


def write_and_leave(name: str) -> None:
    shm = attach_segment(name)
    shm.buf[:5] = b"hello"
    close_segment(shm)


# -- in-process ---------------------------------------------------------------------------------------------
def test_ring_keeps_order_shape_and_tags_across_wraparound(segments: Segments) -> None:
    ring = Ring.create(segments, "r", depth=3, slot_bytes=64)
    ring.bind("producer", pid=os.getpid())
    ring.bind("consumer")
    received = []
    for i in range(10):
        ring.put(item(i), step=i, version=10 * i)
        if i % 2:
            received.extend(ring.get() for _ in range(len(ring)))
    received.extend(ring.get() for _ in range(len(ring)))
    assert [r.step for r in received] == list(range(10))
    assert [r.version for r in received] == [10 * i for i in range(10)]
    for i, r in enumerate(received):
        assert r.data.shape == item(i).shape and np.array_equal(r.data, item(i))
    ring.detach()


def test_received_arrays_are_copies_not_views_of_the_slot(segments: Segments) -> None:
    ring = Ring.create(segments, "r", depth=1, slot_bytes=64).bind("consumer")
    ring.put(item(1), step=0)
    first = ring.get()
    ring.put(item(2), step=1)  # reuses the only slot
    assert np.array_equal(first.data, item(1))
    ring.detach()


def test_full_ring_applies_back_pressure(segments: Segments) -> None:
    ring = Ring.create(segments, "r", depth=3, slot_bytes=64).bind("consumer")
    for i in range(3):
        ring.put(item(i), step=i)
    with pytest.raises(WaitTimeout):
        ring.put(item(3), step=3, timeout=0.2)
    assert len(ring) == 3
    assert ring.get().step == 0
    ring.put(item(3), step=3, timeout=0.2)
    assert [ring.get().step for _ in range(3)] == [1, 2, 3]
    ring.detach()


def test_oversized_or_wrong_dtype_items_are_rejected(segments: Segments) -> None:
    ring = Ring.create(segments, "r", depth=2, slot_bytes=64)
    with pytest.raises(ValueError):
        ring.put(np.zeros(17, dtype=np.float32), step=0)
    with pytest.raises(ValueError):
        ring.put(np.zeros(4, dtype=np.float64), step=0)
    ring.detach()


def test_closed_producer_is_drained_before_channel_closed(segments: Segments) -> None:
    ring = Ring.create(segments, "r", depth=4, slot_bytes=64)
    ring.bind("producer")
    ring.put(item(0), step=0)
    ring.put(item(1), step=1)
    ring.close()
    ring.bind("consumer")
    assert [ring.get(timeout=1).step for _ in range(2)] == [0, 1]
    with pytest.raises(ChannelClosed):
        ring.get(timeout=1)
    ring.detach()


def test_wait_hook_can_abort_a_wait() -> None:
    class Stop(Exception):
        pass

    def hook() -> None:
        raise Stop

    with pytest.raises(Stop):
        wait_until(lambda: False, hook, timeout=5)


# -- real processes -----------------------------------------------------------------------------------------
def test_ring_between_processes_keeps_order_under_back_pressure(segments: Segments) -> None:
    ring = Ring.create(segments, "r", depth=2, slot_bytes=64).bind("consumer")
    proc = CTX.Process(target=produce, args=(ring.spec, 40, 0.0))
    proc.start()
    steps = []
    with pytest.raises(ChannelClosed):
        for _ in range(41):
            assert len(ring) <= 2
            got = ring.get(timeout=30)
            assert np.array_equal(got.data, item(got.step))
            steps.append(got.step)
            time.sleep(0.002)  # a slow consumer: the producer must wait for free slots
    assert steps == list(range(40))
    proc.join(timeout=10)
    assert proc.exitcode == 0
    ring.detach()


def test_producer_killed_mid_stream(segments: Segments) -> None:
    ring = Ring.create(segments, "r", depth=2, slot_bytes=64).bind("consumer")
    proc = CTX.Process(target=produce, args=(ring.spec, 100_000, 0.001))
    proc.start()
    assert [ring.get(timeout=30).step for _ in range(5)] == list(range(5))
    os.kill(proc.pid, signal.SIGKILL)  # not reaped yet: a zombie must count as dead
    drained = []
    start = time.monotonic()
    with pytest.raises(PeerLost):
        for _ in range(ring.spec.depth + 2):
            drained.append(ring.get(timeout=20).step)
    assert time.monotonic() - start < 10
    assert drained == list(range(5, 5 + len(drained)))  # what was published still arrives, in order
    proc.join(timeout=10)
    assert proc.exitcode == -signal.SIGKILL
    ring.detach()


def test_consumer_killed_mid_stream(segments: Segments) -> None:
    ring = Ring.create(segments, "r", depth=2, slot_bytes=64).bind("producer")
    proc = CTX.Process(target=consume, args=(ring.spec, 0.01))
    proc.start()
    for i in range(5):
        ring.put(item(i), step=i, timeout=30)
    os.kill(proc.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(PeerLost):
        for i in range(5, 5 + ring.spec.depth + 2):
            ring.put(item(i), step=i, timeout=20)
    assert time.monotonic() - start < 10
    proc.join(timeout=10)
    ring.detach()


def test_child_consumer_notices_a_killed_child_producer(segments: Segments) -> None:
    """Both ends are children; the parent only created the ring and kills the producer."""
    ring = Ring.create(segments, "r", depth=2, slot_bytes=64)
    consumer = CTX.Process(target=consume, args=(ring.spec, 0.0))
    producer = CTX.Process(target=produce, args=(ring.spec, 100_000, 0.001))
    consumer.start()
    producer.start()
    wait_until(lambda: ring.read >= 5, lambda: None, timeout=30)
    os.kill(producer.pid, signal.SIGKILL)
    consumer.join(timeout=20)  # before the producer is reaped: the consumer sees a zombie
    assert consumer.exitcode == EXIT_LOST
    producer.join(timeout=10)
    ring.detach()


def test_child_consumer_sees_a_normal_end(segments: Segments) -> None:
    ring = Ring.create(segments, "r", depth=3, slot_bytes=64)
    consumer = CTX.Process(target=consume, args=(ring.spec, 0.0))
    producer = CTX.Process(target=produce, args=(ring.spec, 50, 0.0))
    consumer.start()
    producer.start()
    producer.join(timeout=30)
    consumer.join(timeout=30)
    assert (producer.exitcode, consumer.exitcode) == (0, EXIT_CLOSED)
    assert ring.read == ring.written == 50
    ring.detach()


def test_snapshot_reader_never_sees_a_torn_write(segments: Segments) -> None:
    shape = (512, 512)  # 1 MiB: long enough copies that reads overlap writes
    snap = Snapshot.create(segments, "s", shape)
    proc = CTX.Process(target=publish_versions, args=(snap.name, shape, 300))
    proc.start()
    out = np.empty(shape, dtype=np.float32)
    last, reads = -1, 0
    deadline = time.monotonic() + 30
    while last < 300 and time.monotonic() < deadline:
        version = snap.read_into(out, timeout=10)
        if version > 0:
            assert out.min() == out.max() == version
        assert version >= last
        last, reads = version, reads + 1
    assert last == 300
    proc.join(timeout=10)
    assert proc.exitcode == 0
    snap.detach()


def test_snapshot_wait_for_times_out_without_a_writer(segments: Segments) -> None:
    snap = Snapshot.create(segments, "s", (4,))
    assert snap.version == -1
    with pytest.raises(WaitTimeout):
        snap.wait_for(0, lambda: None, timeout=0.1)
    snap.publish(np.ones(4, dtype=np.float32), 0)
    snap.wait_for(0, lambda: None, timeout=0.1)
    snap.detach()


def test_child_attach_does_not_let_the_tracker_unlink_the_segment(segments: Segments) -> None:
    shm = segments.create("seg", 64)
    proc = CTX.Process(target=write_and_leave, args=(shm.name,))
    proc.start()
    proc.join(timeout=20)
    assert proc.exitcode == 0
    time.sleep(0.2)  # give a (wrongly) registered tracker the chance to act
    assert shm.name in leftover_segments(segments.prefix)
    assert bytes(shm.buf[:5]) == b"hello"


def test_sweep_and_pid_alive(segments: Segments) -> None:
    segments.create("a", 16)
    segments.create("b", 16)
    assert len(leftover_segments(segments.prefix)) == 2
    assert len(sweep(segments.prefix)) == 2
    assert leftover_segments(segments.prefix) == []
    assert pid_alive(os.getpid())
    assert not pid_alive(0)
