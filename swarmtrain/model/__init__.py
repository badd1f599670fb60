"""Byte-level transformer with exits at block boundaries."""

from swarmtrain.model.transformer import VOCAB, ByteTransformer, count_parameters, param_groups

__all__ = ["VOCAB", "ByteTransformer", "count_parameters", "param_groups"]
