"""Codec lookup by spec string, and decoding a payload by what its header says it is.

A spec is a codec name optionally followed by options: ``"fp16"``, ``"int8:block=64"``,
``"topk:frac=0.01,value=int8"``, ``"powersgd:rank=4,shape=1024x4096"``. Each codec's docstring lists its options.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from swarmtrain.compression.base import BaseCodec, Options
from swarmtrain.compression.dense import Bf16Codec, Fp16Codec, Fp32Codec
from swarmtrain.compression.lowrank import PowerSGDCodec
from swarmtrain.compression.quant import Int4Codec, Int8Codec, TwoBitCodec
from swarmtrain.compression.sparse import DctTopKCodec, TopKCodec
from swarmtrain.compression.wire import CodecError, peek_header

_FACTORIES: dict[str, Callable[[Options], BaseCodec]] = {
    "fp32": Fp32Codec.from_options,
    "fp16": Fp16Codec.from_options,
    "bf16": Bf16Codec.from_options,
    "int8": Int8Codec.from_options,
    "int4": Int4Codec.from_options,
    "2bit": TwoBitCodec.from_options,
    "topk": TopKCodec.from_options,
    "powersgd": PowerSGDCodec.from_options,
    "dct-topk": DctTopKCodec.from_options,
}

CODEC_NAMES: tuple[str, ...] = tuple(_FACTORIES)


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split ``"name:key=value,key=value"`` into the name and its options."""
    name, _, rest = spec.strip().partition(":")
    options: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise CodecError(f"codec spec {spec!r}: option {item!r} is not key=value")
        if key.strip() in options:
            raise CodecError(f"codec spec {spec!r}: option {key.strip()!r} is given twice")
        options[key.strip()] = value.strip()
    return name.strip().lower(), options


def get_codec(spec: str) -> BaseCodec:
    """The codec a spec string names, e.g. ``get_codec("int8:block=64")``; ``CodecError`` if it is invalid."""
    name, options = parse_spec(spec)
    factory = _FACTORIES.get(name)
    if factory is None:
        raise CodecError(f"unknown codec {name!r} in spec {spec!r}; valid codecs are: {', '.join(CODEC_NAMES)}")
    return factory(Options(name, options))


def decode_payload(payload: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
    """Decode a payload with whichever codec and parameters its header names (for tools and tests; a round's
    receiver decodes with the round's codec, which refuses other parameters)."""
    header = peek_header(payload)
    return get_codec(header.codec).decode(payload, numel, agreed=False)
