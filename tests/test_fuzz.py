"""Fuzz targets: hostile input into every parser a peer or a user can reach, checked by property.

Each target takes generated input and allows one outcome besides success: the module's own clean error
(``CodecError``, ``BadMessage``, a refusal with a reason, ``ConfigError``). Anything else is a crash, and a crash
fails the test. The targets:
- the payload decoder, with the round's codec and with whatever codec a header names;
- the RPC header reader, and every RPC handler of a node, on generated headers;
- DHT peer records, as a reader parses them;
- config values and multiaddrs.

The default suite runs 150 inputs per target (hypothesis' engine). The ``slow`` test runs ``FUZZ_EXAMPLES``
(100,000) per target, with a per-input deadline (no hang) and a bound on the process's peak memory growth:

    python -m pytest -q -m slow tests/test_fuzz.py
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import random
import resource
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmtrain.averaging import PROTOCOL_VERSION, Averager
from swarmtrain.compression import CodecError, decode_payload, get_codec
from swarmtrain.config import load_config
from swarmtrain.dht import PeerRecord, read_record
from swarmtrain.errors import ConfigError
from swarmtrain.net import MemoryNetwork, RemoteError, RpcTimeout, SwarmAuth, serve_hello
from swarmtrain.net.rpc import BadMessage, unpack_header

FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", 100_000))
FAST = settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
INPUT_DEADLINE = 5.0  # seconds one input may take (a hang would take the test's timeout)
MAX_RSS_GROWTH = 512 << 20  # a leak of a few KiB per input would show over 100,000 inputs

NUMEL = 64
SPECS = ["fp32", "fp16", "int8", "2bit", "topk:frac=0.2,value=int4", "dct-topk:chunk=16,k=4", "powersgd:rank=2"]
HEADER = {"run": "test", "v": PROTOCOL_VERSION}

# ---- strategies ---------------------------------------------------------------------------------------------

# What msgpack can carry (integers of at most 64 bits), since peers send msgpack.
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=40),
    st.binary(max_size=40),
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = ["run", "v", "round", "weight", "numel", "codec", "group", "chunk", "digest", "index", "frames", "auth"]
FIELDS += list(PeerRecord.model_fields)


def mutated(base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """``base`` with some fields replaced, dropped or added: gets past the first checks more often than noise."""
    changes = st.dictionaries(st.sampled_from(FIELDS), values, max_size=4)
    drops = st.sets(st.sampled_from(sorted(base)), max_size=2)
    return st.builds(lambda c, d: {k: v for k, v in {**base, **c}.items() if k not in d}, changes, drops)


@functools.cache
def valid_payload(spec: str, seed: int) -> bytes:
    return get_codec(spec).encode(torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)))


payloads = st.one_of(
    st.binary(max_size=600),
    st.builds(
        lambda spec, seed, flips, cut: bytes(_flip(valid_payload(spec, seed), flips))[:cut],
        st.sampled_from(SPECS),
        st.integers(0, 3),
        st.lists(st.tuples(st.integers(0, 10**4), st.integers(1, 255)), max_size=4),
        st.integers(0, 2000),
    ),
)


def _flip(payload: bytes, flips: list[tuple[int, int]]) -> bytearray:
    data = bytearray(payload)
    for position, mask in flips:
        data[position % len(data)] ^= mask
    return data


ODD_FLOATS = (math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, -1e-308, 2.0**64)
ODD_CHARS = ("/", "=", ",", "0", "\x00", "\u00e9", "[", "]", '"', "9" * 30)
ODD_INTS = (0, -1, 1, 2**31, 2**32, 2**63 - 1, -(2**63), 2**64 - 1)


def mutate(value: Any, rng: random.Random) -> Any:
    """One small random change deep inside ``value`` (a byte, a character, a number, an entry): the cheap
    neighbours of an input hypothesis drew, so the slow test runs many inputs per draw."""
    if isinstance(value, bool) or value is None:
        return rng.choice((None, True, False, 0, "", b""))
    if isinstance(value, bytes | bytearray):
        data = bytearray(value)
        if not data or rng.random() < 0.2:
            return bytes(data[: rng.randrange(len(data) + 1)]) + rng.randbytes(rng.randrange(3))
        data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
        return bytes(data)
    if isinstance(value, str):
        at = rng.randrange(len(value) + 1)
        return value[:at] + rng.choice(ODD_CHARS) + value[at + 1 :]
    if isinstance(value, int):
        return rng.choice((rng.choice(ODD_INTS), value + rng.randrange(-3, 4), -value))
    if isinstance(value, float):
        return rng.choice((rng.choice(ODD_FLOATS), value * rng.choice((-1.0, 0.5, 2.0, 1e300))))
    if isinstance(value, list):
        if not value or rng.random() < 0.2:
            return [*value, rng.choice(ODD_INTS)]
        at = rng.randrange(len(value))
        return [*value[:at], mutate(value[at], rng), *value[at + 1 :]]
    if isinstance(value, dict):
        if not value or rng.random() < 0.2:
            return {**value, rng.choice(FIELDS): rng.choice((*ODD_INTS, *ODD_FLOATS, "", None))}
        key = rng.choice(list(value))
        if rng.random() < 0.2:
            return {k: v for k, v in value.items() if k != key}
        return {**value, key: mutate(value[key], rng)}
    return value


# ---- targets ------------------------------------------------------------------------------------------------


def payload_target(spec: str, data: bytes) -> None:
    for decode in (lambda: get_codec(spec).decode(data, NUMEL), lambda: decode_payload(data, NUMEL)):
        try:
            out = decode()
        except CodecError:
            continue
        assert out.dtype == torch.float32 and out.shape == (NUMEL,) and bool(torch.isfinite(out).all())


def header_target(raw: bytes) -> None:
    try:
        header = unpack_header(raw)
    except BadMessage:
        return
    assert isinstance(header, dict)


class Node:
    """One node's RPC handlers on the memory transport, called by a stranger in the same swarm."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        net = MemoryNetwork()
        self.node = Averager(
            net.transport("node", SwarmAuth(b"k" * 32)), torch.zeros(NUMEL), run_id="test", group_size=4,
            outer_lr=0.7, outer_momentum=0.9, codec_up=get_codec("fp16"), codec_down=get_codec("fp16"),
            part_numel=1024, min_deadline=1.0, deadline_factor=2.0,
        )  # fmt: skip
        self.node.matchmaker.join_timeout = 0.01  # a join that passes every check waits for a group: not here
        self.loop.run_until_complete(self.node.start())
        self.loop.run_until_complete(serve_hello(self.node.transport))
        self.caller = net.transport("caller", SwarmAuth(b"k" * 32))

    def call(self, method: str, header: dict[str, Any]) -> None:
        try:
            self.loop.run_until_complete(self.caller.call("node", method, header, timeout=0.002))
        except RemoteError as exc:
            assert "internal error" not in str(exc), f"{method} {header!r}: the handler crashed"
        except RpcTimeout:
            pass  # a message for a group this node has not formed waits for it a while: a refusal, in time

    def close(self) -> None:
        for task in asyncio.all_tasks(self.loop):
            task.cancel()
        self.loop.run_until_complete(asyncio.sleep(0))
        self.loop.close()


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    n = Node()
    yield n
    n.close()


def rpc_target(node: Node, method: str, header: dict[str, Any]) -> None:
    try:
        msgpack.packb(header, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return  # no peer can send it: msgpack carries integers of at most 64 bits
    node.call(method, header)


def record_target(subkey: Any, value: Any) -> None:
    for auth in (SwarmAuth(), SwarmAuth(b"k" * 32, frozenset({"QmX"}))):
        record = read_record(subkey, value, auth)
        assert record is None or (math.isfinite(record.inner_s) and math.isfinite(record.tokens_per_s))


CONFIG_KEYS = ["node.join", "node.host", "node.announce", "node.allow_peers", "node.run_id", "averaging.fail_at"]
CONFIG_KEYS += ["averaging.group_size", "train.lr", "node.heartbeat_s", "model.width", "no.such_key"]


def config_target(key: str, text: str, as_list: bool) -> None:
    try:
        if as_list:
            load_config(flags={key: [text]}, environ={})
        else:
            load_config(overrides=[f"{key}={text}"], environ={})
    except ConfigError:
        pass


# ---- strategies per target, shared by the fast and the slow test --------------------------------------------

VALID_RECORD = PeerRecord(
    peer_id="QmX", proto=PROTOCOL_VERSION, run_id="test", round=1, phase="training", tokens_per_s=1.0, batch_size=1
).model_dump()  # fmt: skip
multiaddr_text = st.one_of(
    st.text(max_size=60),
    st.lists(
        st.sampled_from(["ip4", "ip6", "tcp", "udp", "p2p", "dns", "quic", "127.0.0.1", "::1", "0", "99999", "Qm"]),
        max_size=8,
    ).map(lambda parts: "/" + "/".join(parts)),
)

# target: (function, strategies of its arguments); MUTABLE: the arguments the slow test's mutants change
TARGETS: dict[str, tuple[Callable[..., None], dict[str, st.SearchStrategy[Any]]]] = {
    "payload": (payload_target, {"spec": st.sampled_from(SPECS), "data": payloads}),
    "header": (
        header_target,
        {"raw": st.one_of(st.binary(max_size=200), values.map(lambda v: msgpack.packb(v, use_bin_type=True)))},
    ),
    "record": (
        record_target,
        {
            "subkey": st.one_of(st.binary(max_size=80), st.text(max_size=10), st.none()),
            "value": st.one_of(values, mutated({**VALID_RECORD, "mac": ""})),
        },
    ),
    "config": (
        config_target,
        {"key": st.sampled_from(CONFIG_KEYS), "text": multiaddr_text, "as_list": st.booleans()},
    ),
}
MUTABLE = {"payload": ("data",), "header": ("raw",), "record": ("subkey", "value"), "config": ("text",)}
MUTABLE["rpc"] = ("header",)
MUTANTS = 9  # inputs derived from each draw in the slow test
RPC_METHODS = ["join", "ping", "state", "report", "digest", "hello"]
JOIN = {**HEADER, "round": 0, "weight": 1.0, "numel": NUMEL, "digest": "", "group": "g", "chunk": 1024}
RPC = {
    "method": st.sampled_from(RPC_METHODS),
    "header": st.one_of(mutated(JOIN), st.dictionaries(st.text(max_size=6), values, max_size=5)),
}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_fuzz_fast(target: str) -> None:
    function, strategies = TARGETS[target]
    FAST(given(**strategies)(function))()


def test_fuzz_rpc_handlers_fast(node: Node) -> None:
    FAST(given(**RPC)(lambda method, header: rpc_target(node, method, header)))()


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.fixture
def quiet() -> Iterator[None]:
    """Refusals are logged as warnings; 100,000 of them would time the logger, not the parsers."""
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.usefixtures("quiet")
@pytest.mark.parametrize("target", [*sorted(TARGETS), "rpc"])
def test_fuzz_slow(target: str, node: Node) -> None:
    """FUZZ_EXAMPLES inputs per target: draws by hypothesis from seeded random bytes (``fuzz_one_input``, the
    entry point hypothesis offers fuzzers), each followed by ``MUTANTS`` inputs that change it a little (a draw
    costs ~2 ms of hypothesis here, a mutant microseconds). No crash, no input over ``INPUT_DEADLINE``, peak
    memory bounded. A failing draw replays from its target name: the byte source is ``random.Random(target)``."""
    if target == "rpc":
        function, strategies = (lambda method, header: rpc_target(node, method, header)), RPC
    else:
        function, strategies = TARGETS[target]
    slowest, inputs = 0.0, 0

    def timed(**kwargs: Any) -> None:
        nonlocal slowest, inputs
        rng = random.Random(repr(sorted(kwargs.items(), key=lambda kv: kv[0])))
        variants = [kwargs]
        for _ in range(MUTANTS):
            name = rng.choice(MUTABLE[target])
            variants.append({**variants[-1], name: mutate(variants[-1][name], rng)})
        for variant in variants:
            started = time.perf_counter()
            function(**variant)
            slowest = max(slowest, time.perf_counter() - started)
        inputs += len(variants)

    fuzz = settings(database=None, deadline=None)(given(**strategies)(timed)).hypothesis.fuzz_one_input
    rng = random.Random(target)
    before = peak_rss()
    while inputs < FUZZ_EXAMPLES:
        fuzz(rng.randbytes(rng.choice((64, 256, 1024, 4096))))
    grown = peak_rss() - before
    assert grown < MAX_RSS_GROWTH, f"{target}: peak memory grew by {grown >> 20} MiB over {FUZZ_EXAMPLES} inputs"
    assert slowest < INPUT_DEADLINE, f"{target}: one input took {slowest:.2f} s"


def test_the_targets_see_both_outcomes() -> None:
    """The fuzz targets are not vacuous: valid input succeeds and each kind of bad input is refused."""
    assert get_codec("fp16").decode(valid_payload("fp16", 0), NUMEL).shape == (NUMEL,)
    with pytest.raises(CodecError):
        get_codec("fp16").decode(valid_payload("fp16", 0)[:-1], NUMEL)
    with pytest.raises(BadMessage):
        unpack_header(struct.pack("<I", 7))
    assert read_record(b"QmX", VALID_RECORD) is None  # not signed by QmX's identity
    with pytest.raises(ConfigError, match="not a valid multiaddr"):
        load_config(flags={"node.join": ["/ip4/999.1.1.1/tcp/1"]}, environ={})
    with pytest.raises(ConfigError, match="not a peer id"):
        load_config(flags={"node.allow_peers": ["QmX"]}, environ={})
