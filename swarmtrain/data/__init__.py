"""Byte corpora and batches."""

from swarmtrain.data.batches import eval_starts, train_batch, windows
from swarmtrain.data.corpus import Corpus, load_corpus, load_parts, looks_like_text, stdlib_root

__all__ = [
    "Corpus",
    "eval_starts",
    "load_corpus",
    "load_parts",
    "looks_like_text",
    "stdlib_root",
    "train_batch",
    "windows",
]
