"""Integration tests of churn and heterogeneity: real node processes on loopback."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from .swarm import Swarm


@pytest.mark.slow  # 20-40 s; token weighting of unlike nodes is also checked by tests/test_node_inner_time.py
def test_nodes_with_different_batch_sizes_h_and_precision_agree_and_weigh_by_tokens(swarm: Swarm) -> None:
    nodes = {  # batch size, H (inner steps), precision
        "n0": (4, 3, "fp32"),
        "n1": (8, 6, "fp32"),
        "n2": (4, 6, "bf16"),
    }
    settings = {
        name: [f"train.batch_size={b}", f"node.inner_steps={h}", f"train.precision={p}", "node.min_peers=3"]
        for name, (b, h, p) in nodes.items()
    }
    swarm.start("n0", 4, extra=settings["n0"])
    first = swarm.join_line("n0")
    for name in ("n1", "n2"):
        swarm.start(name, 4, join=first, extra=settings[name])
    swarm.wait(list(nodes), timeout=180)
    by_round: dict[int, set[str]] = {}
    for name, (batch, h, _) in nodes.items():
        rows = swarm.rounds(name)
        assert [r["round"] for r in rows] == [0, 1, 2, 3]
        for r in rows:
            by_round.setdefault(r["round"], set()).add(r["digest"])
            assert r["group_size"] == 3 and r["outcome"] == "applied", r
            # The weight each member averaged me with is the tokens I trained on: batch x context x H.
            assert r["tokens"] == batch * 32 * h
            assert r["weights"][r["group"].index(r["peer_id"])] == r["tokens"]
    assert all(len(digests) == 1 for digests in by_round.values()), by_round


@pytest.mark.slow  # the in-process simulator freezes members on every seed; this is the real-process check
def test_a_node_frozen_past_the_deadline_resyncs_and_contributes_again(swarm: Swarm) -> None:
    """SIGSTOP: the process stops answering while its daemon keeps the connections open, the worst kind of cut."""
    names = ["n0", "n1", "n2"]
    swarm.start_all(names, rounds=0)  # until interrupted
    frozen = swarm.procs["n2"]
    swarm.wait_until(lambda: len(swarm.rounds("n2")) >= 2, 120, "two rounds")
    os.kill(frozen.pid, signal.SIGSTOP)
    stopped_at = len(swarm.rounds("n0"))
    try:
        # The others go on without it, every round within its deadline (8 s floor, see TINY).
        swarm.wait_until(lambda: len(swarm.rounds("n0")) >= stopped_at + 3, 90, "rounds without n2")
        time.sleep(4.0)  # well past n2's deadline for whatever it was doing
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    resumed_at = max(r["round"] for r in swarm.rounds("n0"))

    def contributes_again() -> bool:
        later = [r for r in swarm.rounds("n2") if r["round"] > resumed_at and r["group_size"] == 3]
        return any(r["weights"][r["group"].index(r["peer_id"])] > 0 for r in later)

    swarm.wait_until(contributes_again, 90, "n2 contributing again")
    rows = {name: {r["round"]: r for r in swarm.rounds(name)} for name in names}
    gap = [r for k, r in rows["n0"].items() if stopped_at < k <= resumed_at]
    assert gap and all(r["group_size"] == 2 and r["duration_s"] < 8 * 3 for r in gap)
    # The members that never stopped confirmed every round and hold one state in each.
    for name in ("n0", "n1"):
        diverged = [(k, r["group_size"], r["duration_s"]) for k, r in rows[name].items() if r["outcome"] == "diverged"]
        assert not diverged, (
            f"{name} diverged in (round, group size, s) {diverged}; n2 froze in round {stopped_at}, resumed in "
            f"{resumed_at}"
        )
    assert all(r["digest"] == rows["n0"][k]["digest"] for k, r in rows["n1"].items() if k in rows["n0"])
    # n2 noticed it was cut off and caught up; from its first confirmed round after that, it holds the others'
    # digest in every round it shares with them and never diverges again.
    assert any(r["outcome"] == "diverged" for r in rows["n2"].values())
    later = sorted(k for k in rows["n2"] if k > resumed_at)
    back = next((k for k in later if rows["n2"][k]["outcome"] != "diverged"), None)
    assert back is not None, f"n2 never confirmed a round after it resumed: {[rows['n2'][k] for k in later]}"
    settled = [rows["n2"][k] for k in later if k >= back]
    assert all(r["outcome"] != "diverged" for r in settled), settled
    shared = [r["round"] for r in settled if r["round"] in rows["n0"]]
    assert shared and all(rows["n2"][k]["digest"] == rows["n0"][k]["digest"] for k in shared)


@pytest.mark.parametrize("overlap", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_ctrl_c_finishes_the_round_with_the_steps_done_then_leaves(swarm: Swarm, overlap: bool) -> None:
    names = ["n0", "n1", "n2"]
    # Inner phases of 5 s on any machine (a time budget, not a count of steps that a fast machine does in less
    # than the wait below): Ctrl+C 1.5 s after a round's line lands in the next round's inner steps (with
    # node.overlap, the steps that run beside that round's exchange: they are contributed to a round more).
    budget = 5.0
    extra = ["node.inner_steps=100000", f"node.inner_time_s={budget}", f"node.overlap={str(overlap).lower()}"]
    swarm.start_all(names, rounds=0, extra=extra)
    swarm.wait_until(lambda: len(swarm.rounds("n2")) >= 1, 120, "a round")
    time.sleep(1.5)
    swarm.kill("n2", signal.SIGINT)
    assert swarm.procs["n2"].wait(timeout=60) == 0, swarm.log("n2")
    last = swarm.rounds("n2")[-1]
    # Its last round: cut short, contributed and finished with the others (one digest).
    assert last["group_size"] == 3 and last["outcome"] == "applied"
    assert last["weights"][last["group"].index(last["peer_id"])] > 0
    assert last["inner_s"] < budget - 1.0, last  # a whole inner phase takes the budget or more
    swarm.wait_until(lambda: swarm.rounds("n0")[-1]["round"] >= last["round"] + 2, 90, "two rounds without n2")
    rows = {r["round"]: r for r in swarm.rounds("n0")}
    assert rows[last["round"]]["digest"] == last["digest"]
    # The others knew it left: the next rounds form without it and without waiting for it.
    after = [rows[last["round"] + 1], rows[last["round"] + 2]]
    assert all(r["group_size"] == 2 and r["outcome"] == "applied" for r in after)
    assert all(r["phases"]["group_s"] < 3.0 for r in after), after


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_six_nodes_survive_two_kills_and_two_joins_in_twelve_rounds(swarm: Swarm) -> None:
    rng = random.Random(7)
    names = [f"n{i}" for i in range(6)]
    rounds = 12
    # Rounds of a few seconds: longer than a state download and than a joiner's start-up (torch, daemon, DHT).
    # Records that outlive a heartbeat missed under load (8 processes on 2 cores): every node sees the same leader.
    steps = ["node.inner_steps=500", "node.heartbeat_s=1", "node.record_ttl_s=10"]
    swarm.start_all(names, rounds=rounds, extra=steps)
    victims = rng.sample(names[1:], 2)  # n0 stays: the test paces itself by its rounds
    events = sorted(
        [(rng.randint(2, 5), "kill", victims[0]), (rng.randint(5, 8), "kill", victims[1])]
        + [(rng.randint(3, 6), "join", f"j{i}") for i in range(2)]  # a joiner needs a few seconds to start
    )
    joined_at: dict[str, int] = {}
    for at_round, action, name in events:
        swarm.wait_until(lambda k=at_round: len(swarm.rounds("n0")) >= k, 120, f"round {at_round}")
        time.sleep(rng.uniform(0.0, 1.5))  # anywhere in the round: training, grouping or all-reduce
        if action == "kill":
            swarm.kill(name)
        else:
            alive = [n for n in names if swarm.procs[n].poll() is None]
            swarm.start(name, rounds, join=[swarm.join_line(n) for n in alive[:3]], extra=steps)
            swarm.join_line(name)  # it is up, during the round after the last one n0 logged
            joined_at[name] = max(r["round"] for r in swarm.rounds("n0")) + 1
    survivors = [n for n in names if n not in victims] + sorted(joined_at)
    swarm.wait(survivors, timeout=300)
    assert all(swarm.procs[v].wait(timeout=10) == -signal.SIGKILL for v in victims)
    by_round: dict[int, set[str]] = {}
    for name in survivors:
        rows = swarm.rounds(name)
        # A member that was up from the start never ends a round diverged, kills or joins around it; a joiner may
        # while it catches up, and not after its first confirmed round.
        first = 0 if name in names else next((i for i, r in enumerate(rows) if r["outcome"] != "diverged"), 0)
        assert all(r["outcome"] != "diverged" for r in rows[first:]), (name, rows[first:])
        for r in rows[first:]:
            by_round.setdefault(r["round"], set()).add(r["digest"])
        # Within the all-reduce deadline (8 s floor, x3 before any round was measured) plus grouping.
        assert all(r["duration_s"] < 8 * 3 + 10 for r in rows), rows
    assert sorted(by_round) == list(range(rounds))
    assert all(len(digests) == 1 for digests in by_round.values()), by_round
    for name, at in joined_at.items():
        contributed = [
            r["round"]
            for r in swarm.rounds(name)
            if r["group_size"] > 1 and r["weights"][r["group"].index(r["peer_id"])] > 0
        ]
        # Up during round `at`: it downloads the state of the first round it can still sit in on (`at`, or
        # `at + 1` if the others were averaging already), sits in on it, and contributes from the next.
        assert contributed and contributed[0] <= at + 2, (name, at, contributed)
