"""Replicated reduction (``averaging.verify``, ``AllReduce._verify``): a member checks one random part of another
reducer's shard against the signed contributions the reducer averaged, and withholds a shard that does not add
up, so that no member applies it. In process (memory transport), members signing with identity keys as nodes do;
FedAvg outer step (lr 1, no momentum), so theta_g moves by exactly the update the group applied.

The bound checked with ``attack.kind = bad-reducer`` (a reducer that sends -10 times its shard's true average):
a bad reducer's shard reaches the model only in a round in which no honest member checked it; every honest
member that checked it found it wrong; and honest reducers' shards are never withheld by a check.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarmtrain.averaging import Group, leader_candidates
from swarmtrain.averaging.allreduce import AllReduce
from swarmtrain.averaging.bans import MUTE_BAN, MUTE_ROUNDS, MUTE_STRIKES, Bans
from swarmtrain.averaging.signing import RoundSigner
from swarmtrain.compression import get_codec
from swarmtrain.net import MemoryNetwork, PeerUnreachable, Rejected
from tests.test_byzantine import BOUND, NUMEL, identities, make_group, play_round


def shards_of(outcome, numel: int = NUMEL) -> list[torch.Tensor]:
    return [torch.arange(s, e) for s, e in outcome.group.shard_bounds(numel)]


async def test_a_member_that_checks_every_round_never_applies_a_bad_reducers_shard_and_bans_it() -> None:
    """Two members, one a bad reducer: with verify = 1 the honest member checks the other shard every round. It
    finds it wrong, withholds it (both members fall back on it and apply the honest shard, identically) and bans
    the reducer; the round after, it trains alone."""
    averagers = make_group("mean", "bad-reducer", verify=1.0, members=2, hostile=1)
    honest, bad = averagers
    for a in averagers:
        a.matchmaker.bans.rounds = 3
        await a.start()
    deltas = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    before = honest.outer.theta.clone()
    outcomes = await play_round(averagers, deltas, [1.0, 1.0])
    assert outcomes[0].digest == outcomes[1].digest, outcomes
    assert outcomes[0].decisions == (True, False), outcomes[0]  # slot 1 is the bad member's shard
    assert [c[2] for c in outcomes[0].checked] == ["wrong"], outcomes[0].checked
    applied = before - honest.outer.theta
    good, withheld = shards_of(outcomes[0])
    assert torch.equal(applied[withheld], torch.zeros(len(withheld)))
    assert torch.allclose(applied[good], (deltas[0][good] + deltas[1][good]) / 2, atol=1e-6)
    assert "wrongly" in (honest.matchmaker.bans.reason(bad.me, 1) or ""), honest.matchmaker.bans.bans
    peers = [a.me for a in averagers]
    alone = await honest.run_round(
        deltas[0], 1.0, leader_candidates(peers, honest.me, 16, "test", honest.round), set(peers), gather_timeout=1.0
    )
    assert alone.group.size == 1, alone


@pytest.mark.parametrize("verify", [1.0, 7.0])
async def test_in_a_group_of_eight_a_bad_reducers_shard_is_applied_only_where_no_honest_member_checked_it(
    verify: float,
) -> None:
    """Eight members, two bad reducers. With verify = 1 each member checks one part of one other shard per round (a
    bad shard is checked by at least one of the six honest members with probability 1 - (6/7) ** 6 = 0.60); with
    verify = 7 every member checks every other shard, and both bad shards are caught every round. Per round: honest
    replicas identical; a bad shard applied only if no honest member checked it; every honest check of a bad shard
    says wrong, of an honest one ok; honest shards all applied, within BOUND of the honest mean (plus what fell back
    the round before: error feedback sends it again)."""
    averagers = make_group("centered-clip", "bad-reducer", verify=verify)
    for a in averagers:
        await a.start()
    honest = averagers[:6]
    generator = torch.Generator().manual_seed(3)
    caught = 0
    carried = torch.zeros(NUMEL)  # error feedback: what fell back last round is sent again with this one
    for round_ in range(4):
        signal = torch.randn(NUMEL, generator=generator)
        deltas = [signal + 0.3 * torch.randn(NUMEL, generator=generator) for _ in averagers]
        before = honest[0].outer.theta.clone()
        outcomes = await play_round(averagers, deltas, [100.0] * len(averagers))
        mine = outcomes[: len(honest)]
        assert len({o.digest for o in mine}) == 1, mine
        group = mine[0].group
        bad = {group.index(a.me) for a in averagers[6:]}
        checks = [check for o in mine for check in o.checked]
        assert all(c[2] == ("wrong" if c[0] in bad else "ok") for c in checks), checks
        checked = {c[0] for c in checks}
        for j, applied in enumerate(mine[0].decisions):  # (a bad member may withhold the other bad shard too)
            assert not (j in bad and j in checked and applied) and (j in bad or applied), (j, checks, mine[0])
        caught += len(bad & checked)
        assert verify < 7 or (checked == set(range(8)) and caught == 2 * (round_ + 1)), checks
        shards = shards_of(mine[0])
        kept = torch.cat([shards[j] for j in range(group.size) if j not in bad])
        expected = sum(deltas[:6]) / 6 + carried
        moved = (before - honest[0].outer.theta)[kept]
        assert float((moved - expected[kept]).norm() / expected[kept].norm()) <= BOUND
        carried = expected.clone()
        for j, applied in enumerate(mine[0].decisions):
            if applied:
                carried[shards[j]] = 0.0
    assert caught > 0  # 8 chances at 0.60 each: all missed has probability 0.4 ** 8 < 1e-3 (and the seeds are fixed)


async def test_checks_of_honest_reducers_pass_with_lossy_codecs_and_robust_aggregators() -> None:
    """No false alarm: an honest group of eight with verify = 1 checks eight parts per round, with a lossy codec
    and the robust default; every check passes and every shard applies."""
    for codec, aggregator in (("int8", "centered-clip"), ("fp16", "trimmed-mean"), ("2bit", "median")):
        averagers = make_group(aggregator, "scale", codec=codec, verify=1.0, hostile=0)
        for a in averagers:
            await a.start()
        deltas = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) for i in range(len(averagers))]
        outcomes = await play_round(averagers, deltas, [100.0 + i for i in range(len(averagers))])
        assert len({o.digest for o in outcomes}) == 1
        checks = [c for o in outcomes for c in o.checked]
        assert len(checks) == len(averagers) and {c[2] for c in checks} == {"ok"}, (codec, checks)
        assert all(all(o.decisions) for o in outcomes), (codec, [o.decisions for o in outcomes])


async def test_a_check_whose_stream_breaks_asks_again_and_withholds_no_honest_shard() -> None:
    """Found in tests/test_swarm.py's four nodes with one core busy: a live reducer's answer to a check was cut short
    (IncompleteReadError), and that one broken stream withheld an honest shard from the whole group. Now the first
    check of every member breaks, and every check still passes on the next try."""
    averagers = make_group("mean", "scale", verify=1.0, members=4, hostile=0)
    net = averagers[0].transport.network
    broken: set[str] = set()

    def break_first_check(src: str, dst: str, method: str, header: dict) -> None:
        if method == "evidence" and src not in broken:
            broken.add(src)
            raise PeerUnreachable(f"evidence to {dst}: IncompleteReadError (stream reset)")

    net.before_call = break_first_check
    for a in averagers:
        await a.start()
    deltas = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) for i in range(len(averagers))]
    outcomes = await play_round(averagers, deltas, [1.0] * len(averagers))
    assert broken == {a.me for a in averagers}
    assert len({o.digest for o in outcomes}) == 1
    assert {c[2] for o in outcomes for c in o.checked} == {"ok"}, [o.checked for o in outcomes]
    assert all(all(o.decisions) for o in outcomes), [o.decisions for o in outcomes]


async def test_evidence_shown_again_after_a_stream_broke_past_the_answer_is_counted_as_resent() -> None:
    """The same four nodes showed a round's ``bytes_per_param`` 2 bytes over its bound: a checker's stream broke
    after the reducer had answered, and the reducer showed its four signed contributions again. Now the first
    check of every member breaks after its answer: each reducer counts what it showed again, byte for byte, as
    ``resent`` (``bytes_resent`` in metrics.jsonl), and a first showing is not counted."""
    averagers = make_group("mean", "scale", verify=1.0, members=4, hostile=0)
    shown_again = {a.me: 0 for a in averagers}
    broke: set[str] = set()  # the checkers whose first check broke
    for a in averagers:
        original = a.transport.call_stream

        async def break_after_answer(
            peer, method, header, frames, *, count, timeout, max_reply=None, _me=a.me, _o=original
        ):
            response = await _o(peer, method, header, frames, count=count, timeout=timeout, max_reply=max_reply)
            if method == "evidence" and _me not in broke:
                broke.add(_me)
                shown_again[peer] += len(response[1])
                raise PeerUnreachable(f"evidence to {peer}: IncompleteReadError (stream reset after the answer)")
            return response

        a.transport.call_stream = break_after_answer
        await a.start()
    deltas = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) for i in range(len(averagers))]
    outcomes = await play_round(averagers, deltas, [1.0] * len(averagers))
    assert broke == {a.me for a in averagers}
    assert {c[2] for o in outcomes for c in o.checked} == {"ok"}, [o.checked for o in outcomes]
    assert sum(shown_again.values()) > 0
    assert {a.me: o.resent for a, o in zip(averagers, outcomes, strict=True)} == shown_again


async def test_a_reducer_that_never_shows_what_it_averaged_is_banned_and_the_group_moves_on_without_it() -> None:
    """A mute reducer (an honest update and reduction, but every check of its shard held to the round's deadline and
    refused) withholds its shard from the whole group in every round a member checks it: unbanned, it would hold its
    share of the model still for as long as it stayed. With verify = 1 in a group of four, each honest member checks
    one random other shard a round, and from the round after any report withheld a shard, that shard too, every
    round. The leader (the lowest peer id) first finds it mute in some round f, at most one round after the first
    report that withheld it, bans it for MUTE_BAN rounds and checks its shard in every round it is back: the rounds
    without it are the honest members' alone, with every shard applied; at its MUTE_STRIKES-th unanswered check it
    is banned for averaging.ban_rounds."""
    averagers = make_group("mean", "mute-reducer", verify=1.0, members=4, hostile=1)
    honest, mute = averagers[:3], averagers[3]
    leader = honest[0]
    for a in averagers:
        a.matchmaker.bans.rounds = 20
        await a.start()
    generator = torch.Generator().manual_seed(5)
    first: dict[str, int] = {}  # honest member -> the round of its first unanswered check
    withheld = []  # the rounds in which some honest member's report withheld the mute shard
    sizes = []
    for round_ in range(20):
        deltas = [torch.randn(NUMEL, generator=generator) for _ in averagers]
        outcomes = await play_round(averagers, deltas, [1.0] * 4, banned=mute)
        mine = outcomes[:3]
        sizes.append(mine[0].group.size)
        assert len({o.digest for o in mine}) == 1, mine
        if mine[0].group.size == 3:
            assert all(all(o.decisions) for o in mine) and outcomes[3].group.size == 1, outcomes
            if round_ > first.get(leader.me, round_) + (MUTE_STRIKES - 1) * (MUTE_BAN + 1):
                break
            continue
        silent = mine[0].group.index(mute.me)
        checked = set()
        for a, o in zip(honest, mine, strict=True):
            hows = {j: how for j, _, how in o.checked}
            assert all(how == ("unanswered" if j == silent else "ok") for j, how in hows.items()), o.checked
            if withheld:  # a shard some report withheld is checked by every member from then on
                assert silent in hows, (round_, withheld, a.me, o.checked)
            if silent in hows:
                first.setdefault(a.me, round_)
            checked |= hows.keys()
        assert mine[0].decisions == tuple(j != silent or silent not in checked for j in range(4)), mine[0]
        if silent in checked:
            withheld.append(round_)
    f = first[leader.me]
    assert f <= withheld[0] + 1, (f, withheld)
    last = f + (MUTE_STRIKES - 1) * (MUTE_BAN + 1)  # its MUTE_STRIKES-th round with the leader
    assert sizes[f:] == ([4] + [3] * MUTE_BAN) * (MUTE_STRIKES - 1) + [4, 3], (f, sizes)
    strikes = ", ".join(str(f + k * (MUTE_BAN + 1)) for k in range(MUTE_STRIKES))
    assert leader.matchmaker.bans.reason(mute.me, last + 1) == (
        f"banned until round {last + 1 + 20}: left checks of its shard unanswered in rounds {strikes}"
    )


def test_a_reducer_left_unanswered_once_is_banned_for_a_short_while_and_for_long_only_when_it_recurs() -> None:
    """One unanswered check (a live reducer slow once, a stream that broke three times) bans for MUTE_BAN rounds; the
    second within MUTE_ROUNDS rounds (MUTE_STRIKES) for averaging.ban_rounds. Strikes older than that are forgotten,
    and a round counts once however many of its checks went unanswered."""
    bans = Bans("me", rounds=10)
    bans.strike({"slow", "me"}, 0)
    bans.strike({"slow"}, 0)
    once = f"banned until round {1 + MUTE_BAN}: left a check of its shard unanswered in round 0"
    assert bans.reason("slow", 1) == once
    assert bans.reason("slow", 1 + MUTE_BAN) is None and bans.reason("me", 1) is None
    assert bans.suspects(MUTE_ROUNDS - 1) == {"slow"} and bans.suspects(MUTE_ROUNDS) == set()
    bans.strike({"slow"}, MUTE_ROUNDS)  # round 0 is out of the window: one strike in it, not two
    assert bans.reason("slow", MUTE_ROUNDS + 1).endswith(f"in round {MUTE_ROUNDS}")
    bans.strike({"slow"}, MUTE_ROUNDS + 3)
    assert bans.reason("slow", MUTE_ROUNDS + 4) == (
        f"banned until round {MUTE_ROUNDS + 14}: left checks of its shard unanswered in rounds "
        f"{MUTE_ROUNDS}, {MUTE_ROUNDS + 3}"
    )
    assert bans.suspects(MUTE_ROUNDS + 4) == set()
    bans.dispute({"withheld": {"a"}, "me": {"a"}}, 30)  # a's report withheld its shard: checked, never banned for it
    assert bans.suspects(31) == bans.suspects(30 + MUTE_ROUNDS - 1) == {"withheld"}
    assert bans.suspects(30 + MUTE_ROUNDS) == set() and bans.reason("withheld", 31) is None


def test_one_members_withholdings_make_one_reducer_at_a_time_a_suspect() -> None:
    """A member that withholds one other reducer's shard a round is not banned (``GroupExchange.withholders``), and
    every member checks a disputed reducer's shard every round. Were each of its withholdings a dispute, one member
    withholding a different honest shard each round would have every member check every shard every round. A
    member's report disputes one reducer at a time: another reducer only MUTE_ROUNDS rounds after its last dispute;
    the same one again, or one another member withheld too, at any time."""
    bans = Bans("me", rounds=10)
    bans.dispute({"r1": {"m"}}, 0)
    bans.dispute({"r2": {"m"}}, 1)
    bans.dispute({"r3": {"m"}}, 2)
    assert bans.suspects(3) == {"r1"}
    bans.dispute({"r2": {"m", "a"}}, 3)  # a withheld it too: disputed, r2 now a's one dispute
    bans.dispute({"r1": {"m"}}, 5)  # m's dispute of r1 again: kept up
    assert bans.suspects(6) == {"r1", "r2"}
    bans.dispute({"r3": {"m", "a"}}, 6)  # both disputed another reducer lately
    bans.dispute({"r3": {"m"}}, 5 + MUTE_ROUNDS - 1)
    assert "r3" not in bans.suspects(5 + MUTE_ROUNDS)
    bans.dispute({"r3": {"m"}}, 5 + MUTE_ROUNDS)
    assert bans.suspects(5 + MUTE_ROUNDS + 1) == {"r3"}


async def test_a_check_that_comes_after_the_reducers_round_is_refused_and_not_answered_with_nothing() -> None:
    """A reducer lets go of the contributions it kept once its round is over. A checker that late (the reducer's
    round ended without its report) is refused: evidence without contributions reads as a wrong reduction, and an
    honest reducer was open to a ban for it."""
    averagers = make_group("mean", "scale", verify=1.0, members=2, hostile=0)
    for a in averagers:
        await a.start()
    deltas = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    outcomes = await play_round(averagers, deltas, [1.0, 1.0])
    assert [c[2] for o in outcomes for c in o.checked] == ["ok", "ok"]
    reducer, checker = averagers
    (exchange,) = [route.result() for route in reducer._routes.values()]
    assert isinstance(exchange, AllReduce) and exchange.released and not exchange.kept
    with pytest.raises(Rejected, match="no longer kept"):
        exchange.on_evidence(checker.me, {"shard": exchange.index, "part": 0})


def test_the_codec_down_tolerance_is_not_a_loophole() -> None:
    """What a check allows: twice the downlink codec's own error on the recomputed part, and 1e-5 of its largest
    value. A result that is -10 times the average is far outside it for every dense codec."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    for name in ("fp32", "fp16", "bf16", "int8", "int4", "2bit"):
        codec = get_codec(name)
        sent = codec.decode(codec.encode(x), x.numel())
        tolerance = 2 * float((sent - x).abs().max()) + 1e-5 * float(x.abs().max())
        forged = codec.decode(codec.encode(-10 * x), x.numel())
        assert float((forged - sent).abs().max()) > tolerance, name


def two_exchanges() -> tuple[AllReduce, AllReduce]:
    """The exchanges of a signed group of two (a, b), with verify on: a reduces shard ``a.index``."""
    (a, key_a), (b, key_b) = identities()[:2]
    net, group, fp32 = MemoryNetwork(), Group(0, (a, b), (1.0, 1.0)), get_codec("fp32")
    deadline = asyncio.get_running_loop().time() + 10.0
    return tuple(
        AllReduce(
            group, peer, torch.zeros(NUMEL), net.transport(peer), header={"run": "test"}, codec_up=fp32,
            codec_down=fp32, part_numel=NUMEL, deadline=deadline, signer=RoundSigner(key), verify=1.0,
        )
        for peer, key in ((a, key_a), (b, key_b))
    )  # fmt: skip


@pytest.mark.parametrize(
    "how", ["signed by another member", "unsigned", "signature cut short", "another step", "a step that is no norm"]
)
async def test_a_reducer_refuses_a_part_its_sender_did_not_sign_and_leaves_the_sender_out(how: str) -> None:
    """A part must carry its sender's signature of this round, shard, part, payload and claimed step (a gossip
    mix's, ``Aggregator.floor``): otherwise a reducer could not show a checker what that member sent, and could show
    anything in its name. A claimed step must be a norm: a finite float, not negative."""
    a, b = two_exchanges()
    start, end = a.bounds[a.index]
    payload = get_codec("fp32").encode(torch.ones(end - start))
    header = {"shard": a.index, "part": 0, "codec": "fp32", "steps": [0.5]}
    body = {
        "signed by another member": a._seal(a.index, 0, payload, 0.5),
        "unsigned": payload,
        "signature cut short": b._seal(a.index, 0, payload, 0.5)[:100],
        "another step": b._seal(a.index, 0, payload, 0.25),
    }.get(how, b._seal(a.index, 0, payload, float("nan")))
    if how == "a step that is no norm":
        header["steps"] = [float("nan")]
    with pytest.raises(Rejected, match="bad part"):
        a.on_part(b.me, header, body)
    assert b.me in a.bad_senders and not a.kept
    for steps in ([-1.0], [float("inf")], ["1"], 0.5, []):
        with pytest.raises(Rejected, match="claimed step"):
            a._claimed({"steps": steps}, 0)
    assert a._claimed({}, 0) == 0.0  # no claim: an update's parts, or an unchunked mix


async def test_a_reducer_keeps_what_it_averaged_for_checkers_and_a_tampered_copy_is_caught() -> None:
    """The evidence a reducer serves is the signed parts its result mask names; a payload or a claimed step changed
    after its sender signed it no longer matches the signature, and the checker says whose."""
    a, b = two_exchanges()
    start, end = a.bounds[a.index]
    payload = get_codec("fp32").encode(torch.ones(end - start))
    a.on_part(b.me, {"shard": a.index, "part": 0, "codec": "fp32"}, b._seal(a.index, 0, payload, 0.0))
    assert a.kept[b.index, 0][0] == payload
    mask = (1 << b.index).to_bytes(1, "little")
    a.results[a.index].masks[0] = mask  # as if a had reduced part 0 from b's contribution alone
    b.results[a.index].masks[0] = mask
    b.results[a.index].buffer[:] = torch.ones(end - start)  # the result b received
    evidence = a.on_evidence(b.me, {"shard": a.index, "part": 0})
    assert b._check_evidence(a.index, 0, 0, end - start, evidence) is None
    a.kept[b.index, 0][3] = 1e9  # a wider radius than b claimed
    problem = b._check_evidence(a.index, 0, 0, end - start, a.on_evidence(b.me, {"shard": a.index, "part": 0}))
    assert problem == f"its evidence holds a contribution {b.me[-8:]} did not sign"
    a.kept[b.index, 0][3] = 0.0
    a.kept[b.index, 0][0] = get_codec("fp32").encode(torch.full((end - start,), 2.0))
    problem = b._check_evidence(a.index, 0, 0, end - start, a.on_evidence(b.me, {"shard": a.index, "part": 0}))
    assert problem == f"its evidence holds a contribution {b.me[-8:]} did not sign"
    del a.kept[b.index, 0]
    problem = b._check_evidence(a.index, 0, 0, end - start, a.on_evidence(b.me, {"shard": a.index, "part": 0}))
    assert problem == "it showed 0 of the 1 contributions its result includes"


def test_a_public_swarm_checks_reducers_by_default_and_a_private_one_does_not() -> None:
    """``averaging.verify = auto``: 3 checks a round in a public swarm (strangers may reduce a shard), none in a
    private one (its members are trusted); the value nodes publish and compare is the resolved one, so a node
    that says 3 joins a public swarm of nodes that say auto. A bad value names the key and what it takes."""
    from swarmtrain.config import ConfigError, load_config
    from swarmtrain.node.settings import swarm_settings

    allowed = "node.allow_peers=['QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N']"
    public, private = load_config(environ={}), load_config(overrides=[allowed], environ={})
    assert public.averaging.verify == private.averaging.verify == "auto"
    assert (public.verify, private.verify) == (3.0, 0.0)
    explicit = load_config(overrides=["averaging.verify=3"], environ={})
    assert swarm_settings(public)["averaging.verify"] == swarm_settings(explicit)["averaging.verify"] == 3.0
    assert load_config(overrides=["averaging.verify=0.5"], environ={}).verify == 0.5
    for bad in ("-1", "300", "sometimes", "true"):
        with pytest.raises(ConfigError, match=r"averaging\.verify = .* is invalid .*: expected auto or a number"):
            load_config(overrides=[f"averaging.verify={bad}"], environ={})
