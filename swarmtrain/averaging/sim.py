"""A seeded fault simulator for the round protocol (in the spirit of FoundationDB's and TigerBeetle's simulation
testing): real ``Averager``s over the in-memory network, on a virtual clock, with faults at message boundaries.

Each seed draws a group of 2-8 members, token weights (some 0), a codec (dense, quantised or sparse), an outer
optimizer, a few rounds (plain, or mixed: members start from different theta_g), and per round a schedule of
faults keyed by (sender, method, n-th call): a stream reset before or after delivery, a delay (also past the
deadline), a member killed or frozen (its messages stall until it resumes), a duplicated or a late message. At most
one failure per round is drawn (a member killed or frozen, or one message slower than the deadline, which makes its
sender count the receiver gone): one relay step of reports and digests tolerates one failure (see ``exchange``);
more are caught by the digest vote (the minority resyncs), not prevented. A drawn delay can still meet a call near
its deadline and time out, a second failure (``failures``). After every round it checks:

(a) members that confirmed the round (and those that resynced) hold identical bytes, where they should;
(b) every member leaves the round within its bound (``Averager.budget_s``);
(c) no member that confirmed the round applied a slot (shard or payload) another one fell back on, nor mixed where
    another did not (in a round with at most one failure);
(d) with a dense codec and no momentum, theta_g is unchanged where the round fell back (and with fp32 the member's
    residual holds all it contributed there); with fp32, part by part where it applied, against whom the part
    included (the member's ``ledger``), the residual of each member that confirmed the round holds nothing where it
    was included and all it contributed where it was left out (nothing lost, nothing twice), and with the plain
    mean theta_g moved by the token-weighted average of exactly the included contributions;
(e) with one failure in the round, a member that stayed live and unfrozen confirms it when another member of its
    group did too (unless its group did not mix as a gossip round: the minority then takes the majority's state).

With ``--cuts`` a round may also cut one stream of parts or results after 0-3 frames (both ends stay live).

With ``--joins`` a round without another failure may have its leader freeze (SIGSTOP) as it answers the joins: one
member's answer stays in the frozen process until it resumes, the others have theirs. Then:

(f) every member that stayed live and unfrozen ends the round in the same group (the one the leader formed), but
    one that another member banned (``--signed``) before the round.

The member the leader did not answer learns of its group from the first message another member sends it; where
every other member contributes nothing (weight 0), that may come too late: a second failure, so (c), (e) and (f)
are not checked then.

Each seed also draws the group's aggregator (``robust``), so (a)-(c) hold for the robust ones too.

With ``--signed`` the members are a public swarm's: each signs its parts, reports and digests with an identity key
(a fixed pool of keys made from seeds, so a seed replays in any process), checks 0, 1 or 3 parts of other
reducers' shards a round (``verify``), bans as a node does, and a state brought from another group carries a
certificate signed by another peer, so the gossip mix is the robust one with its radius floor. The faults may
also hit the check of a reducer ("evidence") and the request for proofs of a relayed value ("proofs"). (a)-(f)
hold as above, but in a group that does not mix (e) holds a member whose state did not count (it has no vote,
``Group.voters``) only to take the group's state where the members whose state counted are most of the group.
An honest member can be banned under faults: one that lost the results of two shards withheld them in its report,
as a hostile one would (``exchange.withholders``), and (f) leaves it out.

With ``--hostile`` (signed rounds) one member of each seed is hostile: it makes one of the attacks of ``attack``
(``HOSTILE``) every round, and the group combines with a robust aggregator, as a public swarm does. The hostile
member is a failure of its own: (a)-(f) hold the other members, (c) and (e) where the round had no other failure.
``--attack KIND`` gives it that attack in every seed instead of a drawn one (``redirect``, ``hold`` and
``ask-again``, added since the draw was fixed, are named this way only). And then:

(g) no other member holds a value that is not finite; and where the hostile member is one of three or more whose
    contributions a part of the update included (a part of an applied shard for dense codecs, a segment for sparse
    ones), that part of the group's update is no further from the token-weighted mean of the other contributions
    than ``STEER_BOUND`` times the largest of them (a group that did not mix). A bad reducer's shard that no other
    member checked is left out: it escapes, as the README says (one that a member checked must not apply, or it
    breaks the bound). The bound is not a theorem for every aggregator (a coordinate-wise median or trim is bounded
    coordinate by coordinate): over the seeds run, the robust aggregators stayed below 1.8 where the plain mean
    went to 12 (``--aggregator mean``).

With ``--attack hold`` or ``ask-again`` (a hostile member that holds every join, or tells every joiner to ask it
again) the members' join timeouts are drawn from ``JOIN_TIMEOUTS``, so that they give up on it at different
times, and:

(i) a member stays in a round past its bound (b) only where some member did not ban the hostile member when the
    round began (it holds that one, and through it those whose candidates follow it), and at most the longest join
    timeout more (and a join call's slack and a gather timeout); one that had not banned it and stayed past its
    bound bans it from the next round on, unless it or the hostile member was frozen in the round (then it was
    held by the freeze); no member bans a peer for holding its join but the hostile one; and in a round where every
    member banned it and no fault fired, the members end in one group (unless every one of them sits in,
    ``--sit-in``: none leads), but an honest one that banned another and the one it banned, as in (h).

With ``--sit-in`` some members of a round (none, some or all, from a generator of their own) have just caught up
and sit in on it, as a node does: weight 0, and they never lead (``Matchmaker.form_group``). Then:

(h) no group of two or more forms of members that all sit in (led by one of them, the outer momentum alone would
    move their theta_g off the state they caught up to); and in a round where no fault fired, every live member,
    sitting in or not, ends in one group with the others (but one that another member banned, and an honest one
    that banned another honest one: it joins no group that one leads), unless all of them sit in or a hostile member
    that not every other member had banned was in the round.

Replay one seed (prints every violation; ``--log INFO`` shows the members' logs):
``python -m swarmtrain.averaging.sim --seed 17 --rounds 2`` (add ``--cuts``, ``--joins``, ``--signed``,
``--hostile``, ``--attack``, ``--sit-in`` as the seed was run).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import random
import selectors
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.utils.crypto import RSAPrivateKey

from swarmtrain.averaging.attack import Attack
from swarmtrain.averaging.averager import DIGEST_SHARE, Averager, RoundOutcome
from swarmtrain.averaging.exchange import PING_FAILURES
from swarmtrain.averaging.group import Group
from swarmtrain.averaging.matchmaking import JOIN_SLACK_S, LEADER_FAILOVER_S
from swarmtrain.averaging.robust import KINDS as AGGREGATORS
from swarmtrain.averaging.robust import parse_aggregator
from swarmtrain.averaging.round import Phase
from swarmtrain.averaging.signing import RoundSigner
from swarmtrain.compression import get_codec
from swarmtrain.config import Config
from swarmtrain.dht.identity import peer_id_of
from swarmtrain.net import MemoryNetwork, PeerUnreachable, RpcTimeout

CODECS = ("fp32", "fp16", "int8", "int4", "topk:frac=0.25", "dct-topk:chunk=16,k=4", "powersgd:rank=1")
FAULT_METHODS = ("parts", "results", "results", "report", "report", "report", "digest", "ping")
KINDS = ("reset", "reset-after", "delay", "late-delay", "duplicate", "late", "kill", "freeze")
SIGNED_METHODS = ("evidence", "evidence", "proofs")  # calls only a signed round makes
VERIFY = (0.0, 1.0, 3.0)  # parts of other reducers' shards a signed member checks a round
# The attacks a hostile member can make in a round (``attack``; the others act on a node's records and calls).
HOSTILE = (
    "scale", "sign-flip", "nan", "random", "big-weight", "alie", "equivocate", "bad-reducer", "mute-reducer",
    "withhold", "own-state", "self-certified",
)  # fmt: skip
# The attacks ``--attack`` may name: those drawn, and those added since, which are not drawn so that every seed
# replays as it did (a violation's replay command names the attack).
ATTACKS = (*HOSTILE, "redirect", "hold", "ask-again")
HOLDS = ("hold", "ask-again")  # the attacks that hold a joiner in a round: (b) allows it once, then (i)
JOIN_TIMEOUTS = (20.0, 40.0, 60.0)  # a member's join timeout, drawn where the hostile one holds joins
GATHER_S = 1.0
STEER_BOUND = 3.0  # (g): how far from the others' mean a hostile member may move a part, in their largest norms
MAX_MEMBERS = 8


class Deadlock(RuntimeError):
    """Nothing is ready and no timer is set: some await has no deadline."""


class _IdleSelector(selectors.SelectSelector):
    """No real I/O: waiting for ``timeout`` seconds moves the virtual clock instead of sleeping."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:
            raise Deadlock("nothing ready and no timer set: an await without a deadline")
        self.now += max(timeout, 0.0)
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` jumps to the next timer when nothing is ready: timeouts cost no wall time."""

    def __init__(self) -> None:
        self._idle = _IdleSelector()
        super().__init__(self._idle)

    def time(self) -> float:
        return self._idle.now

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any, context: Any = None) -> Any:
        """A timer, which moves the clock to ``when`` as it fires: asyncio fires timers up to its clock resolution
        early, and a deadline a member computes from ``time()`` then stays a hair ahead of a clock that never gets
        there (a leader waited out 4e-15 s of its gather forever)."""

        def fire(*args: Any) -> None:
            self._idle.now = max(self._idle.now, when)
            callback(*args)

        return super().call_at(when, fire, *args, context=context)

    def run_in_executor(self, executor: Any, func: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """Run ``func`` at once, in the loop's thread (``asyncio.to_thread`` comes here): a thread's result would
        arrive at a wall time the virtual clock knows nothing of, so a timer could fire first, in some runs of a
        seed and not in others (a resync's probe of a donor's manifest timed out so)."""
        future = self.create_future()
        try:
            future.set_result(func(*args))
        except Exception as exc:  # noqa: BLE001 - the caller awaits it, as it would a thread's
            future.set_exception(exc)
        return future


@dataclass
class Fault:
    kind: str
    src: str
    method: str
    nth: int  # the n-th call of ``method`` by ``src`` in this round (0-based)
    seconds: float = 0.0


@dataclass
class Faults:
    """This round's schedule, applied by wrapping every member's transport."""

    net: MemoryNetwork
    plan: list[Fault] = field(default_factory=list)
    calls: dict[tuple[str, str], int] = field(default_factory=dict)
    frozen: dict[str, float] = field(default_factory=dict)  # member -> virtual time it resumes
    fired: list[str] = field(default_factory=list)

    def new_round(self, plan: list[Fault]) -> None:
        self.plan, self.calls, self.frozen, self.fired = plan, {}, {}, []

    async def _wait_thawed(self, peers: tuple[str, str], timeout: float) -> None:
        if not self.frozen:
            return
        loop = asyncio.get_running_loop()
        until = max(self.frozen.get(p, 0.0) for p in peers)
        if until > loop.time():
            if until - loop.time() > timeout:
                await asyncio.sleep(timeout)
                raise RpcTimeout(f"{peers[1]} is frozen")
            await asyncio.sleep(until - loop.time())

    def wrap(self, transport: Any) -> None:
        original = transport.call_stream
        src = transport.peer_id

        async def call_stream(
            peer: str,
            method: str,
            header: dict[str, Any],
            frames: AsyncIterator[bytes],
            *,
            count: int,
            timeout: float,
            **bounds: Any,  # max_reply, passed on as given
        ) -> tuple[dict[str, Any], bytes]:
            n = self.calls.get((src, method), 0)
            self.calls[(src, method)] = n + 1
            fault = next((f for f in self.plan if (f.src, f.method, f.nth) == (src, method, n)), None)
            await self._wait_thawed((src, peer), timeout)
            if fault is None:
                return await original(peer, method, header, frames, count=count, timeout=timeout, **bounds)
            # Other calls may fire while this one waits: its entry is this one, in this round's list (a send left in
            # the background may wake in the next round, which has a list of its own).
            fired, entry = self.fired, len(self.fired)
            fired.append(f"{fault.kind} {src}->{peer} {method}#{n}")
            if fault.kind == "kill":
                self.net.kill(src)
                raise PeerUnreachable(f"{method} to {peer}: killed")
            if fault.kind == "freeze":
                self.frozen[src] = asyncio.get_running_loop().time() + fault.seconds
                await self._wait_thawed((src, peer), timeout)
            if fault.kind == "freeze-answer":  # the leader answers, and freezes before this answer leaves it
                answer = await original(peer, method, header, frames, count=count, timeout=timeout, **bounds)
                self.frozen[peer] = asyncio.get_running_loop().time() + fault.seconds
                await self._wait_thawed((src, peer), timeout)
                return answer
            if fault.kind == "reset":
                raise PeerUnreachable(f"{method} to {peer}: stream reset")
            if fault.kind == "cut":  # the stream breaks after some frames: the next one is made, and lost
                await original(peer, method, header, _cut(frames, int(fault.seconds)), count=count, timeout=timeout,
                               **bounds)  # fmt: skip
                raise PeerUnreachable(f"{method} to {peer}: stream reset after {int(fault.seconds)} frames")
            if fault.kind in ("duplicate", "late") and count == 1:  # the same message twice: its frames kept
                kept = [frame async for frame in frames]
                frames = _replay(kept)
            if fault.kind in ("delay", "late-delay"):  # the link is slow: the delay counts against the timeout
                await asyncio.sleep(min(fault.seconds, timeout))
                if fault.seconds >= timeout:
                    fired[entry] += " (timed out)"
                    raise RpcTimeout(f"{method} to {peer} timed out (delayed {fault.seconds:.2f} s)")
                timeout -= fault.seconds
            answer = await original(peer, method, header, frames, count=count, timeout=timeout, **bounds)
            if fault.kind == "reset-after":
                raise PeerUnreachable(f"{method} to {peer}: stream reset after delivery")
            if fault.kind in ("duplicate", "late") and count == 1:

                async def again() -> None:
                    await asyncio.sleep(fault.seconds if fault.kind == "late" else 0.0)
                    try:
                        await original(peer, method, header, _replay(kept), count=1, timeout=timeout, **bounds)
                    except Exception:  # noqa: BLE001 - a copy the receiver refuses is what we want to see
                        pass

                asyncio.ensure_future(again())
            return answer

        transport.call_stream = call_stream


async def _replay(frames: list[bytes]) -> AsyncIterator[bytes]:
    for frame in frames:
        yield frame


async def _cut(frames: AsyncIterator[bytes], delivered: int) -> AsyncIterator[bytes]:
    """The first ``delivered`` frames of ``frames``; the one after is taken from the sender (made) and dropped."""
    index = 0
    async for frame in frames:
        if index == delivered:
            return
        index += 1
        yield frame


def draw_cut(rng: random.Random, members: list[str]) -> list[Fault]:
    """Maybe one stream of parts or results cut after 0-3 frames (``--cuts``): its sender and receiver stay live,
    so the receiver decides without the rest of it. From its own generator, so the schedules above stay as they
    are."""
    if rng.random() < 0.5:
        return []
    return [Fault("cut", rng.choice(members), rng.choice(("parts", "results")), rng.randrange(len(members)),
                  float(rng.randrange(4)))]  # fmt: skip


def draw_join_freeze(rng: random.Random, members: list[str], plan: list[Fault], budget: float) -> list[Fault]:
    """Maybe the leader (the first member: every member asks it first) freezes as it answers the joins, holding one
    joiner's answer (``--joins``); only in a round with no other failure. From its own generator, like cuts."""
    if rng.random() < 0.5 or any(f.kind in ("kill", "freeze", "late-delay") for f in plan):
        return []
    return [Fault("freeze-answer", rng.choice(members[1:]), "join", 0, rng.uniform(0.5, 2 * budget))]


def draw_signed_fault(rng: random.Random, members: list[str], budget: float) -> list[Fault]:
    """Maybe one fault on a call only signed rounds make (``--signed``): a check of a reducer, or a request for
    proofs; a reset, a delay or a copy, none a failure by itself. From its own generator, like cuts."""
    if rng.random() < 0.5:
        return []
    kind = rng.choice(("reset", "reset-after", "delay", "duplicate"))
    method, nth = rng.choice(SIGNED_METHODS), rng.randrange(4)
    return [Fault(kind, rng.choice(members), method, nth, rng.uniform(0, 0.3 * budget))]


_SMALL_PRIMES = [p for p in range(3, 2000, 2) if all(p % d for d in range(3, int(p**0.5) + 1, 2))]


def _probably_prime(n: int, rng: random.Random, rounds: int = 40) -> bool:
    """Miller-Rabin with ``rounds`` random bases."""
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for _ in range(rounds):
        x = pow(rng.randrange(2, n - 1), d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = pow(x, 2, n)
            if x == n - 1:
                break
        else:
            return False
    return True


def _prime(rng: random.Random, bits: int, e: int) -> int:
    """A prime of exactly ``bits`` bits (its top two set, so that two make a modulus of twice as many) with
    gcd(p - 1, e) = 1."""
    while True:
        n = rng.getrandbits(bits) | (3 << (bits - 2)) | 1
        if all(n % p for p in _SMALL_PRIMES) and (n - 1) % e and _probably_prime(n, rng):
            return n


@functools.cache
def identities() -> tuple[tuple[str, RSAPrivateKey], ...]:
    """``MAX_MEMBERS`` identity keys (RSA, 1024 bits) and their peer ids, sorted by peer id, the keys made from
    fixed seeds: a seed's members, and so its leaders and shards, are the same in every process that replays it.
    (A node's key comes from the system's generator; these sign only simulated rounds.)"""
    return tuple(sorted((_identity(i) for i in range(MAX_MEMBERS)), key=lambda k: k[0]))


@functools.cache
def _identity(i: int) -> tuple[str, RSAPrivateKey]:
    """The ``i``-th fixed key and its peer id (``identities``; ``MAX_MEMBERS``: a hostile member's second one)."""
    rng, e = random.Random(f"swarmtrain sim identity {i}"), 65537
    p = q = _prime(rng, 512, e)
    while q == p:
        q = _prime(rng, 512, e)
    d = pow(e, -1, (p - 1) * (q - 1))
    public = rsa.RSAPublicNumbers(e, p * q)
    numbers = rsa.RSAPrivateNumbers(
        p, q, d, rsa.rsa_crt_dmp1(d, p), rsa.rsa_crt_dmq1(d, q), rsa.rsa_crt_iqmp(p, q), public
    )
    der = numbers.private_key().private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
    )
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})  # how hivemind unpickles a key: it has no other way to load one
    return peer_id_of(key.get_public_key().to_bytes()), key


def certify(averager: Averager, signer: RoundSigner) -> None:
    """Give ``averager``'s state a certificate from ``signer`` (another peer's key), as a member of the group it
    came from signs its digest: that peer held the state at the end of the last round."""
    digest, held = averager.outer.digest(), averager.round - 1
    averager.certified = (digest, {"round": held, "key": signer.public, "sig": signer.sign_held(held, digest)})


def draw_faults(rng: random.Random, members: list[str], budget: float) -> list[Fault]:
    plan: list[Fault] = []
    failed = False  # at most one failure per round: a member killed or frozen, or one link slower than the deadline
    for _ in range(rng.randint(0, 6)):
        kind = rng.choice(KINDS)
        if kind in ("kill", "freeze", "late-delay"):
            if failed:
                continue
            failed = True
        method = rng.choice(FAULT_METHODS)
        seconds = {"delay": rng.uniform(0, 0.3 * budget), "late-delay": rng.uniform(budget, 2 * budget)}.get(
            kind, rng.uniform(0.5, 2 * budget)
        )
        plan.append(Fault(kind, rng.choice(members), method, rng.randrange(len(members) + 1), seconds))
    return plan


@dataclass
class Member:
    averager: Averager
    alive: bool = True
    out: bool = False  # diverged: it would catch up from the swarm before its next round


def _contribution(averager: Averager, delta: torch.Tensor, weight: float) -> torch.Tensor:
    """What a member contributes with ``delta``: plus the update that missed an earlier round (the staleness rule:
    at 1 / (1 + rounds late)), which its next round adds."""
    stale = averager.lifecycle.stale
    if weight <= 0 or stale is None:
        return delta
    return delta + stale.update / (1 + max(1, averager.round - stale.round))


def _residual(averager: Averager) -> torch.Tensor:
    return averager.residual if averager.residual is not None else torch.zeros_like(averager.outer.theta)


@dataclass(frozen=True)
class Modes:
    """What a seed runs besides its drawn faults, as the command line's flags say: ``cuts`` streams cut midway,
    ``joins`` leaders that freeze as they answer the joins, ``signed`` a public swarm's signed and checked rounds,
    ``hostile`` one hostile member in them, ``aggregate`` the aggregator's spec in place of the drawn one,
    ``sit_in`` members that just caught up and sit in on a round, ``attack`` the hostile member's attack (one of
    ``ATTACKS``) in place of the drawn one."""

    cuts: bool = False
    joins: bool = False
    signed: bool = False
    hostile: bool = False
    aggregate: str = ""
    sit_in: bool = False
    attack: str = ""

    @property
    def flags(self) -> str:
        """The command line's flags for these modes (``replay_command``)."""
        names = [f" --{name.replace('_', '-')}" for name in ("cuts", "joins", "signed", "hostile", "sit_in")
                 if getattr(self, name)]  # fmt: skip
        chosen = [f" --{name} {value}" for name, value in (("aggregator", self.aggregate), ("attack", self.attack))
                  if value]  # fmt: skip
        return "".join(names + chosen)


async def simulate(seed: int, rounds: int = 2, modes: Modes = Modes()) -> list[str]:
    """Run one seed; return its violations (empty: the protocol held)."""
    rng = random.Random(seed)
    cut_rng = random.Random(seed ^ 0xC07)
    join_rng = random.Random(seed ^ 0x701)
    signed_rng = random.Random(seed ^ 0x516)
    hostile_rng = random.Random(seed ^ 0xBAD)
    sit_rng = random.Random(seed ^ 0x5177)
    hold_rng = random.Random(seed ^ 0x401D)
    hostile = modes.hostile
    signed = modes.signed or hostile  # a hostile member meets a public swarm's defences
    torch.default_generator.manual_seed(seed)  # the CPU generator only: seeding every accelerator costs ms
    n = rng.randint(2, 8)
    numel = rng.choice([24, 61, 200])
    codec = rng.choice(CODECS)
    lr, momentum = rng.choice([(1.0, 0.0), (0.7, 0.9)])
    part_numel = rng.choice([16, 64, 1000])
    # The aggregator comes from its own generator: the schedules every seed replays stay as they were.
    kinds = ("mean", "centered-clip") if codec.startswith(("topk", "dct")) else AGGREGATORS
    kinds = tuple(k for k in kinds if k != "mean") if hostile else kinds  # a public swarm's are robust
    aggregator = parse_aggregator(modes.aggregate or random.Random(seed ^ 0x5EED).choice(kinds))
    verify = signed_rng.choice(VERIFY) if signed else 0.0
    ban_rounds = Config().averaging.ban_rounds if signed else 0  # a node's
    keys = identities() if signed else ()
    signers = [RoundSigner(key) for _, key in keys]
    bad = hostile_rng.randrange(n) if hostile else -1
    sybil = RoundSigner(_identity(MAX_MEMBERS)[1]) if hostile else None  # its second key
    drawn = hostile_rng.choice(HOSTILE) if hostile else ""  # drawn alike with ``attack`` set: the seed replays
    attack = Attack(modes.attack or drawn, seed=seed, sybil=sybil) if hostile else None
    net = MemoryNetwork()
    faults = Faults(net)
    members = []
    for i in range(n):
        transport = net.transport(keys[i][0] if signed else f"peer{i}")
        faults.wrap(transport)
        mine = attack if i == bad else None
        averager = Averager(
            transport, torch.zeros(numel), run_id="sim", group_size=16, outer_lr=lr, outer_momentum=momentum,
            codec_up=mine.wrap_codec(get_codec(codec)) if mine else get_codec(codec),
            codec_down=get_codec(codec), part_numel=part_numel, min_deadline=1.0, deadline_factor=4.0,
            aggregator=aggregator, signer=signers[i] if signed else None, verify=verify,
            rng=random.Random(seed * MAX_MEMBERS + i), ban_rounds=ban_rounds, attack=mine,
        )  # fmt: skip
        await averager.start()
        if modes.attack in HOLDS:  # joiners that give up on a holding leader at different times (``_held``)
            averager.matchmaker.join_timeout = hold_rng.choice(JOIN_TIMEOUTS)
        members.append(Member(averager))
    violations: list[str] = []
    # The hostile member's state and outcomes are its own: the invariants hold the others to them.
    hostiles = {members[bad].averager.me: attack.kind} if attack else {}
    setup = (
        f"seed {seed}: {n} members, numel {numel} in parts of {part_numel}, {codec}, lr {lr}, momentum {momentum}, "
        f"{aggregator.spec}"
        + (f", signed, verify {verify:g}" if signed else "")
        + "".join(f", {peer} hostile ({kind})" for peer, kind in hostiles.items())
    )
    for round_ in range(rounds):
        live = [m for m in members if m.alive and not m.out]
        if len(live) < 2:
            break
        if rng.random() < 0.4:  # gossip: some members come from another group of the last round
            for m in rng.sample(live, rng.randint(1, len(live))):
                m.averager.outer.theta.add_(torch.randn(numel))
                if signed:  # a peer of the group it came from signed its state
                    other = (members.index(m) + 1 + signed_rng.randrange(MAX_MEMBERS - 1)) % MAX_MEMBERS
                    certify(m.averager, signers[other])
        peers = [m.averager.me for m in live]
        weights = [rng.choice([0.0, 1.0, 2.0, 5.0, 100.0]) for _ in live]
        sitting = set(sit_rng.sample(peers, sit_rng.randint(0, len(peers)))) if modes.sit_in else set()
        for i, m in enumerate(live):
            if m.averager.me in sitting:  # just caught up: it sits in on this round (``Phase.OBSERVE``)
                m.averager.lifecycle.phase = Phase.OBSERVE
                weights[i] = 0.0
        deltas = [torch.randn(numel) for _ in live]
        await asyncio.gather(*(m.averager.reconcile() for m in live))  # a member that resynced asks the decision
        before = [(m.averager.outer.theta.clone(), _residual(m.averager).clone()) for m in live]
        buffers = [m.averager.outer.buf.clone() if m.averager.outer.buf is not None else None for m in live]
        banned = {p for m in live for p in m.averager.matchmaker.bans.active(m.averager.round)}
        honest = set(peers) - hostiles.keys()
        banning = {
            m.averager.me for m in live
            if m.averager.me in honest and honest & m.averager.matchmaker.bans.active(m.averager.round).keys()
        }  # fmt: skip
        trusting = {
            m.averager.me for m in live for p, kind in hostiles.items()
            if kind in HOLDS and m.averager.me != p and m.averager.matchmaker.bans.reason(p, m.averager.round) is None
        }  # fmt: skip
        unbanned = any(
            m.averager.me not in hostiles and m.averager.matchmaker.bans.reason(p, m.averager.round) is None
            for m in live for p in hostiles if p in peers
        )  # fmt: skip
        contributed = [_contribution(m.averager, d, w) for m, d, w in zip(live, deltas, weights, strict=True)]
        own = [m.averager.deadline_s() for m in live]
        plan = draw_faults(rng, peers, 3.0) + (draw_cut(cut_rng, peers) if modes.cuts else [])
        plan += draw_signed_fault(signed_rng, peers, 3.0) if signed else []
        faults.new_round(plan + (draw_join_freeze(join_rng, peers, plan, 3.0) if modes.joins else []))
        runs = [
            m.averager.run_round(d.clone(), w, peers, set(peers), gather_timeout=GATHER_S)
            for m, d, w in zip(live, deltas, weights, strict=True)
        ]
        outcomes = await asyncio.gather(*runs, return_exceptions=True)
        context = f"{setup}; round {round_}: weights {weights}; faults {faults.fired}"
        for m in live:
            m.alive = m.averager.me not in net.dead
        # A member the frozen leader did not answer may wait out its pings before it leads (README: the bound): a
        # leader frozen as it answered the joins, or by any call of its while it gathered them (seed 2701176: by a
        # report to a dead member left from the round before, 0.1 s past a bound without it).
        failover = LEADER_FAILOVER_S if any(f.startswith(("freeze-answer", "freeze ")) for f in faults.fired) else 0.0
        observers = {p for p, w in zip(peers, weights, strict=True) if w == 0}
        late = _answered_late(live, faults.fired, observers)
        # A hostile member in the round is a failure of its own: with another, (c) and (e) are not checked.
        hostile_live = any(m.averager.me in hostiles for m in live)
        failed = failures(faults.fired) + late + hostile_live
        played = Played(
            live, outcomes, weights, contributed, before, buffers, own, list(faults.fired), set(faults.frozen),
            banned, banning, hostiles, trusting, unbanned, sitting, codec, lr, momentum,
        )  # fmt: skip
        found = _check(played, aggregator.plain and not hostiles, failover, failed)
        found += _check_confirmed(played, second=late or (hostile_live and failed > 1))
        found += _check_steered(played)
        found += _check_sat_in(played) if sitting else []
        violations += [f"{context}: {v}" for v in found]
        for m, o in zip(live, outcomes, strict=True):
            if isinstance(o, RoundOutcome) and o.outcome == "diverged" and m.averager.me not in hostiles:
                m.out = True  # (a hostile member comes back each round)
        await asyncio.sleep(0)
    return violations


@dataclass
class Played:
    """One round as the checks read it: its live members, what each brought to it (weight, contribution, theta_g
    and residual before, momentum buffer, own budget) and ended with (an outcome, or what it raised), in the same
    order; the faults that fired, who was frozen, banned before it, hostile or sitting in; and the seed's codec and
    outer step."""

    live: list[Member]
    outcomes: list[Any]
    weights: list[float]
    deltas: list[torch.Tensor]
    before: list[tuple[torch.Tensor, torch.Tensor]]
    buffers: list[torch.Tensor | None]
    own: list[float]
    fired: list[str]
    frozen: set[str]
    banned: set[str]
    banning: set[str]  # the honest members that banned another live honest one when it began (see (h))
    hostiles: dict[str, str]
    trusting: set[str]  # the members that did not ban a hostile member that holds joins (``HOLDS``) when it began
    unbanned: bool  # a hostile member was in the round that some other member had not banned when it began
    sitting: set[str]
    codec: str
    lr: float
    momentum: float

    def apart(self) -> set[str]:
        """The members that may end apart from the others (checks (h) and (i)): one that another member banned, and
        an honest one that banned another honest one (it joins no group that one leads)."""
        return self.banned | self.banning


def _check(r: Played, plain_mean: bool, failover: float, failed: int) -> list[str]:
    found = []
    survivors = [
        (i, m, o)
        for i, (m, o) in enumerate(zip(r.live, r.outcomes, strict=True))
        if m.alive and m.averager.me not in r.hostiles
    ]
    for _, m, o in survivors:
        if not isinstance(o, RoundOutcome):
            found.append(f"{m.averager.me} raised {o!r}")
    survivors = [(i, m, o) for i, m, o in survivors if isinstance(o, RoundOutcome)]
    # (b) every survivor leaves within its bound; (i) but one that a hostile leader held, once per ban
    holders = {p for p, kind in r.hostiles.items() if kind in HOLDS}
    for i, m, o in survivors:
        budget = min(o.group.deadline_s or r.own[i], m.averager.deadline_factor * r.own[i])
        bound = GATHER_S + failover + budget + ((2 if o.group.mixed else 1) + DIGEST_SHARE + 1) * budget + 0.5
        bans, me = m.averager.matchmaker.bans, m.averager.me
        hold = 0.0
        if r.trusting and o.duration_s > bound:
            # Until the last one gives up on it (``_held``); a member that had banned it waits as long for a
            # candidate that follows it (it asks that one again until its retry window closes).
            hold = max(JOIN_TIMEOUTS) + JOIN_SLACK_S + GATHER_S
            bans_none = not any(bans.reason(p, o.round + 1) for p in holders)
            if me in r.trusting and not r.frozen & {me, *holders} and bans_none:
                found.append(f"(i) {me} was held {o.duration_s - bound:.2f} s past its bound but bans no one")
        if o.duration_s > bound + hold:
            found.append(f"(b) {me} took {o.duration_s:.2f} s, bound {bound + hold:.2f} s ({o.phases})")
        if wrong := set(bans.holds) - holders:
            found.append(f"(i) {me} banned {sorted(wrong)} for holding its join")
    sat_in = {m.averager.me for _, m, _ in survivors} <= r.sitting  # every honest member: none of them leads
    apart = r.apart()  # they may end apart from the others, as in (h)
    if (
        holders
        and not r.trusting
        and not r.fired
        and not sat_in
        and len(split := {o.group.members for _, m, o in survivors if m.averager.me not in apart}) > 1
    ):
        found.append(f"(i) every member banned the hostile one, no fault fired, and they ended in groups {split}")
    confirmed = [(i, m, o) for i, m, o in survivors if o.outcome in ("applied", "fallback") and o.group.size > 1]
    # (c) one decision per slot, and on whether to mix, among the correct members (not frozen this round) that
    # heard others' reports, whatever their digest vote said afterwards; and a frozen member that confirmed a
    # state no other member holds must not have decided apart either. (A member that heard no one decides alone
    # and knows it: it counts itself diverged.) With two failures in the round, one relay step cannot promise
    # one view (``exchange``): the digest vote, checked by (a), makes the members that differ resync instead.
    held = Counter(o.digest for _, _, o in survivors)
    deciders = [
        (m, o)
        for _, m, o in survivors
        if o.group.size > 1
        and (
            (m.averager.me not in r.frozen and not o.alone)
            or (o.outcome in ("applied", "fallback") and held[o.digest] == 1)
        )
    ]
    decisions = {(o.group.group_id, o.decisions, o.mixed) for _, o in deciders}
    if failed <= 1 and len({d[0] for d in decisions}) < len(decisions):
        seen = [(m.averager.me, o.decisions, o.mixed) for m, o in deciders]
        found.append(f"(c) members decided differently (member, slots applied, mixed): {seen}")
    # (a) identical bytes where the round leaves members identical (not a gossip round that did not mix)
    same = [(m, o) for _, m, o in survivors if o.outcome in ("applied", "fallback", "diverged-resynced")]
    by_group: dict[str, set[str]] = {}
    for m, o in same:
        if not o.group.mixed or o.mixed:
            by_group.setdefault(o.group.group_id, set()).add(m.averager.outer.digest())
    for group_id, digests in by_group.items():
        if len(digests) > 1:
            found.append(f"(a) group {group_id} holds {len(digests)} different states after the round")
    # (d) the applied bytes, dense codecs: theta_g where the round fell back (plain rounds, no momentum); with fp32
    # the residuals, part by part (any round, aggregator or momentum), and the average (plain mean as well)
    dense = not get_codec(r.codec).sparse
    knows = {k for k, _, _ in confirmed}
    for i, m, o in confirmed:
        if not dense:
            continue
        plain = not o.group.mixed and not r.momentum
        theta = m.averager.outer.theta
        order = [next(j for j, mm in enumerate(r.live) if mm.averager.me == p) for p in o.group.members]
        for j, (s, e) in enumerate(o.group.shard_bounds(theta.numel())):
            if not o.decisions[j]:
                if plain and not torch.equal(theta[s:e], r.before[i][0][s:e]):
                    found.append(f"(d) {m.averager.me}: shard {j} fell back but theta_g changed there")
                owed = r.before[i][1][s:e] + (r.deltas[i][s:e] if r.weights[i] > 0 else 0)
                if r.codec == "fp32" and not torch.allclose(_residual(m.averager)[s:e], owed, rtol=1e-5, atol=1e-6):
                    found.append(f"(d) {m.averager.me}: shard {j} fell back but its residual lost or doubled it")
            elif r.codec == "fp32":
                found += _check_applied(r, m, o.group, j, (s, e), order, r.before[i][0], knows, plain and plain_mean)
    return found


def failures(fired: list[str]) -> int:
    """The failures among a round's fired faults: members killed or frozen, and links counted gone
    (``_links_counted_gone``)."""
    stopped = sum(f.split(" ")[0] in ("kill", "freeze", "freeze-answer") for f in fired)
    return stopped + _links_counted_gone(fired)


def _links_counted_gone(fired: list[str]) -> int:
    """Links whose sender counts a live receiver gone: a message slower than its timeout (a drawn delay is no
    failure by itself, but one that meets a call already near its deadline times out), or ``PING_FAILURES``
    failed pings in a row."""
    pings: Counter[str] = Counter()
    for f in fired:
        kind, link, call = f.split(" ")[:3]
        pings[link] += call.startswith("ping") and kind in ("reset", "reset-after")
    return sum(f.endswith("(timed out)") for f in fired) + sum(n >= PING_FAILURES for n in pings.values())


def _answered_late(live: list[Member], fired: list[str], observers: set[str]) -> bool:
    """Whether the member a frozen leader did not answer may hear of its group too late to take part: it hears of
    it from the first message another member sends it, and where every other member contributes nothing (weight
    0), that may be their report. The two are then cut off from each other: a second failure."""
    held = [f.split(" ")[1].split("->") for f in fired if f.startswith("freeze-answer")]
    return bool(held) and all(m.averager.me in observers or m.averager.me in held[0] for m in live)


def _check_confirmed(r: Played, second: bool) -> list[str]:
    """(e) a member that stayed live and answered, in a group where another one did too, confirms the round: with
    one failure a round, the two agree on their digests and each holds the other's. (A message slower than its
    timeout, or two failed pings of one link, make the sender count the receiver gone: a second failure, as a member
    that hears of its group too late (``_answered_late``) or a hostile member beside a failure (``second``), so such
    a round is left out of this check.) ``hostiles`` are held to neither (e) nor (f)."""
    if _links_counted_gone(r.fired) or second:
        return []
    correct = {
        m.averager.me: o
        for m, o in zip(r.live, r.outcomes, strict=True)
        if m.alive and m.averager.me not in r.frozen | r.hostiles.keys() and isinstance(o, RoundOutcome)
    }
    found = []
    for me, o in correct.items():
        others = [p for p in o.group.members if p != me and p in correct and correct[p].group == o.group]
        unmixed = o.group.mixed and not o.mixed  # states differ by design: the minority takes the majority's
        if not o.group.mixed and o.group.counted:  # signed: only members whose state counted vote (``voters``)
            counted = [p for p in others if o.group.counted[o.group.index(p)]]
            if not o.group.counted[o.group.index(me)]:
                # I came with a state that did not count: I take the group's where most of the group holds it
                if 2 * len(counted) > o.group.size and o.outcome == "diverged":
                    found.append(f"(e) {me} did not take the group's state though {counted} hold it")
            elif counted and o.outcome.startswith("diverged"):
                found.append(f"(e) {me} counted itself {o.outcome} though {counted} of its group stayed live")
        elif others and not unmixed and o.outcome.startswith("diverged"):
            found.append(f"(e) {me} counted itself {o.outcome} though {others} of its group stayed live")
    # A member another one banned (signed rounds: an honest member that lost two shards' results to faults
    # withheld them, as a hostile one would) is refused by design and forms a group of its own.
    joined = {me: o for me, o in correct.items() if me not in r.banned}
    if any(f.startswith("freeze-answer") for f in r.fired) and len({o.group for o in joined.values()}) > 1:
        groups = sorted({o.group.members for o in joined.values()})
        found.append(f"(f) the members the frozen leader did and did not answer hold different groups: {groups}")
    return found


def _check_sat_in(r: Played) -> list[str]:
    """(h) no group of two or more whose members all sit in; in a round where no fault fired, each live
    member ends in one group with the others (but those another member banned, and an honest one that banned another:
    it joins no group that one leads), unless every one of them sits in or a hostile member was in the round that not
    every other member had banned (it may lead those that had not, apart from those that had, as bans are each
    member's own: see (i))."""
    ended = {m.averager.me: o.group for m, o in zip(r.live, r.outcomes, strict=True) if isinstance(o, RoundOutcome)}
    found = [f"(h) {me} and the others sitting in formed a group {g.members}" for me, g in ended.items()
             if g.size > 1 and set(g.members) <= r.sitting]  # fmt: skip
    peers = set(ended) - r.apart()
    groups = {ended[me].members for me in peers}
    if not r.fired and not r.unbanned and not peers <= r.sitting and (len(groups) > 1 or not peers <= set(*groups)):
        found.append(
            f"(h) the live members {sorted(peers)} ended in groups {sorted({g.members for g in ended.values()})}"
        )
    return found


def _check_applied(
    r: Played,
    m: Member,
    group: Group,
    j: int,
    bounds: tuple[int, int],
    order: list[int],
    theta_before: torch.Tensor,
    knows: set[int],
    average: bool,
) -> list[str]:
    """(d) for an applied shard with fp32, part by part, against whom the part included (the reducer's mask, in
    the decision ``m`` keeps to serve, its ``ledger``): the residual of each contributor that confirmed the round
    (``knows``) holds nothing where its part was included and all it contributed where it was left out (nothing
    lost, nothing twice); with ``average`` (plain mean, plain round, no momentum) theta_g moved by the
    token-weighted average of exactly the included contributions."""
    found = []
    ledger = m.averager.ledgers.get(group.group_id)
    if ledger is None:
        return [f"(d) {m.averager.me} confirmed the round but keeps no decision to serve"]
    theta = m.averager.outer.theta
    parts, masks = len(range(*bounds, m.averager.part_numel)), len(ledger["masks"][j])
    if masks != parts:
        return [f"(d) {m.averager.me}: {masks} masks for the {parts} parts of applied shard {j}"]
    for ps, pe, included in _included(ledger, j, bounds, m.averager.part_numel, order):
        owed = {k: r.deltas[k][ps:pe] + r.before[k][1][ps:pe] for k in order if r.weights[k] > 0}
        if not included or any(k not in owed for k in included):
            found.append(f"(d) [{ps}:{pe}] of applied shard {j} includes {included}, contributors {list(owed)}")
            continue
        for k, contribution in owed.items():
            if k not in knows:  # died, or did not confirm the round: ``reconcile`` sets its residual right later
                continue
            expected = torch.zeros_like(contribution) if k in included else contribution
            if not torch.allclose(_residual(r.live[k].averager)[ps:pe], expected, rtol=1e-5, atol=1e-6):
                state = "included" if k in included else "left out"
                found.append(f"(d) {r.live[k].averager.me}: {state} at [{ps}:{pe}] of shard {j}, its residual lost or "
                             "doubled it")  # fmt: skip
        if average:
            total = sum(r.weights[k] for k in included)
            mean = sum(owed[k] * (r.weights[k] / total) for k in included)
            if not torch.allclose(mean, theta_before[ps:pe] - theta[ps:pe], rtol=1e-5, atol=1e-6):
                found.append(f"(d) {m.averager.me}: [{ps}:{pe}] of shard {j} is not the average of what it included")
    return found


def _included(
    ledger: dict[str, Any], j: int, bounds: tuple[int, int], part_numel: int, order: list[int]
) -> Iterator[tuple[int, int, list[int]]]:
    """Each part of applied shard ``j`` (``bounds``) and the members whose contributions it included, as indices
    into the round's members (``order``: theirs in the group), read from the reducer's masks in a ``ledger``."""
    start, end = bounds
    for ps, mask in zip(range(start, end, part_numel), ledger["masks"][j], strict=True):
        bits = int.from_bytes(bytes.fromhex(mask), "little")
        yield ps, min(ps + part_numel, end), [k for position, k in enumerate(order) if bits >> position & 1]


def _check_steered(r: Played) -> list[str]:
    """(g) no member holds a value that is not finite, and where a hostile member is one of three or more whose
    contributions a part of the update included, that part of the group's update is no further from the
    token-weighted mean of the others' contributions than ``STEER_BOUND`` times the largest of them (a round that did
    not mix; the update is read from the outer step and the momentum ``buffers`` it started from). A part is a part
    of an applied shard (dense codecs, its contributors read from the reducer's masks in the ``ledger``) or a
    segment (sparse codecs, which combine segment by segment the contributions the ledger applied). A bad
    reducer's own shard is held to it only where a member checked the shard (``verify``): one nobody checked
    escapes, as the README's Replicated reduction says it can."""
    found = [
        f"(g) {m.averager.me} holds a value that is not finite"
        for m in r.live
        if m.averager.me not in r.hostiles and not bool(torch.isfinite(m.averager.outer.theta).all())
    ]
    index = {m.averager.me: k for k, m in enumerate(r.live)}
    bad = next((index[p] for p in r.hostiles if p in index), None)
    if bad is None or r.weights[bad] <= 0:
        return found
    hostile = r.live[bad].averager.me
    for i, (m, o) in enumerate(zip(r.live, r.outcomes, strict=True)):
        if i == bad or not isinstance(o, RoundOutcome) or o.outcome not in ("applied", "fallback"):
            continue
        group = o.group
        ledger = m.averager.ledgers.get(group.group_id)
        if group.mixed or hostile not in group.members or ledger is None:
            continue
        step = (r.before[i][0] - m.averager.outer.theta) / r.lr
        if r.momentum:  # Nesterov moved theta_g by lr ((1 + momentum) update + momentum^2 buffer)
            step = (step - r.momentum**2 * r.buffers[i]) / (1 + r.momentum)
        order = [index[p] for p in group.members]
        parts: Iterable[tuple[int, int, str, list[int]]]
        if get_codec(r.codec).sparse:
            applied = [order[j] for j, ok in enumerate(ledger["applied"]) if ok]
            parts = [(seg.start, seg.end, "segment", applied) for seg in m.averager.segments]
        else:
            parts = _shard_parts(r, o, ledger, bad, order, step.numel(), m.averager.part_numel)
        for ps, pe, where, included in parts:
            honest = [k for k in included if k != bad and r.weights[k] > 0]
            if len(honest) < 2 or bad not in included:
                continue
            rows = [r.deltas[k][ps:pe] + r.before[k][1][ps:pe] for k in honest]
            total = sum(r.weights[k] for k in honest)
            mean = sum(p * (r.weights[k] / total) for p, k in zip(rows, honest, strict=True))
            largest = max(float(p.norm()) for p in rows)
            off = float((step[ps:pe] - mean).norm())
            if off > STEER_BOUND * largest:
                found.append(
                    f"(g) {m.averager.me}: [{ps}:{pe}] of {where} is {off:.3g} from the others' mean, "
                    f"{off / largest:.2f} times the largest of their contributions"
                )
    return found


def _shard_parts(
    r: Played, o: RoundOutcome, ledger: dict[str, Any], bad: int, order: list[int], numel: int, part_numel: int
) -> Iterator[tuple[int, int, str, list[int]]]:
    """The parts of the applied shards of a dense round that (g) holds to its bound, with the members each included:
    not those of a bad reducer's own shard that no other member checked."""
    checked = {  # the shards the others checked
        j for k, c in enumerate(r.outcomes) if k != bad and isinstance(c, RoundOutcome) and c.group == o.group
        for j, _, _ in c.checked
    }  # fmt: skip
    hostile = r.live[bad].averager.me
    for j, bounds in enumerate(o.group.shard_bounds(numel)):
        escaped = r.hostiles[hostile] == "bad-reducer" and o.group.members[j] == hostile and j not in checked
        if o.decisions[j] and not escaped:
            for ps, pe, included in _included(ledger, j, bounds, part_numel, order):
                yield ps, pe, f"shard {j}", included


def run_seed(seed: int, rounds: int = 2, modes: Modes = Modes(), quiet: bool = True) -> list[str]:
    """Run one seed on a fresh virtual-clock loop; the members' logs are silenced unless ``quiet`` is False."""
    loop = VirtualClockLoop()
    logger = logging.getLogger("swarmtrain")
    level = logger.level
    if quiet:
        logger.setLevel(logging.CRITICAL)
    try:
        return loop.run_until_complete(simulate(seed, rounds, modes))
    except Deadlock as exc:
        return [f"seed {seed}: {exc}"]
    finally:
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending))
        loop.close()
        logger.setLevel(level)


def replay_command(seed: int, rounds: int = 2, modes: Modes = Modes()) -> str:
    return f"python -m swarmtrain.averaging.sim --seed {seed} --rounds {rounds}{modes.flags}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, required=True, help="the first seed to run")
    parser.add_argument("--count", type=int, default=1, help="how many seeds from --seed")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per seed")
    parser.add_argument("--log", default="CRITICAL", help="log level of the members (INFO shows the round)")
    parser.add_argument("--cuts", action="store_true", help="also cut streams of parts or results midway")
    parser.add_argument("--joins", action="store_true", help="also freeze leaders as they answer the joins")
    parser.add_argument("--signed", action="store_true", help="a public swarm's signed, checked rounds")
    parser.add_argument("--hostile", action="store_true", help="--signed with one hostile member in each seed")
    parser.add_argument("--aggregator", default="", help="the group's aggregator (a spec) in place of the drawn one")
    parser.add_argument("--sit-in", action="store_true", help="members that just caught up sit in on rounds")
    parser.add_argument("--attack", default="", help="with --hostile: the hostile member's attack, not a drawn one")
    args = parser.parse_args()
    logging.basicConfig(level=args.log, format="%(asctime)s %(name)s %(message)s")
    if args.attack and (not args.hostile or args.attack not in ATTACKS):
        parser.error(f"--attack needs --hostile and one of {', '.join(ATTACKS)}, not {args.attack!r}")
    modes = Modes(args.cuts, args.joins, args.signed, args.hostile, args.aggregator, args.sit_in, args.attack)
    failed = 0
    for seed in range(args.seed, args.seed + args.count):
        violations = run_seed(seed, args.rounds, modes, quiet=args.log == "CRITICAL")
        failed += bool(violations)
        for v in violations:
            print(v)
    print(f"{args.count} seeds, {failed} with violations")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
