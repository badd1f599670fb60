"""Sparse and low-rank codecs are all-gathered whole: every member applies the same exact average of what was sent."""

from __future__ import annotations

import asyncio

import torch

from swarmtrain.averaging import Averager, leader_candidates
from swarmtrain.averaging.allgather import Segment, plan_segments
from swarmtrain.averaging.round import Phase
from swarmtrain.compression import get_codec
from swarmtrain.net import MemoryNetwork, PeerUnreachable

NUMEL = 10_000


def make_swarm(n: int, codec: str, *, shapes=None, numel: int = NUMEL, error_feedback: bool = True):
    net = MemoryNetwork()
    averagers = [
        Averager(
            net.transport(f"peer{i}"), torch.zeros(numel), run_id="test", group_size=16, outer_lr=1.0,
            outer_momentum=0.0, codec_up=get_codec(codec), codec_down=get_codec(codec), part_numel=1000,
            min_deadline=2.0, deadline_factor=4.0, error_feedback=error_feedback, shapes=shapes,
        )
        for i in range(n)
    ]  # fmt: skip
    return net, averagers


async def run_round(averagers, deltas, weights):
    alive = [a.me for a in averagers]
    return await asyncio.gather(
        *(
            a.run_round(d, w, leader_candidates(alive, a.me, 16, "test", a.round), set(alive), gather_timeout=2.0)
            for a, d, w in zip(averagers, deltas, weights, strict=True)
        )
    )


def sent(codec: str, delta: torch.Tensor) -> torch.Tensor:
    """What a receiver decodes from a first-round payload of ``delta`` (chunks of 1000, no residual yet)."""
    c = get_codec(codec)
    return torch.cat([c.decode(c.encode(chunk), chunk.numel()) for chunk in delta.split(1000)])


async def test_sparse_payloads_are_averaged_exactly_without_recompression() -> None:
    codec = "topk:frac=0.05,value=fp32"
    net, averagers = make_swarm(4, codec)
    for a in averagers:
        await a.start()
    torch.manual_seed(0)
    deltas = [torch.randn(NUMEL) for _ in averagers]
    weights = [100.0, 200.0, 300.0, 400.0]
    outcomes = await run_round(averagers, deltas, weights)
    assert {o.outcome for o in outcomes} == {"applied"} and len({o.digest for o in outcomes}) == 1
    expected = -sum(w * sent(codec, d) for w, d in zip(weights, deltas, strict=True)) / sum(weights)
    torch.testing.assert_close(averagers[0].outer.theta, expected)
    # Nothing re-sparsified on the way back: the update holds every sender's kept coordinates (about 4 x 5 %).
    assert torch.count_nonzero(averagers[0].outer.theta) > 3 * 0.05 * NUMEL
    # Each node sent its payload to the 3 others, nothing more (plus small messages).
    payload = sum(get_codec(codec).payload_size(1000) for _ in range(NUMEL // 1000))
    assert all(3 * payload <= a.transport.counter.sent < 3 * payload + 20_000 for a in averagers)


async def test_a_member_killed_mid_exchange_is_left_out_by_every_survivor() -> None:
    codec = "topk:frac=0.05,value=fp32"
    net, averagers = make_swarm(4, codec)
    for a in averagers:
        await a.start()
    frames = {"n": 0}

    def kill_peer3(src: str, dst: str, method: str, header: dict) -> None:
        if src == "peer3" and method == "results#frame":
            frames["n"] += 1
            if frames["n"] == 3:  # its payload reached one peer at most, and not whole
                net.kill("peer3")
                raise PeerUnreachable("killed")

    net.before_call = kill_peer3
    deltas = [torch.randn(NUMEL) for _ in averagers]
    loop = asyncio.get_running_loop()
    started = loop.time()
    survivors = (await run_round(averagers, deltas, [1.0] * 4))[:3]
    assert loop.time() - started < averagers[0].deadline_s() + 3.0
    assert len({o.digest for o in survivors}) == 1 and {o.outcome for o in survivors} == {"fallback"}
    assert all("peer3" in o.excluded for o in survivors)
    # The survivors' own contributions are applied in full, re-weighted among themselves.
    torch.testing.assert_close(averagers[0].outer.theta, -sum(sent(codec, d) for d in deltas[:3]) / 3)


async def test_a_malformed_sparse_payload_excludes_its_sender_everywhere() -> None:
    net, averagers = make_swarm(3, "topk:frac=0.05")

    class Truncating:  # a broken peer: the right header, one byte short
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def encode(self, tensor, state=None):
            return self.inner.encode(tensor, state)[:-1]

    averagers[2].segments = [Segment(s.start, s.end, Truncating(s.codec)) for s in averagers[2].segments]
    for a in averagers:
        await a.start()
    outcomes = await run_round(averagers, [torch.randn(NUMEL) for _ in averagers], [1.0] * 3)
    assert len({o.digest for o in outcomes}) == 1
    assert all("peer2" in o.excluded for o in outcomes[:2])
    assert all(o.applied_fraction == 2 / 3 for o in outcomes)


async def test_an_observer_receives_the_average_and_sends_nothing() -> None:
    net, averagers = make_swarm(3, "topk:frac=0.05,value=fp32")
    for a in averagers:
        await a.start()
    deltas = [torch.randn(NUMEL), torch.randn(NUMEL), torch.full((NUMEL,), float("inf"))]
    outcomes = await run_round(averagers, deltas, [1.0] * 3)
    assert len({o.digest for o in outcomes}) == 1 and {o.outcome for o in outcomes} == {"applied"}
    expected = -(sent("topk:frac=0.05,value=fp32", deltas[0]) + sent("topk:frac=0.05,value=fp32", deltas[1])) / 2
    torch.testing.assert_close(averagers[2].outer.theta, expected)
    assert averagers[2].transport.counter.sent < 20_000  # reports and digests only


def test_powersgd_factors_each_weight_matrix_and_sends_vectors_as_fp16() -> None:
    shapes = [(256, 64), (64,), (64,), (192, 64), (64, 3, 3), (10,)]
    numel = sum(torch.Size(s).numel() for s in shapes)
    segments = plan_segments(get_codec("powersgd:rank=2"), numel, shapes, 1 << 20)
    assert [(s.start, s.end, s.codec.spec.split(",")[0], getattr(s.codec, "shape", None)) for s in segments] == [
        (0, 16384, "powersgd:rank=2", (256, 64)),
        (16384, 16512, "fp16", None),
        (16512, 28800, "powersgd:rank=2", (192, 64)),
        (28800, 29376, "powersgd:rank=2", (64, 9)),
        (29376, 29386, "fp16", None),
    ]
    # Other codecs cut the flat vector into parts, whatever the shapes.
    topk = plan_segments(get_codec("topk"), numel, shapes, 10_000)
    assert [(s.start, s.end) for s in topk] == [(0, 10_000), (10_000, 20_000), (20_000, 29_386)]


async def test_powersgd_on_weight_matrices_keeps_replicas_identical_and_warm_starts() -> None:
    shapes = [(64, 100), (100,), (50, 36), (100,)]
    numel = sum(torch.Size(s).numel() for s in shapes)
    net, averagers = make_swarm(3, "powersgd:rank=2", shapes=shapes, numel=numel)
    for a in averagers:
        await a.start()
    # A rank-1 update per matrix is carried exactly by rank-2 factors; the vectors by fp16.
    torch.manual_seed(0)
    deltas = []
    for _ in averagers:
        parts = [
            torch.outer(torch.randn(64), torch.randn(100)),
            torch.randn(100),
            torch.zeros(50, 36),
            torch.randn(100),
        ]
        deltas.append(torch.cat([p.reshape(-1) for p in parts]))
    for _ in range(2):
        outcomes = await run_round(averagers, deltas, [1.0] * 3)
        assert len({o.digest for o in outcomes}) == 1 and {o.outcome for o in outcomes} == {"applied"}
    expected = -2 * sum(deltas) / 3
    torch.testing.assert_close(averagers[0].outer.theta, expected, atol=2e-3, rtol=2e-3)
    # Each matrix keeps its Q for the next round's power iteration; the fp16 vectors have none.
    warm = [s.warm_q is not None for s in averagers[0].codec_states]
    assert warm == [seg.codec.name == "powersgd" for seg in averagers[0].segments] and any(warm)


async def test_a_payload_nobody_received_goes_back_into_the_senders_residual() -> None:
    net, averagers = make_swarm(3, "topk:frac=0.05,value=fp32")
    for a in averagers:
        await a.start()

    def cut_peer2_uplink(src: str, dst: str, method: str, header: dict) -> None:
        if src == "peer2" and method == "results":
            raise PeerUnreachable("link down")

    net.before_call = cut_peer2_uplink
    deltas = [torch.randn(NUMEL) for _ in averagers]
    outcomes = await run_round(averagers, deltas, [1.0] * 3)
    assert outcomes[0].digest == outcomes[1].digest and outcomes[0].applied_fraction == 2 / 3
    # Its reports still reach the others: it applies the same average (it holds their payloads) and is confirmed.
    assert outcomes[2].outcome == "fallback" and outcomes[2].digest == outcomes[0].digest
    assert averagers[2].lifecycle.phase is not Phase.CATCH_UP
    # Nothing of peer2's update reached theta_g, and nothing of it is lost: all of it waits in its residual.
    torch.testing.assert_close(averagers[2].residual, deltas[2])
