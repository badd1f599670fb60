"""Codecs that cut the bytes a pseudo-gradient costs on the wire, from lossless fp32 to 0.01 bytes per parameter.

``get_codec(spec)`` returns a codec; ``codec.encode(tensor, state)`` makes one self-describing payload (format in
``wire.py``) and ``codec.decode(payload, numel)`` checks it against the round's schema and returns the tensor.
``CodecState`` keeps a sender's error-feedback residual. ``codec.payload_size(numel) / numel`` is the figure
we compete on: bytes on the wire per parameter per sync.
"""

from swarmtrain.compression.base import BaseCodec, Codec, CodecState, all_finite
from swarmtrain.compression.registry import CODEC_NAMES, decode_payload, get_codec
from swarmtrain.compression.wire import CodecError, Header, peek_header

__all__ = [
    "CODEC_NAMES",
    "BaseCodec",
    "Codec",
    "CodecError",
    "CodecState",
    "all_finite",
    "Header",
    "decode_payload",
    "get_codec",
    "peek_header",
]
