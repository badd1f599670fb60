"""Hostile members against the robust default: 8 members training a small byte model, clean vs attacked.

    PYTHONPATH=. python benchmarks/bench_byzantine.py               # the README table's robust rows (~9 min, 2 cores)
    PYTHONPATH=. python benchmarks/bench_byzantine.py --with-mean   # and each attack against the plain mean (~13 min)
    PYTHONPATH=. python benchmarks/bench_byzantine.py --rounds 4 --kinds scale --hostile 2
    PYTHONPATH=. python benchmarks/bench_byzantine.py --kinds bad-reducer --verify 1   # fewer checks than the default
    PYTHONPATH=. python benchmarks/bench_byzantine.py --kinds --group-size 4 --rounds 24   # gossip, clean runs only
    PYTHONPATH=. python benchmarks/bench_byzantine.py --kinds --group-size 3 --rounds 24 --state-floor 0   # no floor

In process, over the in-memory transport (``MemoryNetwork``): eight real ``Averager``s and eight real trainers
(``swarmtrain.node.inner``, the standard trainer) of one small model on the default corpus, trained in turn on
this machine; a round is H inner steps per member, then one group round of all eight (or, with ``--group-size``
below 8, gossip: groups of that size that change every round, and mix their states; DiLoCo outer step: Nesterov,
lr 0.7, momentum 0.9, fp16 updates) with a node's default bans (``averaging.ban_rounds``), reports and digests
signed with identity keys as a node's are, and each member checking ``--verify`` parts of other reducers'
shards a round (``averaging.verify``; it changes nothing where every reducer is honest). Hostile members train
like the others and replace their contribution with ``attack.kind`` (``swarmtrain/averaging/attack.py``); a
banned one trains and waits alone until its ban ends. Real node processes run the same code path (``attack.kind``
in a node's config); this benchmark stays in process so that one run of all of it fits in minutes on 2 cores.

Per run: the final held-out bits per byte of theta_g (an honest member's), whether any honest theta_g was ever
non-finite, whether the honest members of each group held identical theta_g after every round (one digest), and
how far apart the honest theta_g are at the end (``apart``: the largest distance of one from the first, relative to
its norm; in gossip, each group of the last round applied its own update).
The verdict column compares with the clean run's bpb under the plain mean (exact DiLoCo): within 5 %, finite,
identical.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import random
import time
from dataclasses import replace

import torch
from hivemind.utils.crypto import RSAPrivateKey

from swarmtrain.averaging import Averager, leader_candidates
from swarmtrain.averaging.attack import KINDS, Attack
from swarmtrain.averaging.averager import STATE_FLOOR
from swarmtrain.averaging.robust import parse_aggregator
from swarmtrain.averaging.signing import RoundSigner
from swarmtrain.compression import get_codec
from swarmtrain.config import PUBLIC_VERIFY, Config
from swarmtrain.data import load_corpus
from swarmtrain.dht.identity import peer_id_of
from swarmtrain.net import MemoryNetwork
from swarmtrain.node.inner import build_inner_loop

MEMBERS = 8


def small_config(threads: int) -> Config:
    return Config.model_validate(
        {
            "model": {"depth": 2, "width": 64, "heads": 2, "context": 64},
            "train": {
                "batch_size": 8, "lr": 3e-3, "warmup_steps": 10, "max_steps": 100_000, "threads": threads,
                "eval_batches": 8, "seed": 0,
            },
        }
    )  # fmt: skip


def identities() -> list[tuple[str, RSAPrivateKey]]:
    """An identity key per member, as nodes have (they sign their reports and digests), sorted by peer id."""
    keys = [RSAPrivateKey() for _ in range(MEMBERS)]
    return sorted((peer_id_of(key.get_public_key().to_bytes()), key) for key in keys)


async def one_run(
    config, corpus, keys, aggregator: str, kind: str | None, hostile: int, rounds: int, steps: int, verify: float,
    group_size: int, state_floor: float | None,
) -> dict:  # fmt: skip
    net = MemoryNetwork()
    trainers = [build_inner_loop(config, corpus, data_seed=i) for i in range(MEMBERS)]
    theta0 = trainers[0].vector()
    averagers = []
    for i, (peer, key) in enumerate(keys):
        attack = Attack(kind, seed=i) if kind and i >= MEMBERS - hostile else None
        codec = get_codec("fp16")
        averagers.append(
            Averager(
                net.transport(peer),
                theta0.clone(),
                run_id="bench",
                group_size=group_size,
                outer_lr=0.7,
                outer_momentum=0.9,
                codec_up=attack.wrap_codec(codec) if attack else codec,
                codec_down=codec,
                part_numel=1 << 14,
                min_deadline=2.0,
                deadline_factor=4.0,
                aggregator=parse_aggregator(aggregator),
                attack=attack,
                ban_rounds=config.averaging.ban_rounds,
                signer=RoundSigner(key),
                verify=verify,
                rng=random.Random(i),
            )  # fmt: skip
        )
    for a in averagers:
        if state_floor is not None:  # the robust mix's radius floor (``Averager.state_aggregator``), for comparison
            a.state_aggregator = replace(a.state_aggregator, floor=state_floor)
        await a.start()
    honest = MEMBERS - (hostile if kind else 0)
    peers = [a.me for a in averagers]
    identical, finite = True, True
    for _ in range(rounds):
        deltas, weights = [], []
        for a, t in zip(averagers, trainers, strict=True):
            t.load_vector(a.outer.theta)
            _, tokens, _ = t.run(steps)
            deltas.append(a.outer.theta - t.vector())
            weights.append(float(tokens))
        candidates = [leader_candidates(peers, a.me, group_size, "bench", a.round) for a in averagers]
        outcomes = await asyncio.gather(
            *(
                a.run_round(d, w, c, set(c), gather_timeout=2.0)  # as a node: its gossip group is whom it expects
                for a, d, w, c in zip(averagers, deltas, weights, candidates, strict=True)
            )
        )
        groups = {o.group.group_id for o in outcomes[:honest]}
        identical &= all(len({o.digest for o in outcomes[:honest] if o.group.group_id == g}) == 1 for g in groups)
        finite &= all(bool(torch.isfinite(a.outer.theta).all()) for a in averagers[:honest])
    trainers[0].load_vector(averagers[0].outer.theta)
    bpb = trainers[0].evaluate() if finite else math.nan
    for t in trainers:
        t.close()
    first = averagers[0].outer.theta
    apart = max(float((a.outer.theta - first).norm() / first.norm()) for a in averagers[:honest])
    return {"bpb": bpb, "finite": finite, "identical": identical, "apart": apart}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="inner steps per member per round (H)")
    parser.add_argument("--kinds", nargs="*", default=list(KINDS))
    parser.add_argument("--hostile", type=int, nargs="*", default=[2, 3], help="attackers of 8, one run per count")
    parser.add_argument("--robust", default=parse_aggregator("auto").spec, help="the aggregator under attack")
    parser.add_argument(
        "--with-mean", action="store_true", help="also run each attack against the plain mean (first hostile count)"
    )
    parser.add_argument(
        "--verify", type=float, default=PUBLIC_VERIFY,
        help="averaging.verify of every member (bad-reducer is caught by it); default: a public swarm's",
    )  # fmt: skip
    parser.add_argument(
        "--group-size", type=int, default=16, help="averaging.group_size; below 8, gossip groups that mix their states"
    )
    parser.add_argument(
        "--state-floor", type=float, default=None,
        help="the robust mix's radius floor in steps (Aggregator.floor); default: a node's (averager.STATE_FLOOR)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 was fastest on 2 busy cores)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the refused payloads of the hostile members are expected here
    config = small_config(args.threads)
    torch.set_num_threads(args.threads)
    corpus = load_corpus(config.data)
    keys = identities()
    runs: list[tuple[str, str | None, int]] = [("mean", None, 0), (args.robust, None, 0)]
    for hostile in args.hostile:
        runs += [(args.robust, kind, hostile) for kind in args.kinds]
        if args.with_mean and hostile == args.hostile[0]:
            runs += [("mean", kind, hostile) for kind in args.kinds]
    print(
        f"{MEMBERS} members, {args.rounds} rounds x H={args.steps}, model depth 2 width 64, fp16 updates, "
        f"verify {args.verify:g}, group size {args.group_size}, state floor "
        f"{STATE_FLOOR if args.state_floor is None else args.state_floor:g}"
    )
    columns = ["aggregator", "attack", "hostile", "final bpb", "vs clean mean", "finite", "identical", "apart"]
    columns += ["verdict", "s"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    clean = None
    for aggregator, kind, hostile in runs:
        started = time.perf_counter()
        r = asyncio.run(
            one_run(
                config, corpus, keys, aggregator, kind, hostile, args.rounds, args.steps, args.verify, args.group_size,
                args.state_floor,
            )
        )  # fmt: skip
        clean = clean if clean is not None else r["bpb"]
        gap = r["bpb"] / clean - 1
        ok = r["finite"] and r["identical"] and gap <= 0.05
        print(
            f"| {aggregator} | {kind or 'none'} | {hostile}/{MEMBERS} | {r['bpb']:.4f} | {gap:+.1%} | {r['finite']} | "
            f"{r['identical']} | {r['apart']:.2g} | {'ok' if ok else 'FAIL'} | "
            f"{time.perf_counter() - started:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
