"""The settings every node of a swarm must share, and the check a node makes against the swarm's before it trains.

Nodes answer a "settings" call with theirs; a bootstrap peer answers with only the run id and protocol version (it
trains no model). A node asks the peers it joins through and those in its first view of the swarm, takes what most
of them answer, and stops before training, naming each key that differs and the value the swarm uses, instead of
being refused round after round (a model of another shape cannot join a group) or averaging with a swarm whose
codec or outer optimizer differs. ``swarmtrain doctor`` makes the same check.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Iterable
from typing import Any

from swarmtrain.averaging import PROTOCOL_VERSION
from swarmtrain.config import Config
from swarmtrain.errors import SwarmtrainError
from swarmtrain.net import RpcError, Transport

log = logging.getLogger(__name__)

SETTINGS_TIMEOUT = 10.0
MAX_ASKED = 5  # peers asked: enough for a majority, few enough to stay quick


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


async def serve_settings(transport: Transport, settings: dict[str, Any]) -> None:
    async def on_settings(sender: str, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        return {"settings": settings}, b""

    await transport.serve("settings", on_settings, max_body=0)


async def ask_settings(transport: Transport, peers: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The settings each of ``peers`` (at most ``MAX_ASKED``, asked at once) answered within ``SETTINGS_TIMEOUT``;
    peers that did not answer (a dead peer still in the view, a stock hivemind peer) are left out."""

    async def ask(peer: str) -> dict[str, Any] | None:
        try:
            answer, _ = await transport.call(peer, "settings", {}, timeout=SETTINGS_TIMEOUT)
        except RpcError as exc:
            log.info("could not ask %s for its settings: %s", peer[-8:], exc)
            return None
        settings = answer.get("settings")
        return settings if isinstance(settings, dict) and all(isinstance(k, str) for k in settings) else None

    asked = list(dict.fromkeys(peers))[:MAX_ASKED]
    answers = await asyncio.gather(*(ask(peer) for peer in asked))
    return {peer: settings for peer, settings in zip(asked, answers, strict=True) if settings is not None}


def majority(answers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per key, the value most of the answering peers hold (one odd peer does not speak for the swarm)."""
    keys = dict.fromkeys(k for settings in answers.values() for k in settings)
    swarm = {}
    for key in keys:
        votes = Counter(json.dumps(s[key], sort_keys=True) for s in answers.values() if key in s)
        swarm[key] = json.loads(votes.most_common(1)[0][0])
    return swarm


async def check_settings(transport: Transport, peers: Iterable[str], mine: dict[str, Any]) -> int:
    """Raise ``ConfigMismatch`` if the swarm's settings (the majority of ``peers`` that answer) differ from
    ``mine``; returns how many peers answered."""
    answers = await ask_settings(transport, peers)
    if not answers:
        return 0
    diffs = differences(mine, majority(answers))
    if diffs:
        source = f"as {len(answers)} peer{'s' if len(answers) > 1 else ''} of the swarm answered"
        raise ConfigMismatch(diffs, source)
    return len(answers)
