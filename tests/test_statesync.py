"""State sync in process: a joiner downloads theta_g and the momentum in chunks from several donors (milliseconds)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import pytest
import torch
from hivemind.p2p import P2P

from swarmtrain.averaging import Averager
from swarmtrain.averaging.round import Stale
from swarmtrain.averaging.statesync import INFLIGHT, MIN_RATE, RATE_SLACK, Deadline, state_size_bounds
from swarmtrain.compression import get_codec
from swarmtrain.net import MemoryNetwork, P2PTransport, Rejected

NUMEL = 10_000
CHUNK = 8192  # the state is ~80 kB: 10 chunks


def averager(net: MemoryNetwork, name: str, numel: int = NUMEL, momentum: float = 0.9) -> Averager:
    a = Averager(
        net.transport(name), torch.zeros(numel), run_id="test", group_size=16, outer_lr=0.7, outer_momentum=momentum,
        codec_up=get_codec("fp32"), codec_down=get_codec("fp32"), part_numel=1000, min_deadline=2.0,
        deadline_factor=4.0,
    )  # fmt: skip
    a.state_chunk = CHUNK
    return a


async def donors_and_joiner(n: int, round_: int = 7) -> tuple[MemoryNetwork, list[Averager], Averager, Counter[str]]:
    """``n`` donors holding one state (a few outer steps in), a fresh joiner, and a count of chunk requests."""
    net = MemoryNetwork()
    net.delay = 0.002  # every call yields, as on a real link, so donors serve side by side
    donors = [averager(net, f"donor{i}") for i in range(n)]
    torch.manual_seed(0)
    grads = [torch.randn(NUMEL) for _ in range(3)]
    for d in donors:
        for g in grads:
            d.outer.step(g)
        d.round = round_
    joiner = averager(net, "joiner")
    for a in [*donors, joiner]:
        await a.start()
    chunks: Counter[str] = Counter()

    def count(src: str, dst: str, method: str, header: dict) -> None:
        if method == "state" and "index" in header:
            chunks[dst] += 1

    net.before_call = count
    return net, donors, joiner, chunks


def tamper(net: MemoryNetwork, peer: str, change) -> None:
    """Make ``peer`` answer state requests with ``change(header, answer, body)`` of its honest answer."""
    handler, max_body, max_frames = net.handlers[peer]["state"]

    async def wrapped(sender, header, frames):
        answer, body = await handler(sender, header, frames)
        return change(header, answer, body)

    net.handlers[peer]["state"] = (wrapped, max_body, max_frames)


def same_state(a: Averager, b: Averager) -> bool:
    return torch.equal(a.outer.theta, b.outer.theta) and torch.equal(a.outer.buf, b.outer.buf)


async def test_chunks_come_from_every_donor_and_assemble_the_agreed_state() -> None:
    net, donors, joiner, chunks = await donors_and_joiner(3)
    digest = donors[0].outer.digest()
    assert await joiner.fetch_state([d.me for d in donors], digest, max_round=7)
    assert same_state(joiner, donors[0]) and joiner.outer.digest() == digest and joiner.round == 7
    assert set(chunks) == {d.me for d in donors} and min(chunks.values()) >= 2, chunks
    assert sum(chunks.values()) == 10  # each chunk fetched once


async def test_a_node_off_the_swarms_line_goes_back_to_the_donors_round_only_when_told_to() -> None:
    """A node far ahead of the swarm (a split that healed) takes the swarm's state and its lower round, and drops
    what belonged to its own rounds: the update kept for a later round, the groups of rounds it will reach again.
    A plain catch-up never moves the round back."""
    net, donors, joiner, _ = await donors_and_joiner(2, round_=7)
    digest = donors[0].outer.digest()
    joiner.round = 40
    assert await joiner.fetch_state([d.me for d in donors], digest, max_round=7)
    assert same_state(joiner, donors[0]) and joiner.round == 40
    joiner.lifecycle.stale = Stale(torch.ones(NUMEL), 39)
    joiner.matchmaker._lobby(40)
    assert await joiner.fetch_state([d.me for d in donors], digest, max_round=7, rewind=True)
    assert same_state(joiner, donors[0]) and joiner.round == 7
    assert joiner.lifecycle.stale is None and joiner.matchmaker.lobbies == {}


async def test_without_an_outer_momentum_a_joiner_downloads_theta_g_alone() -> None:
    """FedAvg and SparseLoCo's outer step keep no momentum buffer: a joiner fetches theta_g, half the bytes."""
    net = MemoryNetwork()
    donor, joiner = averager(net, "donor", momentum=0.0), averager(net, "joiner", momentum=0.0)
    donor.outer.step(torch.randn(NUMEL, generator=torch.Generator().manual_seed(0)))
    donor.round = 3
    for a in (donor, joiner):
        await a.start()
    chunks: Counter[str] = Counter()
    net.before_call = lambda src, dst, method, header: chunks.update([dst] if "index" in header else [])
    assert await joiner.fetch_state([donor.me], donor.outer.digest(), max_round=3)
    assert torch.equal(joiner.outer.theta, donor.outer.theta) and joiner.outer.buf is None and joiner.round == 3
    assert sum(chunks.values()) == 5  # 40 kB in chunks of 8 kB; theta_g and a momentum take 10 (above)


async def test_a_donor_that_dies_mid_download_is_replaced() -> None:
    net, donors, joiner, chunks = await donors_and_joiner(3)
    counting = net.before_call

    def die_on_second_chunk(src: str, dst: str, method: str, header: dict) -> None:
        counting(src, dst, method, header)
        if dst == "donor1" and chunks["donor1"] == 2:
            net.kill("donor1")

    net.before_call = die_on_second_chunk
    digest = donors[0].outer.digest()
    assert await joiner.fetch_state([d.me for d in donors], digest)
    assert same_state(joiner, donors[0])
    assert chunks["donor1"] <= 1 + INFLIGHT and chunks["donor0"] + chunks["donor2"] >= 8, chunks


async def test_a_donor_serving_corrupted_chunks_is_dropped_and_its_chunks_come_from_others(caplog) -> None:
    net, donors, joiner, chunks = await donors_and_joiner(3)

    def flip(header, answer, body):
        return answer, (bytes([body[0] ^ 1]) + body[1:]) if "index" in header else body

    tamper(net, "donor1", flip)
    digest = donors[0].outer.digest()
    with caplog.at_level(logging.INFO, logger="swarmtrain.averaging.statesync"):
        assert await joiner.fetch_state([d.me for d in donors], digest)
    assert same_state(joiner, donors[0])
    assert chunks["donor1"] <= INFLIGHT, chunks  # dropped at its first bad chunk
    assert "does not match the manifest" in caplog.text


async def test_a_donor_whose_bytes_do_not_hash_to_the_digest_it_claims_is_detected(caplog) -> None:
    """A donor with another state that claims the agreed digest (its manifest matches its own bytes): the
    assembled state fails the digest check, and the joiner takes the state from the honest donor."""
    net, donors, joiner, chunks = await donors_and_joiner(2)
    liar, honest = donors
    digest = honest.outer.digest()
    liar.outer.step(torch.ones(NUMEL))
    liar.outer.digest = lambda: digest  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="swarmtrain.averaging.statesync"):
        assert await joiner.fetch_state([liar.me, honest.me], digest)  # the liar's offer is tried first
    assert "does not hash to its digest" in caplog.text
    assert same_state(joiner, honest) and chunks[liar.me] > 0 and chunks[honest.me] == 10


async def test_a_download_reads_one_snapshot_while_the_donor_moves_on() -> None:
    net, donors, joiner, chunks = await donors_and_joiner(2)
    digest = donors[0].outer.digest()
    expected = {k: v.clone() for k, v in donors[0].outer.state_tensors().items()}
    counting = net.before_call

    def step_donors(src: str, dst: str, method: str, header: dict) -> None:
        counting(src, dst, method, header)
        if sum(chunks.values()) == 3:
            for d in donors:  # a round ends on the donors in the middle of the download
                d.outer.step(torch.ones(NUMEL))
                d.round += 1

    net.before_call = step_donors
    assert await joiner.fetch_state([d.me for d in donors], digest)
    assert torch.equal(joiner.outer.theta, expected["theta"]) and joiner.outer.digest() == digest
    assert donors[0].outer.digest() != digest


async def test_claims_beyond_our_state_size_round_or_digest_are_refused(caplog) -> None:
    net, donors, joiner, chunks = await donors_and_joiner(1, round_=9)
    digest = donors[0].outer.digest()
    with caplog.at_level(logging.INFO, logger="swarmtrain.averaging.statesync"):
        assert not await joiner.fetch_state([donors[0].me], digest, max_round=5)  # one peer cannot drag us forward
        assert not await joiner.fetch_state([donors[0].me], "0" * 24)  # another digest than the agreed one
    # A download that ends with nothing to fetch says what the donors offered instead.
    offered = {donors[0].me[-8:]: f"{digest[:8]} (round 9)"}
    assert f"no donor offers state {digest[:8]} (round 5 at most); they offer {offered}" in caplog.text, caplog.text
    assert f"no donor offers state 00000000; they offer {offered}" in caplog.text, caplog.text
    tamper(net, "donor0", lambda header, answer, body: ({**answer, "total": 1 << 40}, body))
    assert not await joiner.fetch_state([donors[0].me], digest)
    assert not chunks and joiner.round == 0 and not joiner.outer.theta.any()


@pytest.mark.parametrize("numel", [NUMEL + 4, 2 * NUMEL])
async def test_a_donor_with_another_model_shape_is_refused(numel: int) -> None:
    net = MemoryNetwork()
    donor, joiner = averager(net, "donor", numel=numel), averager(net, "joiner")
    for a in (donor, joiner):
        await a.start()
    donor.outer.step(torch.ones(numel))
    assert not await joiner.fetch_state([donor.me], None)  # by its size, or by its header once downloaded
    assert not joiner.outer.theta.any()


@pytest.mark.parametrize("chunk", [1000, 1 << 30, True])
async def test_a_donor_refuses_chunk_sizes_out_of_bounds(chunk) -> None:
    net = MemoryNetwork()
    donor, joiner = averager(net, "donor"), averager(net, "joiner")
    for a in (donor, joiner):
        await a.start()
    joiner.state_chunk = chunk
    assert not await asyncio.wait_for(joiner.fetch_state([donor.me], None), 5)
    assert not donor.snapshots.snapshots  # nothing serialised for a refused probe


async def test_a_donor_that_fails_once_still_serves() -> None:
    net, donors, joiner, chunks = await donors_and_joiner(2)
    answered: Counter[str] = Counter()
    hiccups = []

    def hiccup_once(header, answer, body):
        if "index" in header and not hiccups:
            hiccups.append(header["index"])
            raise Rejected("busy for a moment")  # one failed call, as a dropped stream would give
        answered["donor1"] += "index" in header
        return answer, body

    tamper(net, "donor1", hiccup_once)
    digest = donors[0].outer.digest()
    assert await joiner.fetch_state([d.me for d in donors], digest)
    assert same_state(joiner, donors[0]) and hiccups
    # After its one failure donor1 serves on (not one in-flight chunk more): both donors share the download.
    assert answered["donor1"] >= 3 and sum(chunks.values()) == 10 + 1, (answered, chunks)


async def test_a_donor_one_round_ahead_still_serves_the_agreed_state() -> None:
    net, donors, first, chunks = await donors_and_joiner(2)
    digest = donors[0].outer.digest()
    assert await first.fetch_state([d.me for d in donors], digest, max_round=7)  # the donors snapshot the state
    for d in donors:  # then they move on a round
        d.outer.step(torch.ones(NUMEL))
        d.round += 1
    assert donors[0].outer.digest() != digest
    late = averager(net, "late")
    await late.start()
    chunks.clear()
    # A joiner that agreed on the earlier state (its group's digest) still gets it from the donors' snapshots.
    assert await late.fetch_state([d.me for d in donors], digest, max_round=7)
    assert same_state(late, first) and late.outer.digest() == digest and late.round == 7
    assert set(chunks) == {d.me for d in donors}, chunks


async def test_the_whole_download_has_one_deadline() -> None:
    """A donor that answers every chunk a little under the call timeout: each call succeeds, but the
    download as a whole ends at its deadline (the state's size at the floor rate), not after every chunk."""
    net, donors, joiner, chunks = await donors_and_joiner(1)
    timeout, per_call = 0.5, 0.35
    handler, max_body, max_frames = net.handlers["donor0"]["state"]

    async def slow(sender, header, frames):
        if "index" in header:
            await asyncio.sleep(per_call)
        return await handler(sender, header, frames)

    net.handlers["donor0"]["state"] = (slow, max_body, max_frames)
    started = time.monotonic()
    assert not await joiner.fetch_state([donors[0].me], donors[0].outer.digest(), timeout=timeout)
    took = time.monotonic() - started
    bound = timeout + state_size_bounds(donors[0].outer.state_tensors())[1] / MIN_RATE
    # Every chunk would take 10 / INFLIGHT * per_call = 1.75 s; the download gave up at its bound instead.
    assert sum(chunks.values()) < 10 and took < bound + 2.0, (chunks, took, bound)  # generous for a busy machine
    assert not joiner.outer.theta.any()


def test_the_deadline_follows_the_measured_rate() -> None:
    now = [0.0]
    deadline = Deadline(10.0, 100 * MIN_RATE, clock=lambda: now[0])
    assert deadline.left() == pytest.approx(110.0)  # the size at the floor rate, plus the floor
    now[0] = 1.0
    deadline.progress(10 * MIN_RATE, 90 * MIN_RATE)  # fast: 10 MIN_RATE per second
    assert deadline.left() == pytest.approx(10.0 + RATE_SLACK * 9.0)  # the rest at that rate, with slack
    now[0] = 30.0  # then it stalls: the deadline does not move without progress
    assert deadline.left() == pytest.approx(1.0 + 10.0 + RATE_SLACK * 9.0 - 30.0)


@pytest.mark.timeout(60)
async def test_chunked_download_over_real_p2p_streams() -> None:
    """Two donors and a joiner on p2pd daemons: the chunks travel as unary calls over libp2p streams."""
    first = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    daemons = [first]
    try:
        for _ in range(2):
            daemons.append(
                await P2P.create(initial_peers=await first.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            )
        numel = 100_000  # 800 kB of state: 13 chunks of 64 KiB
        nodes = [
            Averager(
                P2PTransport(p2p), torch.zeros(numel), run_id="test", group_size=16, outer_lr=0.7, outer_momentum=0.9,
                codec_up=get_codec("fp32"), codec_down=get_codec("fp32"), part_numel=1000, min_deadline=2.0,
                deadline_factor=4.0,
            )
            for p2p in daemons
        ]  # fmt: skip
        *donors, joiner = nodes
        for d in donors:
            d.outer.step(torch.arange(numel, dtype=torch.float32))
        for a in nodes:
            await a.start()
        joiner.state_chunk = 1 << 16
        size = state_size_bounds(donors[0].outer.state_tensors())[1]
        # Every chunk arrived and the state verified against the agreed digest.
        assert await joiner.fetch_state([d.me for d in donors], donors[0].outer.digest(), timeout=20)
        assert same_state(joiner, donors[0])
        # Both donors served (each starts with INFLIGHT chunks, and one failed call does not drop it); how many
        # each served depends on which answers faster, so only that is checked, and that little went twice.
        sent = [d.transport.counter.sent for d in donors]
        assert min(sent) >= joiner.state_chunk and sum(sent) < 2 * size, sent
    finally:
        for p2p in daemons:
            await p2p.shutdown()
