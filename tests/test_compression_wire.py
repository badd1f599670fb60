"""Hostile payloads: every malformed, truncated or forged payload raises CodecError, and nothing else.

A receiver decodes bytes from peers it does not trust; the only acceptable outcomes are a finite float32 tensor of
the schema's length or a CodecError, decided before anything proportional to the header's claims is allocated.
"""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmtrain.compression import CODEC_NAMES, CodecError, decode_payload, get_codec, peek_header
from swarmtrain.compression.bits import elias_fano_decode, elias_fano_encode, elias_fano_params, pack_bits, unpack_bits
from swarmtrain.compression.wire import LAYOUTS, MAGIC, pack_header

FAST = settings(max_examples=40, deadline=None)
SPECS = (
    *CODEC_NAMES,
    "topk:frac=0.2,value=int8",
    "topk:frac=0.2,value=2bit",
    "dct-topk:chunk=12,k=3,value=int4",
    "powersgd:rank=2,value=bf16",
)
NUMEL = 40


def valid_payload(spec: str, numel: int = NUMEL, seed: int = 0) -> bytes:
    return get_codec(spec).encode(torch.randn(numel, generator=torch.Generator().manual_seed(seed)))


def decode_or_reject(spec: str, payload: bytes, numel: int = NUMEL) -> None:
    """Decode hostile bytes: a CodecError, or a finite float32 tensor of length numel; nothing else."""
    try:
        y = get_codec(spec).decode(payload, numel)
    except CodecError:
        return
    assert y.dtype == torch.float32 and y.shape == (numel,) and bool(torch.isfinite(y).all())


@pytest.mark.parametrize("spec", SPECS)
def test_every_truncation_and_any_trailing_byte_is_rejected(spec: str) -> None:
    codec, payload = get_codec(spec), valid_payload(spec)
    for cut in range(len(payload)):
        with pytest.raises(CodecError):
            codec.decode(payload[:cut], NUMEL)
    with pytest.raises(CodecError, match="trailing bytes"):
        codec.decode(payload + b"\x00", NUMEL)


@FAST
@given(spec=st.sampled_from(SPECS), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=4))
def test_random_byte_flips_decode_or_raise_codec_error(spec: str, flips: list[tuple[int, int]]) -> None:
    payload = bytearray(valid_payload(spec))
    for position, mask in flips:
        payload[position % len(payload)] ^= mask
    decode_or_reject(spec, bytes(payload))


@FAST
@given(
    spec=st.sampled_from(SPECS),
    small=st.lists(st.integers(0, 70), min_size=5, max_size=5),
    scale=st.floats(width=32),
    raw=st.one_of(st.none(), st.binary(min_size=32, max_size=32)),
    seed=st.integers(0, 2**32 - 1),
)
def test_forged_parameters_with_a_body_of_the_implied_length_decode_or_raise(
    spec: str, small: list[int], scale: float, raw: bytes | None, seed: int
) -> None:
    """Forged parameters (small plausible integers, or raw bytes) with a random body of exactly the implied size."""
    codec = get_codec(spec)
    layout = LAYOUTS[codec.codec_id]
    values = [scale if field == "scale" else number for field, number in zip(layout.fields, small, strict=False)]
    params = raw[: layout.fmt.size] if raw is not None else layout.fmt.pack(*values)
    header = struct.pack("<4sBBHQ", MAGIC, 1, codec.codec_id, layout.fmt.size, NUMEL) + params
    try:
        size = codec._body_size(peek_header(header).params, NUMEL)
    except CodecError:
        return
    body = torch.randint(0, 256, (min(size, 1 << 16),), generator=torch.Generator().manual_seed(seed))
    decode_or_reject(spec, header + bytes(body.to(torch.uint8).numpy()))


@pytest.mark.parametrize("spec", SPECS)
def test_a_header_claiming_a_trillion_elements_is_rejected_without_allocating(spec: str) -> None:
    payload = valid_payload(spec, numel=10)
    forged = payload[:8] + struct.pack("<Q", 10**12) + payload[16:]
    assert peek_header(forged).numel == 10**12
    with pytest.raises(CodecError, match="claims 1000000000000 elements; the round's schema has 10"):
        get_codec(spec).decode(forged, 10)
    with pytest.raises(CodecError):  # even a schema of 10^12 elements fails on the body length, not on memory
        get_codec(spec).decode(forged, 10**12)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: b"PK\x03\x04" + p[4:], "magic"),
        (lambda p: p[:4] + bytes([2]) + p[5:], "version 2"),
        (lambda p: p[:5] + bytes([200]) + p[6:], "unknown codec id 200"),
        (lambda p: p[:6] + struct.pack("<H", 9) + p[8:], "declares 9 bytes of parameters, expected 4"),
        (lambda p: p[:10], "shorter than the 16-byte header"),
        (lambda p: p[:16] + struct.pack("<I", 0) + p[20:], "block size 0"),
        (lambda p: p[:20] + struct.pack("<f", float("nan")) + p[24:], "negative or non-finite block scale"),
        (lambda p: p[:-1] + b"\xff", "code above 254"),
    ],
)
def test_malformed_headers_and_bodies_name_the_problem(mutate: object, message: str) -> None:
    payload = valid_payload("int8:block=16")
    with pytest.raises(CodecError, match=message):
        get_codec("int8:block=16").decode(mutate(payload), NUMEL)  # type: ignore[operator]


def test_non_finite_values_and_foreign_codecs_are_rejected() -> None:
    nan_body = torch.tensor([1.0, float("nan"), 2.0]).numpy().tobytes()
    with pytest.raises(CodecError, match="non-finite"):
        get_codec("fp32").decode(pack_header(0, 3, {}) + nan_body, 3)
    with pytest.raises(CodecError, match="encoded with int8, but this round expects fp16"):
        get_codec("fp16").decode(valid_payload("int8"), NUMEL)
    wide = get_codec("dct-topk:chunk=48,k=1")
    payload = bytearray(wide.encode(torch.randn(48)))
    payload[-1] = 0xFF  # the single 6-bit index becomes 63, outside a 48-element chunk
    with pytest.raises(CodecError, match="below the chunk size 48"):
        wide.decode(bytes(payload), 48)


def test_peek_header_reads_the_codec_and_its_parameters() -> None:
    header = peek_header(valid_payload("topk:k=5,value=int8,block=32"))
    assert (header.codec, header.version, header.numel) == ("topk", 1, NUMEL)
    assert header.params == {"k": 5, "value": 3, "block": 32}
    assert header.header_size == 16 + 13


@pytest.mark.parametrize("spec", SPECS)
def test_decode_payload_dispatches_on_the_header_and_accepts_any_buffer(spec: str) -> None:
    payload = valid_payload(spec)
    expected = get_codec(spec).decode(payload, NUMEL)
    assert torch.equal(decode_payload(bytearray(payload), NUMEL), expected)
    assert torch.equal(get_codec(spec).decode(memoryview(payload), NUMEL), expected)


@FAST
@given(width=st.integers(0, 40), seed=st.integers(0, 1000), count=st.integers(0, 300))
def test_bit_packing_round_trips_at_every_width(width: int, seed: int, count: int) -> None:
    values = torch.randint(0, 1 << width, (count,), generator=torch.Generator().manual_seed(seed))
    packed = pack_bits(values, width)
    assert packed.numel() == (count * width + 7) // 8
    assert torch.equal(unpack_bits(packed, count, width), values)


@FAST
@given(indices=st.sets(st.integers(0, 99_999), max_size=500), extra=st.integers(0, 1000))
def test_elias_fano_round_trips_in_about_two_plus_log_bits(indices: set[int], extra: int) -> None:
    universe = 100_000 + extra
    sorted_indices = torch.tensor(sorted(indices), dtype=torch.int64)
    low, high = elias_fano_encode(sorted_indices, universe)
    assert torch.equal(elias_fano_decode(low, high, universe, len(indices)), sorted_indices)
    _, low_size, high_size = elias_fano_params(universe, len(indices))
    assert (low.numel(), high.numel()) == (low_size, high_size)
    if indices:
        bits = 8 * (low_size + high_size) / len(indices)
        assert bits <= 2 + torch.log2(torch.tensor(universe / len(indices))).item() + 16 / len(indices) + 1
