"""Typed, nested configuration for every swarmtrain command.

Sources, later ones winning: a TOML file (``--config run.toml``), environment variables with the prefix
``SWARMTRAIN_`` (``SWARMTRAIN_TRAIN__BATCH_SIZE=16``: a double underscore separates sections), and CLI flags
(``--set train.batch_size=16`` or a command's own flags). Unknown keys are errors wherever they come from.
Each field's docstring is its help text: ``swarmtrain config`` lists them all.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from swarmtrain.errors import ConfigError
from swarmtrain.fsutil import atomic_write_bytes

ENV_PREFIX = "SWARMTRAIN_"
# averaging.verify = auto in a public swarm: with 3 checks a round, 2 or 3 bad reducers of 8 cost the model under
# 3 % (README, Replicated reduction). Each check downloads g contributions of one part: for a small model (a shard is
# one part) a whole compressed update.
PUBLIC_VERIFY = 3.0


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class ModelConfig(_Section):
    depth: int = Field(4, ge=1, le=256)
    """Number of transformer blocks."""
    width: int = Field(128, ge=8, le=16384)
    """Hidden size of every block (the residual stream width)."""
    heads: int = Field(4, ge=1)
    """Attention heads per block; must divide model.width."""
    context: int = Field(128, ge=2, le=65536)
    """Context length in bytes (tokens)."""
    mlp_ratio: int = Field(4, ge=1, le=16)
    """MLP hidden size as a multiple of model.width."""
    exits: list[int] = Field(default_factory=list)
    """Block boundaries (1..depth-1) that host an extra exit (final norm + readout) for local losses."""
    shared_readout: bool = True
    """All exits share one readout matrix (the last one); false gives each exit its own."""

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.width % self.heads:
            raise ValueError(f"model.width ({self.width}) must be divisible by model.heads ({self.heads})")
        bad = [e for e in self.exits if not 1 <= e < self.depth]
        if bad:
            raise ValueError(f"model.exits {bad} must lie between 1 and model.depth - 1 ({self.depth - 1})")
        return self


class DataConfig(_Section):
    path: str | None = None
    """Text file, folder of text files, or enwik8; unset means the Python standard library's source tree."""
    include: list[str] = Field(default_factory=list, max_length=1000)
    """Train only on these folders of a folder corpus (relative to it, e.g. ["asyncio", "email"]); empty: all of
    it. Nodes given different folders train on different text (a non-IID swarm)."""
    eval_parts: list[str] = Field(default_factory=list, max_length=100)
    """Folders of the corpus (as data.include names them) on which the node's final evaluation also measures
    held-out bpb, each and all together (metrics.jsonl `bpb_parts`): how the one model does on each node's text."""
    val_fraction: float = Field(0.05, gt=0.0, lt=0.5)
    """Share of a corpus held out for validation (whole files for folders; the tail for a single file)."""
    cache_dir: str | None = None
    """Where a folder corpus is packed into one memory-mapped file; unset means ~/.cache/swarmtrain."""


class TrainConfig(_Section):
    batch_size: int = Field(32, ge=1)
    """Sequences per inner step."""
    lr: float = Field(3e-3, gt=0.0)
    """Peak AdamW learning rate."""
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """The cosine schedule decays to lr * min_lr_ratio at train.max_steps."""
    warmup_steps: int = Field(100, ge=0)
    """Linear warm-up steps."""
    weight_decay: float = Field(0.1, ge=0.0)
    """AdamW weight decay on matrices (not on norms, biases or embeddings)."""
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    """AdamW beta1."""
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    """AdamW beta2."""
    grad_clip: float = Field(1.0, ge=0.0)
    """Clip the gradient norm to this value; 0 disables clipping."""
    max_steps: int = Field(3000, ge=1)
    """Stop after this many steps."""
    max_time: float | None = Field(None, gt=0.0)
    """Stop after this many seconds of training (evaluation not counted); unset means no time budget."""
    eval_every: int = Field(250, ge=1)
    """Evaluate held-out bits per byte every this many steps."""
    eval_batches: int = Field(16, ge=1)
    """Batches of train.batch_size windows in each evaluation (the same windows every time)."""
    checkpoint_every: int = Field(250, ge=1)
    """Write a checkpoint every this many steps (and at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many recent checkpoints to keep."""
    log_every: int = Field(10, ge=1)
    """Update the progress display every this many steps."""
    seed: int = 0
    """Seed for initialisation and data windows; the same seed gives the same run."""
    threads: int = Field(0, ge=0)
    """torch threads for compute; 0 means all cores."""
    trainer: Literal["standard", "localtrain"] = "standard"
    """Inner trainer of `swarmtrain node`: standard (global backprop) or localtrain (set up by localtrain.*)."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """Compute precision of the standard trainer's forward and backward passes (bf16: autocast); weights,
    optimizer state and the updates a node sends stay fp32, so nodes of either precision average together."""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda|cuda:\d+|mps)$")
    """Device of the standard trainer: auto (cuda if present, then mps, else cpu), cpu, cuda, cuda:N or mps.
    theta_g, the outer step and the codecs stay on the CPU in fp32 whatever this is."""


LocalTrainMethod = Literal["global-bp", "live-local", "broadcast-serial", "broadcast-async", "rgc-serial", "rgc-async"]


class LocalTrainConfig(_Section):
    method: LocalTrainMethod = "rgc-async"
    """How the stages share the readout: global-bp, live-local, broadcast-serial/-async or rgc-serial/-async."""
    stages: int = Field(2, ge=1, le=64)
    """Stages the model's blocks are cut into (one process each for the async methods)."""
    threads: int = Field(0, ge=0)
    """Total torch threads over all stages (global backprop gets all of them); 0 means all cores."""
    stage_threads: list[int] = Field(default_factory=list)
    """Threads per stage, first to last; empty splits localtrain.threads evenly (the remainder to early stages)."""
    pin_cores: bool = False
    """Pin each stage process to its own cores (off by default: on a shared machine pinning can hurt)."""
    ring_depth: int = Field(2, ge=1, le=64)
    """Slots per ring; also the most readout versions an upstream stage may lag behind (per stage of distance)."""
    serial_lag: int = Field(1, ge=0)
    """Readout-snapshot lag in steps for broadcast-serial and rgc-serial (0 makes rgc-serial equal live-local)."""
    wait_timeout: float = Field(120.0, gt=0.0)
    """Seconds any wait on a ring, snapshot or stage may last before the run fails."""
    start_timeout: float = Field(180.0, gt=0.0)
    """Seconds the stage processes may take to start (import torch, build their part of the model)."""


class NodeConfig(_Section):
    run_id: str = Field("swarmtrain", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    """Name of the swarm: nodes only average with peers of the same run id."""
    host: list[str] = Field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    """Multiaddrs to listen on; use /ip4/0.0.0.0/tcp/31337 to accept peers from other machines."""
    announce: list[str] = Field(default_factory=list)
    """Multiaddrs other peers should dial (your public address behind NAT or port forwarding)."""
    reachability: Literal["auto", "on", "off"] = "auto"
    """Ask up to 3 peers at start to dial this node back on its addresses, and warn if none can: "auto" does when
    it has an address other than loopback."""
    use_auto_relay: bool = False
    """Behind a NAT with no forwarded port: have relays carry inbound connections (the p2p daemon's AutoRelay)."""
    relays: list[str] = Field(default_factory=list)
    """Multiaddrs of relays to use with node.use_auto_relay (the daemon's trusted relays)."""
    up_delay_ms: float = Field(0.0, ge=0.0, le=10_000.0)
    """Delay added to each message of the round protocol and state transfer this node sends, to try a distant
    link on one machine (a scenario's link up_ms); 0: none. The DHT's own messages are not delayed."""
    down_delay_ms: float = Field(0.0, ge=0.0, le=10_000.0)
    """The same for each message this node receives (a scenario's link down_ms)."""
    up_mbit: float = Field(0.0, ge=0.0, le=1_000_000.0)
    """Pace what this node sends over the round protocol and state transfer at this many Mbit/s, to try a narrow
    link on one machine without root (a scenario's link up_mbit; as root scenarios shape in the kernel); 0: no
    limit. The DHT's own messages are not paced."""
    down_mbit: float = Field(0.0, ge=0.0, le=1_000_000.0)
    """The same for what this node receives (a scenario's link down_mbit)."""
    join: list[str] = Field(default_factory=list)
    """Multiaddrs of peers already in the swarm (with /p2p/<peer id>); empty starts a new swarm."""
    identity: str | None = None
    """Private key file that fixes this node's peer id; unset means <run_dir>/identity.key (created if missing)."""
    swarm_key: str | None = None
    """Swarm key file of a private swarm (`swarmtrain keygen --swarm PATH`); unset means a public swarm."""
    allow_peers: list[str] = Field(default_factory=list, max_length=10_000)
    """Peer ids allowed in a private swarm (empty: any holder of node.swarm_key, or anyone in a public swarm)."""
    inner_steps: int = Field(50, ge=1)
    """H: inner AdamW steps between two outer steps (unless node.inner_time_s is set)."""
    inner_time_s: float = Field(0.0, ge=0.0)
    """Rounds by time: train this many seconds per round (at least one step) and contribute the tokens done,
    so fast and slow nodes share rounds without waiting; 0 means node.inner_steps steps per round."""
    overlap: bool = False
    """Hide the exchange behind compute (Streaming DiLoCo's overlap): the next round's inner steps start while
    this round's update is averaged, and the new theta_g is merged in when it arrives (node.overlap_keep). Off:
    the inner steps wait for the exchange. Needs train.trainer = standard."""
    overlap_keep: float = Field(0.5, ge=0.0, lt=1.0)
    """With node.overlap, the share of the local parameters kept when theta_g arrives: they become
    keep x local + (1 - keep) x theta_g (Streaming DiLoCo's merge; 0 drops the steps taken beside the exchange)."""
    slowdown: float = Field(1.0, ge=1.0, le=1000.0)
    """Make each inner step take this many times as long (it sleeps the rest), to try a slower machine on this
    one (a scenario's unlike machines); 1: full speed."""
    test_step_delay_s: float = Field(0.0, ge=0.0)
    """For tests only: sleep this long after each inner step, to simulate a slow machine. 0 (the default)."""
    rounds: int = Field(0, ge=0)
    """Stop after this many outer rounds; 0 means run until Ctrl+C (or train.max_time)."""
    min_peers: int = Field(1, ge=1)
    """Wait until the swarm has this many peers (this one included), and as many of them see as many, before the
    first round; then, above 1, up to 15 s more until each peer seen answers a ping."""
    min_peers_timeout_s: float = Field(600.0, gt=0.0)
    """Give up waiting for node.min_peers after this many seconds (and train with whoever is there)."""
    heartbeat_s: float = Field(1.0, gt=0.0, le=60.0)
    """Seconds between membership heartbeats."""
    record_ttl_s: float = Field(5.0, gt=0.0)
    """A peer that misses heartbeats for this long drops out of every view."""
    eval_every: int = Field(0, ge=0)
    """Evaluate held-out bits per byte every this many rounds (0: only at the end)."""
    checkpoint_every: int = Field(5, ge=1)
    """Write a checkpoint every this many rounds (and on exit)."""
    data_seed: int | None = None
    """Seed for this node's data windows; unset derives one from the peer id so nodes see different data."""

    @model_validator(mode="after")
    def _check_addrs(self) -> NodeConfig:
        import base58
        import multihash
        from multiaddr import Multiaddr

        for key in ("host", "announce", "join", "relays"):
            for addr in getattr(self, key):
                try:
                    parsed = Multiaddr(addr)
                except Exception as exc:
                    raise ValueError(
                        f"node.{key} entry {addr!r} is not a valid multiaddr ({exc}); "
                        "it looks like /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW..."
                    ) from None
                if key in ("join", "relays") and "/p2p/" not in str(parsed):
                    raise ValueError(
                        f"node.{key} entry {addr!r} lacks the peer id: copy the whole line the peer printed, "
                        "ending in /p2p/12D3KooW..."
                    )
        for peer in self.allow_peers:
            try:
                multihash.decode(base58.b58decode(peer))
            except Exception:
                raise ValueError(
                    f"node.allow_peers entry {peer!r} is not a peer id; copy the id a node prints ('peer Qm... is up')"
                ) from None
        if self.record_ttl_s < 2 * self.heartbeat_s:
            raise ValueError("node.record_ttl_s must be at least twice node.heartbeat_s")
        return self

    @property
    def private(self) -> bool:
        """A private swarm: its members hold its key, or are listed by peer id."""
        return bool(self.swarm_key or self.allow_peers)


class AveragingConfig(_Section):
    group_size: int = Field(16, ge=2, le=256)
    """Peers per all-reduce group; a swarm of at most this many averages as one group (exact DiLoCo)."""
    outer_lr: float = Field(0.7, gt=0.0)
    """Outer learning rate (DiLoCo: 0.7; FedAvg: 1.0 with outer_momentum 0)."""
    outer_momentum: float = Field(0.9, ge=0.0, lt=1.0)
    """Nesterov momentum of the outer optimizer (0 disables it)."""
    codec: str = "fp16"
    """Codec of each node's update: fp32, fp16, bf16, int8, int4, 2bit (butterfly all-reduce), or topk,
    dct-topk, powersgd (all-gathered whole, averaged exactly); one spec such as 'topk:frac=0.005,value=int8'."""
    error_feedback: bool = True
    """Keep what a lossy uplink codec drops and add it to the next round's update (sender-side residual)."""
    codec_down: str = ""
    """Codec of the averaged shards reducers send back in the butterfly; empty means the same as averaging.codec.
    Unused with sparse and low-rank codecs, whose payloads are never re-compressed."""
    part_numel: int = Field(1 << 20, ge=1024)
    """Elements per streamed part of a shard."""
    min_deadline_s: float = Field(10.0, gt=0.0)
    """Floor of the all-reduce deadline; above it the deadline adapts to measured round times."""
    deadline_factor: float = Field(4.0, ge=1.0)
    """The deadline is this multiple of the slowest of the last few all-reduces."""
    min_gather_s: float = Field(3.0, gt=0.0)
    """The leader waits at least this long for late members (longer if inner phases are long)."""
    aggregator: str = "auto"
    """How a group combines its members' updates, and in a gossip round their states (without the norm clip, and
    with centered-clip's radius at least twice the median member's last outer step): mean, trimmed-mean,
    centered-clip or median, with optional parameters ('centered-clip:tau=1,iters=5,clip=2,cap=1'; clip: norm clip
    at that multiple of the median norm, cap: token weights at that multiple of the median). auto: mean in a private
    swarm (node.swarm_key or node.allow_peers set), centered-clip in a public one."""
    weighting: Literal["tokens", "equal"] = "tokens"
    """How a node's update is weighted in its group's average: by the tokens it trained this round (tokens), or
    the same for every node that trained (equal: a node with a bigger batch or a faster machine counts no more;
    a join or a group claiming a weight above 1 is refused). Every node of a swarm needs the same value."""
    verify: float | Literal["auto"] = "auto"
    """Parts of other reducers' shards a node checks each round, on average (0.5: one every second round; 2: two,
    of two reducers), picked at random (replicated reduction): it fetches the contributions the reducer averaged,
    each signed by its sender, recomputes the part and, if the result differs, withholds the shard (no member
    applies it) and bans the reducer. In a group of g with h honest members, a reducer that alters its shard is
    caught in a round with probability 1 - (1 - verify / (g - 1)) ** h; verify = g - 1 checks every shard. Each
    check downloads the g signed contributions to one part (a whole compressed update where a shard is one part,
    as for models up to g x part_numel parameters). auto: 0 (no checks) in a private swarm, 3 in a public one.
    Every node of a swarm needs the same value (dense codecs only: sparse and low-rank payloads are averaged by
    every member, with no reducer)."""
    ban_rounds: int = Field(10, ge=0, le=1_000_000)
    """Rounds a peer caught sending an invalid payload (malformed, non-finite, out of bounds) is left out of this
    node's groups, with the reason logged; also a reducer that leaves checks unanswered, a member that withholds
    others' shards, or a leader that holds joins to their timeout, the second time within 10 rounds (2 rounds the
    first time). 0 bans nobody."""
    fail_at: str = Field("", pattern=r"^(round=\d+,part=\d+)?$")
    """Fault injection for tests: 'round=R,part=P' makes this node kill itself (SIGKILL) right after sending
    its P-th part in round R. Empty (the default) injects nothing."""
    test_skew_at: int = Field(-1, ge=-1)
    """Fault injection for tests: R >= 0 makes this node perturb its theta_g right after the outer step of round R
    (a group round), so its state digest is the group's minority and the digest vote sends it to resync. -1 (the
    default) injects nothing."""

    @field_validator("verify", mode="before")
    @classmethod
    def _check_verify(cls, value: Any) -> Any:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 256:
            raise ValueError("expected auto or a number of parts from 0 to 256, such as 3")
        return float(value)


class AttackConfig(_Section):
    kind: Literal[
        "", "scale", "sign-flip", "nan", "random", "big-weight", "alie", "equivocate", "forge-records", "outsider",
        "bad-reducer", "mute-reducer", "withhold", "own-state", "self-certified", "redirect", "hold", "ask-again",
    ] = ""  # fmt: skip
    """TEST ONLY: make this node hostile (its contribution to every round is replaced; with equivocate its reports
    and digests differ between members; with forge-records it publishes records in other peers' names; with
    outsider it keeps trying a private swarm whose key it lacks; with bad-reducer it alters the shard it reduces;
    with mute-reducer it never shows checkers what it averaged; with withhold its reports hold no other reducer's
    shard; with own-state it joins every round with a state of its own, and with self-certified one it certifies
    under a second identity; with redirect it sends every joiner on to a made-up peer; with hold it holds every
    join unanswered, and with ask-again it tells every joiner to ask it again; see
    swarmtrain/averaging/attack.py). Empty (the default) is an honest node. Refused
    unless attack.test_only."""
    test_only: bool = False
    """Must be true for attack.kind to be accepted: a hostile node is for tests, benchmarks and scenarios only."""
    scale: float = Field(10.0, gt=0.0, le=1e4)
    """scale, sign-flip: the factor on the update; random: the noise norm as a multiple of the update's;
    bad-reducer: the factor (negated) on the shard it sends."""
    z: float = Field(1.0, gt=0.0, le=100.0)
    """alie: the shift in standard deviations per coordinate."""

    @model_validator(mode="after")
    def _check_test_only(self) -> AttackConfig:
        if self.kind and not self.test_only:
            raise ValueError(
                f"attack.kind = {self.kind!r} makes this node send hostile updates; it exists for tests only: set "
                "attack.test_only = true to run it on purpose, or remove attack.kind"
            )
        return self


class ObserveConfig(_Section):
    http_port: int | None = Field(None, ge=0, le=65535)
    """Port of the node's HTTP endpoint (dashboard at /, /status JSON, /metrics for Prometheus); unset means off,
    0 picks a free port. The node prints the URL and writes it to <run_dir>/http.txt."""
    http_host: str = "127.0.0.1"
    """Address the HTTP endpoint listens on; the default serves this machine only (0.0.0.0 serves everyone)."""


class Config(_Section):
    run_dir: str = "runs/default"
    """Directory for checkpoints, the resolved config and metrics."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Model shape."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Corpus."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Inner optimisation."""
    node: NodeConfig = Field(default_factory=NodeConfig)
    """Swarm node: addresses, identity, rounds."""
    averaging: AveragingConfig = Field(default_factory=AveragingConfig)
    """Outer step: groups, outer optimizer, codecs, deadlines."""
    localtrain: LocalTrainConfig = Field(default_factory=LocalTrainConfig)
    """Local training in stages on this machine's cores (`swarmtrain localtrain bench`, train.trainer)."""
    attack: AttackConfig = Field(default_factory=AttackConfig)
    """TEST ONLY: hostile behaviour for tests and benchmarks of robust aggregation."""
    observe: ObserveConfig = Field(default_factory=ObserveConfig)
    """The node's HTTP endpoint: status, metrics."""

    @property
    def verify(self) -> float:
        """``averaging.verify`` with ``auto`` resolved: checks in a public swarm, none in a private one."""
        verify = self.averaging.verify
        if verify == "auto":
            return 0.0 if self.node.private else PUBLIC_VERIFY
        return verify

    @model_validator(mode="after")
    def _check_aggregator(self) -> Config:
        from swarmtrain.averaging.robust import parse_aggregator

        try:
            agg = parse_aggregator(self.averaging.aggregator, private=self.node.private)
        except ValueError as exc:
            raise ValueError(f"averaging.aggregator: {exc}") from None
        if agg.kind in ("median", "trimmed-mean") and self.averaging.codec.split(":")[0] in ("topk", "dct-topk"):
            # A sparse payload is zero wherever its sender kept nothing: a per-coordinate median or trim of mostly
            # zeros drops the update instead of averaging it.
            raise ValueError(
                f"averaging.aggregator = {agg.kind} works per coordinate and would discard sparse "
                f"{self.averaging.codec} updates: use centered-clip or mean with this codec, or a dense codec"
            )
        return self

    @model_validator(mode="after")
    def _check_trainer(self) -> Config:
        if self.train.trainer == "localtrain":
            if self.train.device not in ("auto", "cpu"):
                # An error, not a warning: a user who names a GPU expects it used, and a node that quietly runs
                # at CPU speed is the surprise this setting exists to remove.
                raise ValueError(
                    f"train.trainer = localtrain runs its stages on the CPU only, but train.device = "
                    f"{self.train.device!r}: set train.device = cpu (or auto), or train.trainer = standard to "
                    "train on that device"
                )
            if self.node.inner_time_s > 0:
                raise ValueError(
                    "node.inner_time_s needs train.trainer = standard: localtrain's pipeline fixes a round's steps "
                    "when the round starts; set node.inner_steps instead"
                )
            if self.node.overlap:
                raise ValueError(
                    "node.overlap needs train.trainer = standard: localtrain's stages hold their parameters in "
                    "their own processes while a round's steps run, so theta_g cannot be merged in between two "
                    "steps; set node.overlap = false"
                )
            # Imported here: swarmtrain.localtrain.config imports this module.
            from swarmtrain.localtrain.config import check_node_config

            check_node_config(self)
        return self


def parse_value(text: str) -> Any:
    """A TOML scalar or array if ``text`` is one (``16``, ``0.5``, ``true``, ``[1, 2]``), else the string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_dotted(tree: dict[str, Any], key: str, value: Any, origins: dict[str, str], origin: str) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config error: {key} ({origin}) sets a key inside {part}, which is not a section.")
        node = child
    node[parts[-1]] = value
    origins[key] = origin


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def known_keys(model: type[BaseModel] = Config, prefix: str = "") -> dict[str, str]:
    """Every dotted key of a config model with its help text."""
    keys: dict[str, str] = {}
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys.update(known_keys(annotation, f"{prefix}{name}."))
        else:
            keys[f"{prefix}{name}"] = field.description or ""
    return keys


def _suggest(dotted: str, keys: Iterable[str]) -> str:
    """A hint for an unknown key: a close key in the same section, the same name in another section, or the
    section's keys; never a look-alike from an unrelated section (``model.bogus`` is not ``node.rounds``)."""
    section, _, leaf = dotted.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section]
    if close := difflib.get_close_matches(leaf, siblings, n=1):
        return f" Did you mean {f'{section}.' if section else ''}{close[0]}?"
    elsewhere = [k for k in keys if k.rpartition(".")[2] == leaf]
    if elsewhere:
        return f" Did you mean {elsewhere[0]}?"
    if siblings and section:
        return f" The keys of [{section}] are: {', '.join(siblings)}."
    return ""


def _named_origins(dotted: str, message: str, origins: Mapping[str, str]) -> list[str]:
    """Where the keys a section-level check names in ``message`` were set (file, variable, --set or flag)."""
    prefix = f"{dotted}." if dotted else ""
    named = [k for k in origins if k.startswith(prefix) and re.search(rf"(?<![\w.]){re.escape(k)}(?![\w])", message)]
    return list(dict.fromkeys(origins[k] for k in named))


def _explain(error: ValidationError, origins: Mapping[str, str], source: str) -> str:
    keys = known_keys()
    lines = []
    for item in error.errors():
        dotted = ".".join(str(p) for p in item["loc"])
        where = origins.get(dotted, source)
        if item["type"] == "extra_forbidden":
            lines.append(f"{dotted} is not a known setting (from {where}).{_suggest(dotted, keys)}")
        elif dotted in keys:
            message = item["msg"].removeprefix("Value error, ")
            lines.append(f"{dotted} = {item.get('input')!r} is invalid (from {where}): {message}.")
        else:
            # A check across a section's fields: its message names the keys; say where those were set rather
            # than dumping the whole section.
            message = item["msg"].removeprefix("Value error, ")
            message = message if message.endswith("...") else message.rstrip(".")
            named = _named_origins(dotted, message, origins)
            lines.append(f"{message} (from {', '.join(named)})." if named else f"{message}.")
    return (
        "config error: "
        + " ".join(lines)
        + " Fix the setting, or run `swarmtrain config` to list every key with its meaning and default."
    )


def load_config(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Resolve a config from a TOML file, ``SWARMTRAIN_`` environment variables, ``--set`` overrides and flags.

    ``overrides`` are ``"dotted.key=value"`` strings; ``flags`` maps dotted keys to values already typed by the
    CLI (``None`` values are ignored, so an unset flag never hides a file or environment value).
    """
    tree: dict[str, Any] = {}
    origins: dict[str, str] = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        source = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(
                f"config error: cannot read config file {path}: {exc.strerror}. Check the path."
            ) from None
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"config error: {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                "a TOML config must be UTF-8. Check that --config names the config file, or re-save it as UTF-8 "
                f"(e.g. `iconv -f latin1 -t utf-8 {path} > run.toml`)."
            ) from None
        try:
            loaded = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config error: {path} is not valid TOML: {exc}. Fix the file's syntax.") from None
        for key, value in _flatten(loaded):
            _set_dotted(tree, key, value, origins, str(path))
    environ = os.environ if environ is None else environ
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX):
            key = name[len(ENV_PREFIX) :].lower().replace("__", ".")
            _set_dotted(tree, key, parse_value(environ[name]), origins, f"environment variable {name}")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"config error: --set {item!r} must look like KEY=VALUE, e.g. --set train.lr=0.001.")
        _set_dotted(tree, key.strip(), parse_value(value.strip()), origins, f"--set {item}")
    for key, value in (flags or {}).items():
        if value is not None:
            _set_dotted(tree, key, value, origins, f"the --{key.rsplit('.', 1)[-1].replace('_', '-')} flag")
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, origins, source)) from None


def write_resolved(config: Config, run_dir: str | Path) -> Path:
    """Write the resolved config as JSON in the run directory (atomically), so a run is reproducible."""
    target = Path(run_dir) / "config.json"
    atomic_write_bytes(target, json.dumps(config.model_dump(), indent=2).encode() + b"\n")
    return target
