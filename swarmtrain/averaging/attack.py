"""Hostile contributions, for tests, benchmarks and scenarios only (``attack.kind``; refused unless
``attack.test_only = true``).

A hostile node trains like any other, then replaces what it contributes to the round (its update and its claimed
token weight) just before the group forms. The kinds are the aggregation attacks of the Byzantine-robust
training literature:

- ``scale``: the update times ``scale`` (a large, well-formed vector in the honest direction).
- ``sign-flip``: the update times ``-scale`` (pushes the model uphill).
- ``nan``: every value NaN. Our encoder refuses non-finite values, so the node's uplink codec is wrapped
  (``wrap_codec``) to write NaN payloads the way a hostile peer's own code would; a receiver's payload check must
  refuse them. Dense codecs and chunked sparse ones; PowerSGD's per-matrix codecs are not wrapped.
- ``random``: Gaussian noise whose norm is ``scale`` times the update's.
- ``big-weight``: the negated update, with its claimed token weight multiplied by 1e6 (capped at the protocol's
  bound), so a token-weighted mean follows the attacker almost entirely.
- ``alie``: "A little is enough" (Baruch et al. 2019): a shift of ``z`` standard deviations per coordinate, small
  enough to hide among honest updates. Without colluding, a node only knows its own update, so it estimates the
  honest mean by its update and the per-coordinate spread by the update's RMS: ``delta - z * rms * sign(delta)``.
- ``equivocate``: an honest update, but every second member of its group gets other reports and digests than the
  rest, each signed (``exchange``, ``signing``): unsigned and unrelayed, that split the group's decision.
- ``forge-records``: an honest update, but every heartbeat the node also publishes, under its own key, a record for
  every other peer it sees, saying that peer left and is ``FORGED_AHEAD`` rounds ahead
  (``swarmtrain.node.node._forge_records``). Unbound to identities, that made peers drop live members from their
  groups and catch up towards a round nobody holds; readers now refuse a record not signed by its peer's key.
- ``bad-reducer``: an honest update, but as a reducer it sends the group ``-scale`` times its shard's true average
  (well formed, the same bytes to every member, so the members' result hashes agree). Members that check a random
  part of another reducer's shard (``averaging.verify``, ``AllReduce._verify``) recompute it from the signed
  contributions and withhold the shard, so no member applies it, and ban the reducer.
- ``mute-reducer``: an honest update and an honest reduction, but it never shows what it averaged to a member that
  checks its shard (``averaging.verify``): it holds each check until the round's deadline and refuses it. Each
  check withholds its shard from the whole group, so it would hold its share of the model still; members ban a
  reducer that leaves their checks unanswered (``bans.Bans.strike``).
- ``withhold``: an honest update and reduction, but its report (``GroupExchange._agree``) holds no hash for any
  shard but its own, as a member whose checks all failed would. A shard applies only where every report holds it,
  so its group falls back on every other shard. Unbanned, that stalled its group every round; every member finds
  it alone withholding (``exchange.withholders``) and bans it in steps (``bans.Bans.withholder``).
- ``own-state``: an honest update, but before every round it moves its theta_g by ``scale`` times its norm (at
  least that of a vector of ones) along a direction of its own (fixed, seeded), and joins with that state's
  digest: a state no peer held. Mixed in by the plain mean, it pulled the honest theta_g a share of the way there
  every round; a state counts in a mix only with another peer's certificate (``Group.counted``), so the group
  never mixes for it and it resyncs each round.
- ``self-certified``: ``own-state``, with a certificate of that state signed by a second identity of its own (a key
  it made, whose peer id never runs: a certificate is any other peer's signature, and identities are free). Its
  state counts, so its group mixes. Mixed by the plain mean, it pulled the honest theta_g ``1 / group size`` of the
  way there every round; a robust swarm mixes states with its aggregator (``Averager.state_aggregator``), whose
  start most members' state fixes and whose radius is twice the median claimed step, so it pulls by a share of
  that radius. Both kinds claim a million times their true steps in a mix (``boast``); the median ignores that.
- ``redirect``: an honest update, but it answers every join with a redirect to a peer that does not exist, a new
  one each time (a peer id is a hash, and ids are free). A joiner that followed every redirect, asking the
  hostile peer again after each made-up one failed, never ended its round; a joiner now follows one candidate's
  redirects to new peers ``SENT_ON`` times a round at most (``Matchmaker.form_group``) and then asks its next
  candidate.
- ``hold``: an honest update, but it never answers a join: it holds every joiner (answering its pings, as a slow
  leader that has not formed its group does) until the joiner gives up on it. As the peer its group takes for its
  leader (the lowest peer id, which a made-up key can aim for), that cost every member of its group its whole join
  timeout in every round; a joiner now bans a peer that held its join to its join timeout, in steps
  (``bans.Bans.held``).
- ``ask-again``: an honest update, but it answers every join with a redirect to itself ("ask me again"), as a
  leader that catches up does while it finishes, until the joiner's retry window closes. Banned in steps as
  ``hold``.
- ``outsider``: a node without a private swarm's key (none, or another) that does not stop when the swarm refuses
  it (``verify_swarm``): it reads the members' records, asks them for their settings, joins their groups, tries to
  catch up from them and publishes its own record. It gets nothing: every call is refused (``swarm-key``) and
  every member ignores its record, so it trains alone.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey

from swarmtrain.averaging.matchmaking import MAX_DEADLINE_S, MAX_WEIGHT
from swarmtrain.averaging.signing import RoundSigner
from swarmtrain.compression import BaseCodec, CodecState
from swarmtrain.compression.wire import pack_header

KINDS = (
    "scale", "sign-flip", "nan", "random", "big-weight", "alie", "equivocate", "forge-records", "outsider",
    "bad-reducer", "mute-reducer", "withhold", "own-state", "self-certified", "redirect", "hold", "ask-again",
)  # fmt: skip
JOINS = ("redirect", "hold", "ask-again")  # the kinds that answer joins their own way (``answer_join``)
BIG_WEIGHT = 1e6
FORGED_AHEAD = 10


@dataclass
class Attack:
    kind: str
    scale: float = 10.0
    z: float = 1.0
    seed: int = 0
    _noise: torch.Generator = field(init=False, repr=False)  # ``random``: fresh noise every round, seeded
    _ids: random.Random = field(init=False, repr=False)  # ``redirect``: made-up peer ids, seeded
    # self-certified: my second identity, made on first use where not given (the simulator gives one of its
    # fixed keys, so a seed replays alike)
    sybil: RoundSigner | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown attack kind {self.kind!r}: use one of {', '.join(KINDS)}")
        self._noise = torch.Generator().manual_seed(self.seed)
        self._ids = random.Random(self.seed)

    def __call__(self, delta: torch.Tensor, weight: float) -> tuple[torch.Tensor, float]:
        """My hostile contribution and claimed weight in place of the honest ``delta`` and ``weight``."""
        if self.kind == "scale":
            return delta * self.scale, weight
        if self.kind == "sign-flip":
            return delta * -self.scale, weight
        if self.kind in (
            "nan", "equivocate", "forge-records", "outsider", "bad-reducer", "mute-reducer", "withhold", "own-state",
            "self-certified", *JOINS,
        ):  # fmt: skip
            # The payloads carry the NaNs (``wrap_codec``); the exchange equivocates; the node forges records or
            # calls without the swarm's key; the reducer alters its shard (``alter``) or answers no check; the
            # report withholds every other shard; the node brings a state of its own (``steer``), certified by
            # itself under another identity (``certify``); it answers joins its own way (``answer_join``).
            return delta, weight
        if self.kind == "random":
            noise = torch.randn(delta.shape, generator=self._noise)
            return noise * (self.scale * float(delta.norm()) / max(float(noise.norm()), 1e-30)), weight
        if self.kind == "big-weight":
            return -delta, min(weight * BIG_WEIGHT, MAX_WEIGHT)
        rms = float(delta.square().mean().sqrt())
        return delta - self.z * rms * torch.sign(delta), weight

    def alter(self, average: torch.Tensor) -> None:
        """bad-reducer: what I send the group for a part of my shard, in place of its true ``average``."""
        average.mul_(-self.scale)

    def steer(self, theta: torch.Tensor) -> None:
        """own-state: move theta_g, before the round, along my own direction by ``scale`` times its norm (or times
        the norm of a vector of ones, where theta_g is about zero)."""
        direction = torch.randn(theta.shape, generator=torch.Generator().manual_seed(self.seed))
        size = max(float(theta.norm()), theta.numel() ** 0.5)
        theta.add_(direction, alpha=self.scale * size / float(direction.norm()))

    def boast(self, moved: torch.Tensor) -> torch.Tensor:
        """own-state, self-certified: the steps I claim in a gossip mix (``OuterOptimizer.moved``, squared norms per
        chunk), ``BIG_WEIGHT`` times my true ones, to widen the robust mix's radius (``Aggregator.floor``)."""
        return moved * BIG_WEIGHT**2

    def certify(self, round_: int, digest: str) -> dict[str, Any]:
        """self-certified: a certificate that another peer held my state ``digest`` at the end of the round before
        ``round_``, signed by a second identity of mine."""
        if self.sybil is None:
            self.sybil = RoundSigner(RSAPrivateKey())
        held = round_ - 1
        return {"round": held, "key": self.sybil.public, "sig": self.sybil.sign_held(held, digest)}

    async def answer_join(self, me: str) -> dict[str, Any]:
        """redirect, hold, ask-again: my answer to every join, whatever its round (I am ``me``). hold answers only
        after the longest budget a round may have, long after every joiner gave up (its call cancelled), and
        answers their pings meanwhile."""
        if self.kind == "redirect":
            return {"redirect": self.made_up_peer()}
        if self.kind == "hold":
            await asyncio.sleep(MAX_DEADLINE_S)
        return {"redirect": me}  # ask-again: "ask me again"

    def made_up_peer(self) -> str:
        """redirect: the peer id I send a joiner on to, made up (the base58 multihash of 32 seeded random bytes, a
        well-formed id of a key nobody holds) and new each time."""
        return PeerID(b"\x12\x20" + self._ids.randbytes(32)).to_base58()

    def wrap_codec(self, codec: BaseCodec) -> BaseCodec:
        """The uplink codec a node with this attack sends with: ``nan`` writes NaN payloads, the others encode."""
        return _NanCodec(codec) if self.kind == "nan" else codec  # type: ignore[return-value]


class _NanCodec:
    """Proxy of a codec whose payloads hold NaN in every value, well-formed otherwise (a hostile sender's)."""

    def __init__(self, inner: BaseCodec) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode(self, tensor: torch.Tensor, state: CodecState | None = None) -> bytes:
        x = torch.full((tensor.numel(),), float("nan"))
        params, body = self.inner._encode(x, None)
        return b"".join([pack_header(self.inner.codec_id, x.numel(), params), *body])

    def encode_feedback(self, tensor: torch.Tensor, residual: torch.Tensor, decoded: torch.Tensor) -> bytes:
        return self.encode(tensor)  # a hostile sender keeps no honest residual
