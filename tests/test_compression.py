"""Codec round trips: error bounds per codec, error feedback, bytes on the wire, spec strings.

Vectors are drawn by hypothesis as (length, kind, seed) and built with torch, so examples stay cheap; kinds cover
Gaussian noise, zeros, constants, huge (1e30) and tiny (1e-30) magnitudes, mixed exponents and lone spikes.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmtrain.compression import CODEC_NAMES, CodecError, CodecState, get_codec, peek_header

FAST = settings(max_examples=25, deadline=None)
KINDS = ("normal", "zeros", "constant", "huge", "tiny", "mixed", "spiky")
QUANT_LEVELS = {"int8": 255, "int4": 15, "2bit": 4}


def make_vector(numel: int, kind: str, seed: int) -> torch.Tensor:
    """A deterministic float32 test vector of one of ``KINDS``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen)
    if kind == "zeros":
        return torch.zeros(numel)
    if kind == "constant":
        return torch.full((numel,), float(x[0]) * 100)
    if kind == "huge":
        return x * 1e30
    if kind == "tiny":
        return x * 1e-30
    if kind == "mixed":
        return x * torch.pow(10.0, torch.randint(-20, 21, (numel,), generator=gen).float())
    if kind == "spiky":
        spikes = torch.randint(0, numel, (max(1, numel // 500),), generator=gen)
        return x.index_put((spikes,), x[spikes] * 1e6)
    return x


@st.composite
def vectors(draw: st.DrawFn, max_numel: int = 5000) -> torch.Tensor:
    numel = draw(st.integers(1, max_numel))
    return make_vector(numel, draw(st.sampled_from(KINDS)), draw(st.integers(0, 2**32 - 1)))


def float_tolerance(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Largest allowed |decoded - x| per element when storing ``x`` as fp32, fp16 (saturating) or bf16."""
    mag = x.abs().double()
    if kind == "fp32":
        return torch.zeros_like(mag)
    if kind == "fp16":
        return torch.where(mag > 65504, mag - 65504, mag * 2.0**-11) + 2.0**-24
    return mag * 2.0**-8 + 1e-38


def block_tolerance(x: torch.Tensor, block: int, levels: int, stochastic: bool = False) -> torch.Tensor:
    """Largest allowed |decoded - x| per element for blockwise absmax quantisation with ``levels`` levels."""
    size = max(1, min(block, x.numel()))
    pad = -x.numel() % size
    absmax = torch.nn.functional.pad(x.abs().double(), (0, pad)).view(-1, size).amax(dim=1)
    step = absmax * (2.0 if stochastic else 1.0) / (levels - 1)
    return (step * 1.0001 + 1e-44).repeat_interleave(size)[: x.numel()]


def roundtrip(spec: str, x: torch.Tensor) -> torch.Tensor:
    codec = get_codec(spec)
    payload = codec.encode(x)
    assert len(payload) == codec.payload_size(x.numel())
    y = codec.decode(payload, x.numel())
    assert y.dtype == torch.float32 and y.shape == x.shape and bool(torch.isfinite(y).all())
    return y


@FAST
@given(x=vectors(), kind=st.sampled_from(["fp32", "fp16", "bf16"]))
def test_float_codecs_round_each_element_once(x: torch.Tensor, kind: str) -> None:
    y = roundtrip(kind, x)
    assert bool(((y.double() - x.double()).abs() <= float_tolerance(x, kind)).all())


@FAST
@given(
    x=vectors(),
    name=st.sampled_from(sorted(QUANT_LEVELS)),
    block=st.sampled_from([1, 7, 64, 256]),
    stochastic=st.booleans(),
)
def test_block_quantisers_stay_within_one_step_of_each_element(
    x: torch.Tensor, name: str, block: int, stochastic: bool
) -> None:
    rounding = "stochastic,seed=3" if stochastic else "nearest"
    y = roundtrip(f"{name}:block={block},rounding={rounding}", x)
    tolerance = block_tolerance(x, block, QUANT_LEVELS[name], stochastic)
    assert bool(((y.double() - x.double()).abs() <= tolerance).all())


def test_stochastic_rounding_is_unbiased_and_seeded() -> None:
    x = torch.full((20000,), 0.3)
    x[0] = 1.0  # absmax 1: 0.3 sits between the int4 levels 2/7 and 3/7
    codec = get_codec("int4:block=20000,rounding=stochastic,seed=7")
    y = codec.decode(codec.encode(x), x.numel())
    assert abs(float(y[1:].mean()) - 0.3) < 2e-3
    assert codec.encode(x) == codec.encode(x)
    assert codec.encode(x) != get_codec("int4:block=20000,rounding=stochastic,seed=8").encode(x)


@FAST
@given(x=vectors(), frac=st.sampled_from([0.001, 0.01, 0.1, 1.0]))
def test_topk_keeps_exactly_the_largest_magnitudes(x: torch.Tensor, frac: float) -> None:
    k = min(x.numel(), max(1, math.ceil(frac * x.numel())))
    y = roundtrip(f"topk:frac={frac},value=fp32", x)
    dropped_energy = x.double().square().sort().values[: x.numel() - k].sum()
    error = (y.double() - x.double()).square().sum()
    assert float(error) == pytest.approx(float(dropped_energy), rel=1e-9, abs=1e-300)
    assert int((y != 0).sum()) <= k


@FAST
@given(x=vectors(), value=st.sampled_from(["fp16", "bf16", "int8", "int4", "2bit"]), frac=st.sampled_from([0.01, 0.2]))
def test_topk_values_are_stored_within_their_encodings_bound(x: torch.Tensor, value: str, frac: float) -> None:
    exact = roundtrip(f"topk:frac={frac},value=fp32", x)
    y = roundtrip(f"topk:frac={frac},value={value},block=16", x)
    assert bool((y[exact == 0] == 0).all())
    kept = exact.nonzero().reshape(-1)
    if value in QUANT_LEVELS:
        tolerance = block_tolerance(exact[kept], 16, QUANT_LEVELS[value])
    else:
        tolerance = float_tolerance(exact[kept], value)
    assert bool(((y[kept].double() - exact[kept].double()).abs() <= tolerance).all())


@FAST
@given(x=vectors(), chunk=st.sampled_from([1, 8, 64, 100]), k=st.integers(1, 8))
def test_dct_topk_keeps_at_least_k_over_chunk_of_the_energy(x: torch.Tensor, chunk: int, k: int) -> None:
    k = min(k, chunk)
    y = roundtrip(f"dct-topk:chunk={chunk},k={k},value=fp32", x)
    energy = x.double().square().sum()
    error = (y.double() - x.double()).square().sum()
    assert float(error) <= float(energy) * (1 - k / chunk) * (1 + 1e-5) + float(energy) * 1e-10


def test_dct_topk_sends_a_low_frequency_signal_exactly_with_one_coefficient_per_chunk() -> None:
    n = torch.arange(64, dtype=torch.float64)
    wave = torch.cos(math.pi * (2 * n + 1) * 3 / 128).float()
    x = torch.cat([wave * scale for scale in (1.0, -2.0, 0.5, 1e20)])
    y = roundtrip("dct-topk:chunk=64,k=1,value=fp32", x)
    assert torch.allclose(y, x, rtol=1e-5, atol=1e-5 * float(x.abs().max()))


@FAST
@given(x=vectors(), rank=st.integers(1, 6))
def test_powersgd_never_adds_error_beyond_the_input_norm(x: torch.Tensor, rank: int) -> None:
    y = roundtrip(f"powersgd:rank={rank}", x)
    assert float((y.double() - x.double()).norm()) <= float(x.double().norm()) * (1 + 1e-4) + 1e-40


@FAST
@given(rows=st.integers(1, 60), cols=st.integers(1, 60), rank=st.integers(1, 4), seed=st.integers(0, 1000))
def test_powersgd_reconstructs_a_low_rank_matrix(rows: int, cols: int, rank: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    matrix = torch.randn(rows, rank, generator=gen) @ torch.randn(rank, cols, generator=gen)
    y = roundtrip(f"powersgd:rank={rank},shape={rows}x{cols}", matrix.reshape(-1))
    # One power iteration in float32 recovers the span up to eps times the factors' condition number.
    assert float((y - matrix.reshape(-1)).norm()) <= 1e-3 * float(matrix.norm()) + 1e-6


ALL_SPECS = (
    *CODEC_NAMES,
    "int8:rounding=stochastic",
    "topk:frac=0.05,value=int8",
    "topk:k=3",
    "dct-topk:chunk=16,k=2,value=int8",
    "powersgd:rank=2,value=fp16",
)


@FAST
@given(x=vectors(max_numel=2000), spec=st.sampled_from(ALL_SPECS), seed=st.integers(0, 1000))
def test_error_feedback_loses_nothing(x: torch.Tensor, spec: str, seed: int) -> None:
    """decoded + new residual == input + old residual: what a round fails to send is sent later."""
    codec = get_codec(spec)
    old = torch.randn(x.numel(), generator=torch.Generator().manual_seed(seed)) * x.abs().max().clamp(1e-30, 1e30)
    state = CodecState(residual=old.clone())
    decoded = codec.decode(codec.encode(x, state), x.numel())
    assert state.residual is not None and state.step == 1
    total = x.double() + old.double()
    scale = float(total.abs().max()) + 1e-37
    assert float((decoded.double() + state.residual.double() - total).abs().max()) <= scale * 1e-6


DENSE_SPECS = tuple(spec for spec in ALL_SPECS if not get_codec(spec).sparse)


@FAST
@given(x=vectors(max_numel=2000), spec=st.sampled_from(DENSE_SPECS), seed=st.integers(0, 1000))
def test_error_feedback_in_the_callers_buffers_matches_a_codec_state(x: torch.Tensor, spec: str, seed: int) -> None:
    """What the all-reduce sends (``encode_feedback``, in place) is what ``encode`` with a fresh ``CodecState``
    sends, bit for bit: the same payload, ``decoded`` what a receiver decodes, the same new residual."""
    codec = get_codec(spec)
    old = torch.randn(x.numel(), generator=torch.Generator().manual_seed(seed)) * x.abs().max().clamp(1e-30, 1e30)
    state = CodecState(residual=old.clone())
    expected = codec.encode(x, state)
    residual, decoded = old.clone(), torch.full_like(x, float("nan"))
    payload = codec.encode_feedback(x, residual, decoded)
    assert payload == expected
    assert torch.equal(decoded, codec.decode(payload, x.numel())) and torch.equal(residual, state.residual)
    if spec == "fp32":  # lossless: everything goes out now, nothing is left for later
        assert torch.equal(decoded, x + old) and not residual.any()


@pytest.mark.parametrize("spec", DENSE_SPECS)
def test_decode_into_a_buffer_and_the_magnitude_bound(spec: str) -> None:
    codec = get_codec(spec)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 100
    payload = codec.encode(x)
    out = torch.full_like(x, float("nan"))
    assert codec.decode(payload, 1000, out=out) is out and torch.equal(out, codec.decode(payload, 1000))
    largest = float(out.abs().max())
    assert torch.equal(codec.decode(payload, 1000, bound=largest), out)
    with pytest.raises(CodecError, match=f"values beyond \\+-{largest / 2:g}"):
        codec.decode(payload, 1000, bound=largest / 2)
    with pytest.raises(ValueError, match="float32 tensor of 1000 elements"):
        codec.decode(payload, 1000, out=torch.zeros(999))


@pytest.mark.parametrize("spec", ["2bit", "topk:frac=0.05", "dct-topk:chunk=32,k=1", "powersgd:rank=4"])
def test_error_feedback_delivers_a_fixed_update_over_rounds(spec: str) -> None:
    """Resending one update, the mean of what arrives converges to it as 1/rounds: the residual stays bounded."""
    codec, state = get_codec(spec), CodecState()
    x = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    received = torch.zeros_like(x)
    errors = {}
    for rounds in range(1, 201):
        received += codec.decode(codec.encode(x, state), x.numel())
        errors[rounds] = float((received / rounds - x).norm() / x.norm())
    assert errors[200] < 0.1
    assert errors[200] < 0.6 * errors[100]


def test_powersgd_warm_start_improves_over_rounds() -> None:
    gen = torch.Generator().manual_seed(1)
    matrix = torch.randn(80, 3, generator=gen) @ torch.randn(3, 80, generator=gen) + 0.01 * torch.randn(80, 80)
    codec, state = get_codec("powersgd:rank=3,shape=80x80"), CodecState()
    for _ in range(3):
        codec.encode(matrix.reshape(-1), state)
        state.residual = None  # same input each round: the warm start alone must converge
    y = codec.decode(codec.encode(matrix.reshape(-1), state), 6400)
    assert state.warm_q is not None and state.warm_q.shape == (80, 3)
    assert float((y - matrix.reshape(-1)).norm() / matrix.norm()) < 0.02


@pytest.mark.parametrize(
    ("spec", "numel", "low", "high"),
    [
        ("fp32", 100_000, 4.0, 4.0002),
        ("fp16", 100_000, 2.0, 2.0002),
        ("bf16", 100_000, 2.0, 2.0002),
        ("int8", 100_000, 1.0625, 1.0628),
        ("int4", 100_000, 0.5625, 0.5628),
        ("2bit", 100_000, 0.3125, 0.3128),
        ("topk:frac=0.01", 100_000, 0.028, 0.032),
        ("topk:frac=0.01,value=int8", 100_000, 0.019, 0.022),
        ("topk:frac=0.01,value=2bit", 100_000, 0.0140, 0.0143),
        ("dct-topk", 100_000, 0.0429, 0.0433),
        ("dct-topk:value=int8", 100_000, 0.0283, 0.0287),
        ("powersgd:rank=4", 10_000_000, 0.0101, 0.01013),
        ("topk:frac=0.01", 10_000_000, 0.0305, 0.031),
    ],
)
def test_bytes_per_parameter_match_the_docstrings(spec: str, numel: int, low: float, high: float) -> None:
    assert low <= get_codec(spec).payload_size(numel) / numel <= high


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("numel", [0, 1, 2, 63, 65, 1000])
def test_payload_size_is_exact_for_every_length(spec: str, numel: int) -> None:
    codec = get_codec(spec)
    x = make_vector(numel, "normal", numel)
    payload = codec.encode(x)
    assert len(payload) == codec.payload_size(numel)
    assert peek_header(payload).numel == numel and peek_header(payload).codec == codec.name
    assert codec.decode(payload, numel).shape == (numel,)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_spec_round_trips_through_get_codec(spec: str) -> None:
    codec = get_codec(spec)
    assert get_codec(codec.spec) == codec
    assert codec.sparse == (codec.name in {"topk", "dct-topk", "powersgd"})


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("zstd", "valid codecs are: fp32, fp16, bf16, int8, int4, 2bit, topk, powersgd, dct-topk"),
        ("int8:blok=64", "its options are: block, rounding, seed"),
        ("int8:block=0", "must be in [1,"),
        ("int8:block=x", "not an integer"),
        ("int8:block", "not key=value"),
        ("int8:block=8,block=9", "given twice"),
        ("topk:frac=2", "must be in (0, 1]"),
        ("topk:frac=0.1,k=5", "frac or k, not both"),
        ("topk:value=int3", "must be one of fp32, fp16, bf16, int8, int4, 2bit"),
        ("powersgd:shape=12", "ROWSxCOLS"),
        ("dct-topk:chunk=4096", "must be in [1, 1024]"),
    ],
)
def test_invalid_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(CodecError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        get_codec(spec)


@pytest.mark.parametrize("spec", DENSE_SPECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_encode_refuses_a_non_finite_update_with_or_without_error_feedback(spec: str, bad: float) -> None:
    """fp16 and bf16 round straight into the payload, where a value beyond their range turns to inf as well: that
    one is clamped and sent, a NaN or inf in the update itself is refused, in both entry points."""
    codec, x = get_codec(spec), torch.tensor([1.0, bad, 3.0])
    with pytest.raises(CodecError, match="non-finite"):
        codec.encode(x)
    with pytest.raises(CodecError, match="non-finite"):
        codec.encode_feedback(x, torch.zeros(3), torch.zeros(3))
    beyond = torch.tensor([1e38, -3e38, 2.0])  # finite in fp32, beyond fp16 (and, rounded, near bf16's max)
    assert bool(torch.isfinite(codec.decode(codec.encode(beyond), 3)).all())


def test_encode_rejects_non_finite_input_and_wrong_shapes() -> None:
    codec = get_codec("int8")
    with pytest.raises(CodecError, match="non-finite"):
        codec.encode(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="1-D float"):
        codec.encode(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="one CodecState per tensor slice"):
        codec.encode(torch.zeros(3), CodecState(residual=torch.zeros(4)))
    with pytest.raises(CodecError, match="holds 12 elements"):
        get_codec("powersgd:shape=3x4").encode(torch.zeros(10))
