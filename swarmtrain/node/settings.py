"""The settings every node of a swarm must share, and the check a node makes against the swarm's before it trains.

Nodes answer a "settings" call with theirs; a bootstrap peer answers with only the run id and protocol version (it
trains no model). A node asks the peers it joins through and those in its first view of the swarm, takes what most
of them answer, and stops before training, naming each key that differs and the value the swarm uses, instead of
being refused round after round (a model of another shape cannot join a group) or averaging with a swarm whose
codec or outer optimizer differs. ``swarmtrain doctor`` makes the same check.

Each answer also carries the peer's wall clock. hivemind's DHT stamps every record with a wall-clock expiration,
so a node whose clock is off by more than a few seconds sees its peers' records expire early (or keeps dead ones)
and its own look stale to them: the node warns and ``doctor`` fails, naming the fix.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from swarmtrain.averaging import PROTOCOL_VERSION
from swarmtrain.averaging.robust import parse_aggregator
from swarmtrain.config import Config
from swarmtrain.errors import SwarmtrainError
from swarmtrain.net import RpcError, Transport

log = logging.getLogger(__name__)

SETTINGS_TIMEOUT = 10.0
MAX_ASKED = 5  # peers asked: enough for a majority, few enough to stay quick
# A record lives node.record_ttl_s (5 s by default) and is refreshed every node.heartbeat_s (1 s): a peer whose
# clock runs ahead by more than the gap sees live records as expired. Half of it leaves a margin; NTP keeps
# ordinary machines within milliseconds.
MAX_CLOCK_SKEW_S = 2.0
CLOCK_FIX = "sync this machine's clock (e.g. `timedatectl set-ntp true`, or run chrony or ntpd)"


@dataclass(frozen=True, slots=True)
class Answer:
    """A peer's answer to "settings": its settings, and how far its clock is from ours."""

    settings: dict[str, Any]
    skew_s: float | None  # the peer's clock minus ours at the middle of the call; None if it sent no clock
    error_s: float = 0.0  # half the call's round trip: the skew is known to within this


def skewed(answers: dict[str, Answer], bound: float = MAX_CLOCK_SKEW_S) -> dict[str, float]:
    """The peers whose clock is surely more than ``bound`` seconds from ours (the call's own time allowed for)."""
    return {
        peer: a.skew_s for peer, a in answers.items() if a.skew_s is not None and abs(a.skew_s) - a.error_s > bound
    }


def describe_skew(skews: dict[str, float]) -> str:
    """One line naming the peers whose clocks are off and by how much, e.g. "QmAb..x 31.2 s ahead"."""
    return ", ".join(f"{peer[-8:]} {abs(s):.1f} s {'ahead' if s > 0 else 'behind'}" for peer, s in skews.items())


class ConfigMismatch(SwarmtrainError):
    """This node's settings differ from the swarm's."""

    def __init__(self, diffs: list[tuple[str, Any, Any]], source: str) -> None:
        self.diffs = diffs
        self.summary = "; ".join(f"{key} = {mine!r} here, the swarm uses {theirs!r}" for key, mine, theirs in diffs)
        fixes = " ".join(fix_for(key, theirs) for key, _, theirs in diffs)
        super().__init__(
            f"config mismatch: {self.summary} ({source}). This node cannot train with that swarm: start it with the "
            f"swarm's settings ({fixes}), or with a new node.run_id to start a swarm of its own."
        )


def swarm_settings(config: Config, trains: bool = True) -> dict[str, Any]:
    """The settings a node must share with the swarm, by dotted key (a bootstrap peer has only the first two)."""
    settings: dict[str, Any] = {"node.run_id": config.node.run_id, "protocol": PROTOCOL_VERSION}
    if not trains:
        return settings
    model, avg = config.model, config.averaging
    settings.update({f"model.{k}": v for k, v in model.model_dump().items()})
    settings.update({
        "averaging.codec": avg.codec, "averaging.codec_down": avg.codec_down or avg.codec,
        "averaging.group_size": avg.group_size, "averaging.outer_lr": avg.outer_lr,
        "averaging.outer_momentum": avg.outer_momentum, "averaging.part_numel": avg.part_numel,
        # A member that checks a reducer recomputes the reducer's part with its own aggregator.
        "averaging.aggregator": parse_aggregator(avg.aggregator, private=config.node.private).spec,
        "averaging.verify": config.verify, "averaging.weighting": avg.weighting,
    })  # fmt: skip
    return settings


def differences(mine: dict[str, Any], swarm: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, my value, the swarm's) for each key both name and that differs."""
    return [(key, mine[key], swarm[key]) for key in mine if key in swarm and mine[key] != swarm[key]]


def fix_for(key: str, value: Any) -> str:
    if key == "protocol":
        return "install the swarmtrain version the swarm runs"
    text = json.dumps(value) if not isinstance(value, str) else value
    return f"--set {key}={text.replace(' ', '')}"


async def serve_settings(
    transport: Transport, settings: dict[str, Any], clock: Callable[[], float] = time.time
) -> None:
    async def on_settings(sender: str, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        return {"settings": settings, "time": clock()}, b""

    await transport.serve("settings", on_settings, max_body=0)


async def ask_settings(transport: Transport, peers: Iterable[str]) -> dict[str, Answer]:
    """What each of ``peers`` (at most ``MAX_ASKED``, asked at once) answered within ``SETTINGS_TIMEOUT``; peers
    that did not answer (a dead peer still in the view, a stock hivemind peer) are left out."""

    async def ask(peer: str) -> Answer | None:
        sent = time.time()
        try:
            answer, _ = await transport.call(peer, "settings", {}, timeout=SETTINGS_TIMEOUT)
        except RpcError as exc:
            log.info("could not ask %s for its settings: %s", peer[-8:], exc)
            return None
        received = time.time()
        settings = answer.get("settings")
        if not isinstance(settings, dict) or not all(isinstance(k, str) for k in settings):
            return None
        clock = answer.get("time")
        known = isinstance(clock, int | float) and not isinstance(clock, bool) and math.isfinite(clock)
        skew = clock - (sent + received) / 2 if known else None
        return Answer(settings, skew, (received - sent) / 2)

    asked = list(dict.fromkeys(peers))[:MAX_ASKED]
    answers = await asyncio.gather(*(ask(peer) for peer in asked))
    return {peer: settings for peer, settings in zip(asked, answers, strict=True) if settings is not None}


def majority(answers: dict[str, Answer]) -> dict[str, Any]:
    """Per key, the value most of the answering peers hold (one odd peer does not speak for the swarm)."""
    held = [a.settings for a in answers.values()]
    keys = dict.fromkeys(k for settings in held for k in settings)
    swarm = {}
    for key in keys:
        votes = Counter(json.dumps(s[key], sort_keys=True) for s in held if key in s)
        swarm[key] = json.loads(votes.most_common(1)[0][0])
    return swarm


async def check_settings(transport: Transport, peers: Iterable[str], mine: dict[str, Any]) -> int:
    """Raise ``ConfigMismatch`` if the swarm's settings (the majority of ``peers`` that answer) differ from
    ``mine``; returns how many peers answered. A clock far from the peers' is logged as a warning with its fix."""
    answers = await ask_settings(transport, peers)
    if not answers:
        return 0
    skews = skewed(answers)
    if skews:
        log.warning(
            "this machine's clock is more than %.0f s from its peers' (%s): the DHT stamps records with wall-clock "
            "expirations, so peers will drop this node's records or it theirs; %s",
            MAX_CLOCK_SKEW_S, describe_skew(skews), CLOCK_FIX,
        )  # fmt: skip
    diffs = differences(mine, majority(answers))
    if diffs:
        source = f"as {len(answers)} peer{'s' if len(answers) > 1 else ''} of the swarm answered"
        raise ConfigMismatch(diffs, source)
    return len(answers)
